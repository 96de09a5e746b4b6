"""Shared test setup: CPU-only JAX, and torchvision made importable next to the CPU torch."""

import ast
import contextlib
import fcntl
import functools
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import tempfile

from attnjax import compat
from attnjax.train import collector

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole suite and every subprocess it starts (they
# inherit the environment): most of the suite's time is XLA compiling the same tiny programs.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache"),
)
# Not the programs that compile in under 0.2 s (attnjax's own threshold): thousands of single
# operations, whose writes cost more than their reads save (the tests of attnjax/models and
# attnjax/ops took 208 s with every program written, 201 s with no cache, 194 s with only those
# over 1 s).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# libtpu (compile-only TPU devices) otherwise takes a lock that the other xdist worker then
# fails on.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# Tests patch the code a program is traced from (a kernel choice, a fault), which the key of a
# kept executable cannot see: every run traces (tests/train/test_executables.py and
# test_compilation_cache.py turn it on for themselves).
os.environ["ATTNJAX_EXECUTABLE_CACHE"] = "off"
# Outcomes must not hang on timing: the CPU choices attnjax.ops.autotune would time on this
# machine take their fixed defaults; tests that check a choice set it themselves.
os.environ["ATTNJAX_CPU_AUTOTUNE"] = "0"
# The suite checks values, not speed: LLVM at -O0 and XLA's loop emitters instead of its fusion
# emitters (where this jaxlib still has them) compile its programs in about 60% of the default's
# time and compute the same values to float32 rounding; LLVM code generated in one part rather
# than parts on a thread pool takes 7-28% less CPU again, and the suite's two workers are bound
# by CPU (benchmarks/results/compile_flags.md). Subprocesses inherit them through
# helpers.xla_flags.
os.environ["XLA_FLAGS"] = " ".join(
    dict.fromkeys(
        [
            *os.environ.get("XLA_FLAGS", "").split(),
            "--xla_backend_optimization_level=0",
            *compat.xla_cpu_loop_emitter_flags(),
            "--xla_cpu_parallel_codegen_split_count=1",
        ]
    )
)

import numpy as np
import pytest

# Each worker traces thousands of programs: train.py's collector thresholds (attnjax/train/
# collector.py), which its subprocesses set for themselves.
collector.raise_thresholds()

# timm and lpips import torchvision, whose PyPI build links CUDA libraries the CPU torch lacks.
# (The environment of `make test-cuda` has no torch.)
if importlib.util.find_spec("torch") is not None:
    from attnjax.convert.common import make_torchvision_importable

    make_torchvision_importable()

# The PyTorch references. Where they are not installed (`make test-newest`: PyPI has no CPU
# PyTorch for its Python, only a CUDA build of several GB), the test files and notebooks that use
# them are not collected, and the report's header names them; `make test` installs them and
# collects everything.
REFERENCES = ("torch", "torchvision", "timm", "lpips", "taming", "pytorch_fid", "torch_fidelity")
REFERENCE_FIXTURES = ("lpips_reference", "inception_weights")
TESTS = pathlib.Path(__file__).parent
HAS_REFERENCES = importlib.util.find_spec("torch") is not None


