"""Compiled programs kept across processes, found without tracing: a repeated or resumed run on
the same machine loads its train and eval steps as they were compiled, in milliseconds.

JAX's persistent compilation cache (``attnjax.train.compilation_cache``) is keyed by the lowered
program, so a warm start still traces the Python and lowers it to MLIR before the cache can
answer (benchmarks/results/first_step.md has the time of each stage). Here the key is what
decides the program before any tracing:

* the caller's ``identity``: the run's whole config and task (``identity_of``);
* the versions of jax, jaxlib, flax, optax and chex, ``$XLA_FLAGS``, the ``ATTNJAX_*`` variables,
  the jax settings that change programs (x64, matmul precision, PRNG), and a digest of attnjax's
  own source files;
* the backend, its device kind and count, and the process count;
* the program's name, and the arguments' tree structure, shapes, dtypes and shardings.

An entry is ``jax.experimental.serialize_executable``'s executable with its argument and result
trees and the devices it was compiled for, written under a private name and renamed (concurrent
runs see whole entries or none); an unreadable one is compiled again and replaced. A CPU program
missing here is compiled past JAX's persistent cache, which it neither reads nor writes: XLA:CPU
serialises an executable read back from that cache without its code, so one found there could not
be kept, and every later run of a config whose programs another run had compiled (one differing
only in ``log_every``, or after an edit of attnjax) would trace them again. On other platforms a
program JAX's cache answered is not kept. A model's initialisation keeps its outputs too
(``memoized``), keyed by the same and by its arguments' values: a repeated run reads its initial
parameters instead of loading and running the program (warm first steps in
benchmarks/results/first_step.md). Each run lists the programs it used (``read_ahead``), and the
next run of the same config starts loading them on a thread before it needs them, while it reads
its data and builds its initial state. Entries are read by the one process of a single-process run;
a multi-process run compiles as without them. The directory: ``$ATTNJAX_EXECUTABLE_CACHE``
(``off``, ``0``, ``false`` or ``no`` turns it off), else ``attnjax-executables/`` inside the
compilation cache's directory (``~/.cache/attnjax/jax`` by default; none where the compilation
cache is off). It keeps at most ``$ATTNJAX_EXECUTABLE_CACHE_MAX_GB`` (default 2) GiB, the least
recently used entries removed first.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import functools
import hashlib
import json
import os
import pathlib
import pickle
import threading
import time
import uuid
from typing import Any, Callable

import jax
import numpy as np
from absl import logging
from jax.experimental import serialize_executable

from attnjax import compat, xla_cpu
from attnjax.train import compilation_cache, host_trees

ENV_DIR = "ATTNJAX_EXECUTABLE_CACHE"
ENV_MAX_GB = "ATTNJAX_EXECUTABLE_CACHE_MAX_GB"
DEFAULT_MAX_GB = 2.0
SUFFIX = ".executable"
RESULTS_SUFFIX = ".results"
NOTE_SUFFIX = ".note"  # a number read from a program's trace, kept beside it (``beside``)
SUBDIRECTORY = "attnjax-executables"  # JAX's own cache reads only its files, not folders
VERSIONED = ("jax", "jaxlib", "flax", "optax", "chex")
# jax settings that change the program traced from the same Python.
JAX_SETTINGS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
)

_counts = {"loaded": 0, "written": 0, "load_seconds": 0.0, "results_read": 0, "read_ahead": 0}
# The programs read ahead (entry path -> future of (platform, program)), and the run whose list of
# programs this process writes: [its path, the entry names in the order first used].
_ahead: dict[str, concurrent.futures.Future] = {}
_run: list = [None, []]
_stop_reading = threading.Event()


def directory() -> pathlib.Path | None:
    """Where entries live, or None where the cache is off."""
    choice = os.environ.get(ENV_DIR, "").strip()
    if choice.lower() in compilation_cache.OFF:
        return None
    if choice:
        return pathlib.Path(choice).expanduser()
    jax_cache = compilation_cache.current_directory()
    return pathlib.Path(jax_cache) / SUBDIRECTORY if jax_cache else None


@functools.cache
def source_digest() -> str:
    """sha256 of attnjax's Python files (names and contents): an edit anywhere is a new key."""
    root = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def environment() -> dict:
    """What besides the caller's identity decides a compiled program."""
    devices = jax.devices()
    return {
        "versions": {name: compat.version(name) for name in VERSIONED},
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "attnjax_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("ATTNJAX_")},
        "jax_settings": {name: str(getattr(jax.config, name, None)) for name in JAX_SETTINGS},
        "source": source_digest(),
        "backend": jax.default_backend(),
        "devices": [devices[0].device_kind, len(devices), jax.process_count()],
    }


