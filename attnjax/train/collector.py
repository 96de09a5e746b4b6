"""Python's cyclic garbage collector, set for a process that traces JAX programs.

Tracing and lowering a train step allocate millions of short-lived objects, and with Python's
default thresholds (700, 10, 10) the collector runs a full collection over every live object
(JAX, Flax, the model) several times per trace. Collecting the youngest generation every 50,000
allocations instead of 700 leaves reference counting to free almost all of them: the tiny
VQGAN's train step traces and lowers in about 2.0-2.1 s instead of 2.8-3.0 s (2-core AMD EPYC,
benchmarks/results/suite.md); cycles still get collected, later.
"""

from __future__ import annotations

import gc

TRACING_THRESHOLDS = (50_000, 20, 20)


def raise_thresholds() -> None:
    """Raises each generation's threshold to ``TRACING_THRESHOLDS``; thresholds the process set
    higher stay, and a disabled collector stays disabled."""
    gc.set_threshold(*(max(a, b) for a, b in zip(gc.get_threshold(), TRACING_THRESHOLDS)))
