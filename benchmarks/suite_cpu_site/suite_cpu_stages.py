"""JAX's own account of where a process's compile time goes, for benchmarks/suite_cpu.py: seconds
and counts of tracing, lowering to MLIR, and XLA's compile (or a persistent-cache read: JAX times
both as one stage), and the cache's hits, summed from ``jax.monitoring``'s events.

JAX times each stage on the calling thread's clock: these are wall seconds inside the stage
(a program compiling on a thread beside the main one counts on both), which on a busy machine
include waiting for a core. A jit traced inside another's trace reports its own duration, which
the outer one's contains: each thread's stage time is the length of the union of its intervals,
so nested traces count once.

Importing this module never imports jax: the listeners are registered when jax is first imported
(at once where it is imported already), so a process that never uses jax pays nothing for it."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import time

STAGES = {
    "/jax/core/compile/jaxpr_trace_duration": "tracing",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering",
    "/jax/core/compile/backend_compile_duration": "compiling",
}
HITS = "/jax/compilation_cache/cache_hits"
FIELDS = ("tracing", "lowering", "compiling", "programs", "cache_hits")

_totals = dict.fromkeys(FIELDS, 0.0)
_lock = threading.Lock()
_registered = False
# (thread, stage) -> the intervals counted so far that no later one contains: disjoint, in order.
_outermost: dict[tuple[int, str], list[tuple[float, float]]] = {}
NESTED_SLACK = 1e-3  # seconds: a nested interval's start is known only to the callbacks' latency


def _on_duration(event: str, seconds: float, **_) -> None:
    stage = STAGES.get(event)
    if stage is None:
        return
    end = time.monotonic()  # the listener runs as the stage ends
    start = end - seconds
    with _lock:
        intervals = _outermost.setdefault((threading.get_ident(), stage), [])
        while intervals and intervals[-1][0] >= start - NESTED_SLACK:
            inner_start, inner_end = intervals.pop()
            _totals[stage] -= inner_end - inner_start
        intervals.append((start, end))
        _totals[stage] += seconds
        if stage == "compiling":
            _totals["programs"] += 1


def _on_event(event: str, **_) -> None:
    if event == HITS:
        with _lock:
            _totals["cache_hits"] += 1


def _register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)


class _AfterJax(importlib.abc.MetaPathFinder):
    """Registers the listeners right after the ``jax`` package has run its ``__init__``."""

    def find_spec(self, name, path, target=None):
        if name != "jax":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                _register()

            spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if "jax" in sys.modules:
        _register()
    elif not any(isinstance(finder, _AfterJax) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterJax())


def test_name(nodeid: str) -> str:
    """A test's id as the suite's rows name it: without pytest-xdist's ``@group`` suffix."""
    return nodeid.split("@")[0]


def snapshot() -> dict:
    with _lock:
        return dict(_totals)


def difference(after: dict, before: dict) -> dict:
    return {k: round(after[k] - before[k], 3) for k in FIELDS}


install()