def identity_of(config, task=None) -> dict:
    """A run's identity: its whole config (every field may reach a program), and the source of
    ``task``'s module where it lives outside attnjax (``source_digest`` covers attnjax's own)."""
    identity = {"config": json.loads(config.to_json_best_effort())}
    path = pathlib.Path(getattr(task, "__file__", "") or "/")
    if path.is_file() and pathlib.Path(__file__).resolve().parents[1] not in path.resolve().parents:
        identity["task_source"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return identity


def _signature(args) -> str:
    def leaf(x):
        sharding = getattr(x, "sharding", None)
        dtype = str(getattr(x, "dtype", type(x).__name__))
        weak, shape = getattr(x, "weak_type", False), list(getattr(x, "shape", ()))
        return [shape, dtype, weak, None if sharding is None else repr(sharding)]

    leaves, tree = jax.tree.flatten(args)
    # Host arrays are placed on the default device: a program for another is another program.
    return json.dumps([str(tree), [leaf(x) for x in leaves], str(jax.config.jax_default_device)])


def counts() -> dict:
    """``{"loaded", "written", "load_seconds", "results_read", "read_ahead"}``: entries this
    process read, entries it compiled and wrote, the seconds reading and loading took (on the
    caller's thread), the kept outputs read instead of running their program (``memoized``), and
    the loaded entries that ``read_ahead`` had read."""
    return dict(_counts)


class ExecutableCache:
    """Programs of one run: ``cached(name, jitted)`` stands in for the ``jax.jit`` function."""

    def __init__(self, identity: dict, where: pathlib.Path | None = None):
        self.directory = directory() if where is None else where
        if jax.process_count() > 1:
            self.directory = None
        self._base = None
        if self.directory is not None:
            self._base = json.dumps({**identity, **environment()}, sort_keys=True, default=str)

    def cached(
        self, name: str, jitted: Callable, listed: bool = True, run_once: bool = False
    ) -> Callable:
        """``jitted`` (a ``jax.jit`` function), its programs read from and written to the cache,
        one per argument signature (``listed``: in the run's list that ``read_ahead`` reads;
        ``run_once``: a program a run calls once, ``xla_cpu.run_once_options``)."""
        if self.directory is None:
            return jitted
        programs: dict[str, Callable] = {}
        last: list[Callable] = []
        ahead: dict[str, concurrent.futures.Future] = {}  # signature -> compiling on a thread

        @functools.wraps(jitted)
        def call(*args):
            # The program of the last call first: a compiled program checks its arguments' types
            # and layouts itself (TypeError, ValueError) before it runs, so a step's arguments are
            # not flattened into a signature every step (3.8 ms for ViT-B/16's train state).
            if last:
                try:
                    return last[0](*args)
                except (TypeError, ValueError):
                    pass
            if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
                return jitted(*args)  # inside another trace (jax.eval_shape): inlined there
            signature = _signature(args)
            program = programs.get(signature)
            if program is None and signature in ahead:
                program, kept = ahead.pop(signature).result()
                if kept and listed:  # listed at its first use, as the programs compiled here
                    self._list(self._path(name, signature).name)
            program = program or self._program(name, jitted, args, signature, listed, run_once)
            programs[signature], last[:] = program, [program]
            return program(*args)

        def prepare(*args) -> None:
            """Compiles and keeps the program for ``args`` (arrays or ``jax.ShapeDtypeStruct``s)
            on a thread, traced and lowered here: XLA compiles outside Python's lock while the
            caller builds the initial state, and the first call of that signature waits for it.
            Nothing where the program is kept already (a repeated run loads it)."""
            signature = _signature(args)
            path = self._path(name, signature)
            if signature in programs or signature in ahead or path.exists():
                return
            lowered, platform = jitted.lower(*args), _platform(args) or jax.default_backend()
            ahead[signature] = _compiler().submit(self._compile, path, lowered, platform)

        # What else reads the program traces it (the MFU count, kept at ``beside``; compiles).
        call.trace, call.lower, call.prepare = jitted.trace, jitted.lower, prepare
        call.beside = lambda suffix, *args: self._path(name, _signature(args)).with_suffix(suffix)
        return call

    def memoized(self, name: str, jitted: Callable, run_once: bool = False) -> Callable:
        """``cached(name, jitted)`` whose outputs are kept too, for a deterministic program run
        once per run on small arguments (a model's initialisation): called again with equal
        arguments (the same key, the same argument values), it reads the outputs it gave, placed
        as the program places them, without loading or running the program. Arguments on a
        chosen device, or sharded, run the program."""
        # Not listed for reading ahead: a repeated run reads the outputs, not the program.
        program = self.cached(name, jitted, listed=False, run_once=run_once)
        if self.directory is None:
            return program

        @functools.wraps(jitted)
        def call(*args):
            leaves = jax.tree.leaves(args)
            if not all(host_trees.on_default_device(x) for x in leaves):
                return program(*args)  # inside a trace, or placed by the caller
            values = [np.asarray(x) for x in leaves]
            digest = hashlib.sha256(_signature(args).encode())
            for value in values:
                digest.update(value.tobytes())
            key = hashlib.sha256(f"{self._base}\n{name}\n{digest.hexdigest()}".encode())
            path = self.directory / f"{name}-{key.hexdigest()[:32]}{RESULTS_SUFFIX}"
            kept = self._read_results(path)
            if kept is not None:
                _counts["results_read"] += 1
                return jax.device_put(kept)
            outputs = program(*args)
            self._store_results(path, outputs)
            return outputs

        return call

    def _read_results(self, path: pathlib.Path):
        try:
            with open(path, "rb") as file:
                # Writable memory the arrays own: whatever aliases them may write to them.
                entry = bytearray(os.fstat(file.fileno()).st_size)
                file.readinto(entry)
            kept = host_trees.unpack(entry)
        except FileNotFoundError:
            return None
        except Exception as error:  # damaged: run again and replaced
            logging.warning("kept outputs %s unreadable (%s); running the program", path, error)
            return None
        os.utime(path)
        return kept

    def _store_results(self, path: pathlib.Path, outputs) -> None:
        host = jax.device_get(outputs)
        if not all(host_trees.plain_array(x) for x in jax.tree.leaves(host)):
            return  # PRNG keys and other extended dtypes: not kept
        try:
            self._write(path, *host_trees.pack(host))
        except Exception as error:  # a full disk
            logging.warning("outputs of %s not kept: %s", path.name, error)
            return
        _bound_size(self.directory)

    def _write(self, path: pathlib.Path, *parts) -> None:
        """``parts`` (bytes-like) one after the other at ``path``, whole or not at all, for any
        process reading meanwhile."""
        path.parent.mkdir(parents=True, exist_ok=True)
        private = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        with open(private, "wb") as file:
            file.writelines(parts)
        os.replace(private, path)

    def _path(self, name: str, signature: str) -> pathlib.Path:
        key = hashlib.sha256(f"{self._base}\n{name}\n{signature}".encode()).hexdigest()
        return self.directory / f"{name}-{key[:32]}{SUFFIX}"

    def _program(
        self, name: str, jitted: Callable, args, signature: str, listed: bool, run_once: bool
    ):
        path = self._path(name, signature)
        start, platform = time.perf_counter(), _platform(args) or jax.default_backend()
        loaded = self._load(path, args, platform)
        if loaded is not None:
            _counts["loaded"] += 1
            _counts["load_seconds"] += time.perf_counter() - start
            if listed:
                self._list(path.name)
            return loaded
        compiled, kept = self._compile(path, jitted.lower(*args), platform, run_once)
        if kept and listed:
            self._list(path.name)
        return compiled

    def _compile(self, path: pathlib.Path, lowered, platform: str, run_once=False):
        """``(compiled, whether it was kept at path)``."""
        hits = compilation_cache.counts()["hits"]
        options = None
        if run_once and platform == "cpu":
            outputs = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(lowered.out_info))
            options = xla_cpu.run_once_options(outputs)
        # XLA:CPU serialises an executable read back from JAX's own cache without its code
        # (loading it fails with "Function ... not found"): a CPU program is compiled past that
        # cache, to be kept. Elsewhere, where compiling takes far longer, the cache may answer.
        with compilation_cache.bypassed() if platform == "cpu" else contextlib.nullcontext():
            compiled = lowered.compile(compiler_options=options)
        if compilation_cache.counts()["hits"] > hits:
            return compiled, False  # not kept: as above, not known to load back
        return compiled, self._store(path, compiled)

    def _load(self, path: pathlib.Path, args, platform: str):
        ahead = _ahead.pop(str(path), None)
        try:
            read = ahead.result() if ahead is not None and not ahead.cancelled() else None
            if read is not None and read[0] == platform:
                program = read[1]
                _counts["read_ahead"] += 1
            else:
                program = _deserialize(path, platform)
            placed = _device_ids(args)  # none for host arrays: the default device takes them
            if placed and not _device_ids(program.input_shardings) <= placed:
                raise ValueError("compiled for other devices than its arguments are on")
        except FileNotFoundError:
            return None
        except Exception as error:  # a damaged or foreign entry: compiled again and replaced
            logging.warning("compiled program %s unreadable (%s); compiling it again", path, error)
            return None
        os.utime(path)  # its last use, for the size bound
        return program

    def _list(self, name: str) -> None:
        """Adds an entry to the run's list (``read_ahead``), rewritten whole on each change."""
        where, names = _run
        if where is None or name in names or where.parent != self.directory:
            return
        names.append(name)
        try:
            self._write(where, json.dumps(names).encode())
        except OSError as error:  # a full disk: the next run reads nothing ahead
            logging.warning("list of programs not written to %s: %s", where, error)

    def _store(self, path: pathlib.Path, compiled) -> bool:
        try:
            device_ids = compat.executable_device_ids(compiled)
            entry = pickle.dumps((*serialize_executable.serialize(compiled), device_ids))
            self._write(path, entry)
        except Exception as error:  # a program the backend cannot serialise, a full disk
            logging.warning("compiled program not kept in %s: %s", self.directory, error)
            return False
        _counts["written"] += 1
        _bound_size(self.directory)
        return True


