"""The import direction of attnjax/, read from the source with ``ast``: nothing imports upwards.

Each package of attnjax/ is a layer; a module may import its own layer and those below, never
above (the table below is checked against ``PACKAGES``):

    0  attnjax.compat     what moved between the JAX releases attnjax supports
    0  attnjax.xla_cpu    XLA:CPU's flags for speed, set before the backend starts
    0  attnjax.huge_pages how commands start: large host blocks on transparent huge pages
    0  attnjax.storage    a run's files on a local disk or in a gs:// bucket, one path type
    0  attnjax.ops        pure functions: attention and its kernels, masks, positional
                          encodings, convolution, losses
    1  attnjax.models     Linen modules: ViT, Transformer, VQGAN, quantizers, discriminator,
                          LPIPS, the GPT prior and its sampler
    2  attnjax.data       TFDS + grain input pipelines, transforms, PNG pictures
    2  attnjax.convert    weights from and to PyTorch and Google files
    2  attnjax.metrics    FID statistics, IS, precision/recall, KID, feature extraction, image
                          sources
    2  attnjax.parallel   meshes and partition rules, placement over devices and processes,
                          launching, elastic resume, the watchdog
    3  attnjax.train      the loop and what it stands on: optimiser, checkpoints, reliability,
                          metrics
    4  attnjax.tasks      what each task adds: classification, vqgan, prior
    5  attnjax.inference  trained runs used: sampling command, export
    5  attnjax.compile    a config compiled for TPUs or GPUs it does not run on: memory, FLOPs,
                          predicted throughput
    6  attnjax.fid        the FID command
    6  train.py, demo.py, benchmarks/ (outside the package)

Only attnjax/convert/ may import PyTorch or its ecosystem.
"""

import ast
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "attnjax"

PACKAGES = (  # (package, layer, what it holds), bottom to top
    ("attnjax.compat", 0, "what moved between the JAX releases attnjax supports"),
    ("attnjax.xla_cpu", 0, "XLA:CPU's flags for speed, set before the backend starts"),
    ("attnjax.huge_pages", 0, "how commands start: large host blocks on transparent huge pages"),
    ("attnjax.storage", 0, "a run's files on a local disk or in a gs:// bucket, one path type"),
    (
        "attnjax.ops",
        0,
        "pure functions: attention and its kernels, masks, positional encodings, "
        "convolution, losses",
    ),
    (
        "attnjax.models",
        1,
        "Linen modules: ViT, Transformer, VQGAN, quantizers, discriminator, "
        "LPIPS, the GPT prior and its sampler",
    ),
    ("attnjax.data", 2, "TFDS + grain input pipelines, transforms, PNG pictures"),
    ("attnjax.convert", 2, "weights from and to PyTorch and Google files"),
    (
        "attnjax.metrics",
        2,
        "FID statistics, IS, precision/recall, KID, feature extraction, image sources",
    ),
    (
        "attnjax.parallel",
        2,
        "meshes and partition rules, placement over devices and processes, launching, elastic "
        "resume, the watchdog",
    ),
    (
        "attnjax.train",
        3,
        "the loop and what it stands on: optimiser, checkpoints, reliability, metrics",
    ),
    ("attnjax.tasks", 4, "what each task adds: classification, vqgan, prior"),
    ("attnjax.inference", 5, "trained runs used: sampling command, export"),
    (
        "attnjax.compile",
        5,
        "a config compiled for TPUs or GPUs it does not run on: memory, FLOPs, "
        "predicted throughput",
    ),
    ("attnjax.fid", 6, "the FID command"),
)
LAYERS = {"attnjax": 0, **{name: layer for name, layer, _ in PACKAGES}}
TORCH_WORLD = ("torch", "torchvision", "timm", "lpips", "taming")
MAY_IMPORT_TORCH = ("attnjax.convert",)


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str):
    """The layer of ``module`` (its longest listed prefix), or None for an unlisted module."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in LAYERS and (end == len(parts) or name != "attnjax"):
            return LAYERS[name]
    return None


def imports_of(source: str, module: str, is_package: bool):
    """``(line, imported module, statement text)`` for every import in ``source``, lazy ones
    (inside functions) included; ``from a import b`` counts as ``a.b`` when that is a module."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, f"import {alias.name}") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                target = candidate if _is_module(candidate) else base
                found.append(
                    (
                        node.lineno,
                        target,
                        f"from {'.' * node.level}{node.module or ''} import {alias.name}",
                    )
                )
    return found


