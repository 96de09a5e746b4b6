"""The one timer every benchmark script uses (run as scripts, they import it from this folder)."""

import time

import numpy as np


def median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls; ``fn`` must block until done."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))