@functools.cache  # one thread, which Python joins at exit: no backend torn down under a compile
def _compiler() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="attnjax-compile")


def _deserialize(path: pathlib.Path, platform: str | None):
    """The program kept at ``path``, loaded onto ``platform``'s devices it was compiled for."""
    payload, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
    devices = {d.id: d for d in jax.devices(platform)}
    return serialize_executable.deserialize_and_load(
        payload,
        in_tree,
        out_tree,
        backend=platform,
        execution_devices=None if device_ids is None else [devices[i] for i in device_ids],
    )


def read_ahead(config) -> None:
    """Starts loading the programs that the last run of ``config`` here loaded or compiled, in
    the order it first used them, on a thread beside the caller, and lists this run's programs
    for the next. Loading a program is code linking outside Python's lock (1.2-1.4 s for
    ViT-B/16's train step on one core), so it overlaps the caller's data and initial state; a
    program that turns out different (another signature, another platform) is loaded as
    without it."""
    cache = ExecutableCache(identity_of(config))
    if cache.directory is None:
        return
    where = cache.directory / f"run-{hashlib.sha256(cache._base.encode()).hexdigest()[:32]}.json"
    _run[:] = [where, []]
    try:
        names = json.loads(where.read_text())
    except (OSError, ValueError):  # a first run, or a damaged list: nothing read ahead
        return
    if not isinstance(names, list):
        return
    jobs = [
        (str(cache.directory / n), concurrent.futures.Future())
        for n in names
        if isinstance(n, str) and n.endswith(SUFFIX) and "/" not in n and not n.startswith(".")
    ]
    _ahead.clear()
    _ahead.update(jobs)
    _stop_reading.clear()
    platform = _platform(()) or jax.default_backend()  # where host arguments will go
    thread = threading.Thread(
        target=_read_all, args=(jobs, platform), name="attnjax-read-ahead", daemon=True
    )
    thread.start()
    # A run that ends first waits for the program being loaded, not for the rest: the backend
    # must not be torn down under it.
    atexit.register(lambda: (_stop_reading.set(), thread.join()))