def _is_module(name: str) -> bool:
    if not name.startswith("attnjax"):
        return False
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def violations(files: dict[str, tuple[str, bool]]) -> list[str]:
    """Messages for every upward import, same-layer cycle and stray torch import in ``files``
    (``{relative path: (source, is_package)}``)."""
    problems, graph = [], {}
    for relative, (source, is_package) in sorted(files.items()):
        module = module_name(ROOT / relative)
        own = layer_of(module)
        if own is None:
            problems.append(
                f"{relative}: module {module} has no layer; add it to LAYERS in "
                f"tests/test_layering.py"
            )
            continue
        for line, target, text in imports_of(source, module, is_package):
            top = target.split(".")[0]
            if top in TORCH_WORLD and not module.startswith(MAY_IMPORT_TORCH):
                problems.append(
                    f"{relative}:{line}: `{text}` imports {top}; only attnjax/convert/ "
                    f"may import PyTorch and its packages"
                )
            if top != "attnjax" or target == module:
                continue
            theirs = layer_of(target)
            if theirs is not None and theirs > own:
                problems.append(
                    f"{relative}:{line}: `{text}` imports {target} (layer {theirs}) "
                    f"from {module} (layer {own}): imports must point down"
                )
            graph.setdefault(module, set()).add(target)
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, set]) -> list[list[str]]:
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def package_files() -> dict[str, tuple[str, bool]]:
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        files[str(path.relative_to(ROOT))] = (path.read_text(), path.name == "__init__.py")
    return files


def test_no_module_imports_upwards_or_torch_outside_convert():
    problems = violations(package_files())
    assert not problems, "\n".join(problems)


def test_the_checker_flags_upward_imports_cycles_and_torch():
    files = package_files()
    attention = os.path.join("attnjax", "ops", "attention.py")
    positional = os.path.join("attnjax", "ops", "positional.py")
    files[attention] = (
        files[attention][0]
        + "\n\ndef _late():\n    from attnjax.train import checkpoint\n    import torch\n"
        + "\nfrom attnjax.ops import positional\n",
        False,
    )
    files[positional] = (files[positional][0] + "\nfrom . import attention\n", False)
    problems = violations(files)
    assert any(
        "attnjax/ops/attention.py:" in p
        and "`from attnjax.train import checkpoint`" in p
        and "layer 3" in p
        for p in problems
    ), problems
    assert any("attnjax/ops/attention.py:" in p and "`import torch`" in p for p in problems), (
        problems
    )
    assert any(
        p.startswith("import cycle:")
        and "attnjax.ops.attention" in p
        and "attnjax.ops.positional" in p
        for p in problems
    ), problems


def _table_rows() -> list[tuple[str, str, str]]:
    """The layer table of this module's docstring as ``(layer, package, description)`` rows."""
    rows = []
    for line in __doc__.splitlines():
        if line.startswith("    ") and line.split()[0].isdigit():
            layer, name, *words = line.split()
            rows.append([layer, name, " ".join(words)])
        elif rows and line.startswith(" " * 26) and line.strip():
            rows[-1][2] += " " + line.strip()
    return [tuple(row) for row in rows]


def test_every_package_is_a_layer_and_the_docstring_table_matches():
    found = sorted(f"attnjax.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    commands = sorted(f"attnjax.{p.stem}" for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    listed = sorted(name for name, _, _ in PACKAGES)
    assert sorted(found + commands) == listed, "attnjax/ packages and top modules != PACKAGES"
    documented = [(layer, name, text) for layer, name, text in _table_rows() if name in LAYERS]
    assert documented == [(str(layer), name, text) for name, layer, text in PACKAGES]


# What a training run's start (train.py and its task's module, before the first step) leaves to
# the code that needs it: scipy (about 0.2 s to import) serves only FIDs, matplotlib the plots
# written at evaluations, scikit-learn the digits' one preparation.
NOT_IMPORTED_AT_START = ("scipy", "matplotlib", "sklearn", "torch")
START = """
import sys, train
from attnjax import tasks
for name in sorted(tasks.TASKS):
    tasks.get_task(name)
print(sorted(set(sys.argv[1:]) & set(sys.modules)))
"""


def test_a_runs_start_imports_none_of_what_only_later_code_needs():
    run = subprocess.run(
        [sys.executable, "-c", START, *NOT_IMPORTED_AT_START],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]", run.stdout