def _imported(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def needs_references(path: pathlib.Path) -> bool:
    """Whether the test file or notebook ``path`` imports a PyTorch reference, uses a fixture
    that does, or calls a function of tests/helpers.py that does."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join(
            line
            for cell in cells
            if cell["cell_type"] == "code"
            for line in "".join(cell["source"]).splitlines()
            if not line.lstrip().startswith(("%", "!"))
        )
        return bool(_imported(ast.parse(code)) & set(REFERENCES))
    tree = ast.parse(path.read_text())
    helpers = ast.parse((TESTS / "helpers.py").read_text())
    helpers_needing = {
        node.name
        for node in helpers.body
        if isinstance(node, ast.FunctionDef) and _imported(node) & set(REFERENCES)
    }
    from_helpers = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "helpers"
        for alias in node.names
    }
    arguments = {
        argument.arg
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        for argument in node.args.args
    }
    return bool(
        _imported(tree) & set(REFERENCES)
        or from_helpers & helpers_needing
        or arguments & set(REFERENCE_FIXTURES)
    )


collect_ignore = []
if not HAS_REFERENCES:
    collect_ignore = sorted(
        str(path.relative_to(TESTS)) for path in TESTS.rglob("test_*.py") if needs_references(path)
    )


def pytest_report_header(config):
    versions = []
    for package in ("jax", "jaxlib", "libtpu", "flax", "optax", "orbax-checkpoint", "chex"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(f"{package} {importlib.metadata.version(package)}")
    for package in ("grain", "tensorflow-datasets", "numpy", "torch"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(f"{package} {importlib.metadata.version(package)}")
    lines = [f"attnjax on Python {platform.python_version()}: " + ", ".join(versions)]
    if collect_ignore:
        lines.append(
            f"no PyTorch here: {len(collect_ignore)} test files that compare with it are not "
            f"collected: {', '.join(collect_ignore)}"
        )
    return lines


def _parameter_needs_references(item) -> bool:
    parameters = getattr(item, "callspec", None)
    parameters = parameters.params.values() if parameters else ()
    return any(isinstance(p, pathlib.Path) and needs_references(p) for p in parameters)


@contextlib.contextmanager
def made_once(tmp_path_factory, name):
    """Yields ``(path, made)`` under a lock, ``path`` a directory shared by every xdist worker
    of this session (each worker's own session otherwise): what the first worker makes there,
    the others find ``made``. Mark the artefact complete by creating ``path / "made"``."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / name
    path.mkdir(exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield path, (path / "made").exists()


@pytest.fixture(scope="session", autouse=True)
def _temporary_directory(tmp_path_factory):
    """What the tests and their processes leave in the temporary directory (TFDS's preparation
    directories, a notebook's workdir) lands in this session's, which pytest deletes with the
    sessions before the last three, not in /tmp for good: CI shares this machine's disk."""
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # gettempdir() reads $TMPDIR again
    yield
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory):
    """A TFDS data dir holding the embedded digits, prepared once for the whole session."""
    from attnjax import data

    with made_once(tmp_path_factory, "tfds") as (path, made):
        if not made:
            data.load_source("digits", "train", str(path))  # prepares both splits
            (path / "made").touch()
    return str(path)


@pytest.fixture(scope="session")
def trained_runs(digits_dir, tmp_path_factory):
    """The tiny ViT, VQGAN and prior runs of helpers.train_tiny_runs, trained once per session
    -> ``{"vit": workdir, "vqgan": workdir, "prior": workdir}``. Tests only read them."""
    from helpers import train_tiny_runs

    with made_once(tmp_path_factory, "runs") as (path, made):
        runs = {name: str(path / name) for name in ("vit", "vqgan", "prior")}
        if not made:
            train_tiny_runs(digits_dir, runs)
            (path / "made").touch()
    return runs


@pytest.fixture(scope="session")
def tpu_devices():
    """``tpu_devices("v5e:2x2")`` -> libtpu's compile-only devices of that topology (no TPU
    needed: programs compile for them, they do not run)."""
    from attnjax.compile import targets

    @functools.cache
    def devices(name: str):
        return targets.parse(f"tpu:{name}").devices

    return devices


@pytest.fixture(scope="session")
def inception_weights(tmp_path_factory):
    """helpers.random_fid_inception's state dict saved as pytorch-fid's ``.pth`` and converted
    by ``attnjax.convert.inception``, once per session -> ``{"pth": path, "npz": path}``."""
    with made_once(tmp_path_factory, "inception") as (path, made):
        files = {"pth": str(path / "pt_inception.pth"), "npz": str(path / "inception.npz")}
        if not made:
            import torch
            from helpers import random_fid_inception

            from attnjax.convert import inception as convert

            torch.save(random_fid_inception().state_dict(), files["pth"])
            assert convert.main([files["pth"], files["npz"]]) == 0
            (path / "made").touch()
    return files


@pytest.fixture(scope="session")
def train_py():
    """``train_py(argv)``: ``train.py``'s arguments (``--config FILE[:ARG]``, its overrides,
    ``--workdir``) parsed as train.py parses them and the run made in this process -> its final
    metrics (the commands a docs page gives, run by its test)."""
    from absl import flags
    from ml_collections import config_flags

    from attnjax.tasks import train_and_evaluate

    def train(argv):
        values = flags.FlagValues()
        argv = ["train.py", *argv]
        config_flags.DEFINE_config_file("config", None, flag_values=values, sys_argv=argv)
        flags.DEFINE_string("workdir", None, "", flag_values=values)
        values(argv)
        return train_and_evaluate(values.config, values.workdir)

    return train


@pytest.fixture(scope="session")
def as_host():
    """``as_host(host, [sys.executable, SCRIPT or "-c" CODE, *args]) -> argv`` that runs the
    Python command under the hostname ``host``: in a UTS namespace of its own (``unshare --uts``)
    where this user may make one, else with Python's ``socket.gethostname`` answering ``host``
    (tests/as_host.py). Either way the process keeps its pid: signals sent to it reach Python."""
    import subprocess

    try:
        probe = ["unshare", "--uts", "sh", "-c", "hostname probe-host && hostname"]
        done = subprocess.run(probe, capture_output=True, text=True, timeout=10)
        unshare = done.returncode == 0 and done.stdout.strip() == "probe-host"
    except (OSError, subprocess.TimeoutExpired):
        unshare = False

    def command(host: str, argv: list) -> list:
        if unshare:
            return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host, *argv]
        return [argv[0], str(TESTS / "as_host.py"), host, *argv[1:]]

    return command


@pytest.fixture(scope="session")
def gcs():
    """A Cloud Storage server on localhost (tests/gcs_server.py) holding the bucket ``test``,
    this session's clients pointed at it -> the environment variables that point a subprocess's
    clients (gcsfs, TensorStore) at it too."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    url = f"http://localhost:{port}"
    settings = {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
        # The bucket-type probe asks an API the server does not have, and warns on each path.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }
    server = subprocess.Popen(
        [sys.executable, str(TESTS / "gcs_server.py"), str(port), "test"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the server logs each client that closes a connection
        text=True,
    )
    assert server.stdout.readline().strip() == "ready"
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield settings
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture
def np_rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def lpips_reference():
    """The ``lpips`` package's VGG LPIPS with a random trunk (no download) and its shipped
    linear layers."""
    import lpips as torch_lpips
    import torch

    torch.manual_seed(0)
    return torch_lpips.LPIPS(net="vgg", pnet_rand=True, verbose=False).eval()


def pytest_itemcollected(item):
    """A test that uses a module-scoped fixture runs on the worker of the other tests of its module
    that use one: under ``--dist loadgroup`` ungrouped tests go to either worker, and each worker
    would build the fixture again (the GPU check's dry run, a 30 s subprocess, ran twice)."""
    if item.get_closest_marker("xdist_group") is not None:
        return
    info = getattr(item, "_fixtureinfo", None)
    fixtures = info.name2fixturedefs.values() if info is not None else ()
    if any(d.scope == "module" for defs in fixtures for d in defs):
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))


# Longest first, so that no xdist worker is left alone with a long group at the end: the
# multi-process runs, the fault runs and the tests of the trained runs (their xdist groups).
LONGEST = ("multiprocess", "faults", "trained_runs")


def pytest_collection_modifyitems(config, items):
    if not HAS_REFERENCES:
        # Parametrised over files (the notebooks): those that import a reference.
        deselected = [item for item in items if _parameter_needs_references(item)]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if item not in deselected]

    def rank(item):
        groups = [mark.args[0] for mark in item.iter_markers("xdist_group")]
        return min((LONGEST.index(g) for g in groups if g in LONGEST), default=len(LONGEST))

    items.sort(key=rank)  # stable: the order within a rank is the collection's


@pytest.fixture(scope="session")
def digits_folder(digits_dir, tmp_path_factory):
    """The embedded digits written as PNG files (``helpers.write_digits_folder``), once for the
    whole session. Tests only read it."""
    from helpers import write_digits_folder

    with made_once(tmp_path_factory, "digits_png") as (path, made):
        if not made:
            write_digits_folder(digits_dir, path / "images")
            (path / "made").touch()
    return str(path / "images")