def reading_ahead() -> bool:
    """Whether programs the last run of the config listed are still to be loaded (``read_ahead``'s
    list, less those this run has loaded so far): a repeated run, before its steps."""
    return bool(_ahead)


def _read_all(jobs, platform) -> None:
    for path, future in jobs:
        if _stop_reading.is_set():
            future.cancel()
            continue
        try:
            future.set_result((platform, _deserialize(pathlib.Path(path), platform)))
        except BaseException as error:  # handed to whoever asks for this program
            future.set_exception(error)


def _platform(args) -> str | None:
    """The platform the arguments live on (an initial state computed on the host CPU beside a
    GPU), or for host arrays the default device's: the backend that loads their program."""
    for leaf in jax.tree.leaves(args):
        devices = getattr(getattr(leaf, "sharding", None), "device_set", None)
        if devices:
            return next(iter(devices)).platform
    default = jax.config.jax_default_device  # host arrays only: where they will be placed
    return getattr(default, "platform", default)


def _device_ids(tree) -> set[int]:
    """The ids of the devices the placed leaves of ``tree`` (arrays, shardings) are on."""
    ids = set()
    for leaf in jax.tree.leaves(tree):
        sharding = (
            leaf if isinstance(leaf, jax.sharding.Sharding) else getattr(leaf, "sharding", None)
        )
        if sharding is not None:
            ids.update(d.id for d in sharding.device_set)
    return ids


def _bound_size(where: pathlib.Path) -> None:
    limit = float(os.environ.get(ENV_MAX_GB, DEFAULT_MAX_GB)) * 2**30
    entries = []
    for path in (p for end in (SUFFIX, RESULTS_SUFFIX, NOTE_SUFFIX) for p in where.glob(f"*{end}")):
        try:
            stat = path.stat()
        except FileNotFoundError:  # removed by another process meanwhile
            continue
        entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        path.unlink(missing_ok=True)
        total -= size


def first_step_line() -> str:
    """The loop's line after the first step: seconds since the process started, each stage's
    share, and where the programs came from."""
    age = compilation_cache.process_seconds()
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in compilation_cache.stage_seconds().items())
    line = f"first step done{'' if age is None else f' {age:.1f} s after the process started'}"
    c = counts()
    return (
        f"{line} ({stages}): {c['loaded']} compiled programs loaded in "
        f"{c['load_seconds']:.1f} s ({c['read_ahead']} read ahead), {c['written']} kept, "
        f"{c['results_read']} outputs read; "
        f"{compilation_cache.summary()}"
    )


def jit(config, name: str, fn: Callable, *, keep_outputs: bool = False, **jit_options) -> Callable:
    """``jax.jit(fn, **jit_options)`` for a program a run calls once (an initialisation, the run's
    keys), its programs kept under ``name`` for runs of ``config`` (``keep_outputs``: its outputs
    too, ``ExecutableCache.memoized``) and, with the cache on, compiled for the sooner result
    (``cached``'s ``run_once``). ``fn`` must close over no array: the key sees the arguments, not
    what ``fn`` captured (pass the arrays as arguments)."""
    cache = ExecutableCache(identity_of(config))
    keep = cache.memoized if keep_outputs else cache.cached
    return keep(name, jax.jit(fn, **jit_options), run_once=True)


def cached_steps(identity: dict, train_step: Callable, eval_step: Callable) -> tuple[Any, Any]:
    """``(train_step, eval_step)``, each ``cached`` under its name."""
    cache = ExecutableCache(identity)
    return cache.cached("train_step", train_step), cache.cached("eval_step", eval_step)
