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


def alternating_ms(calls: dict, rounds: int, repeats: int) -> dict[str, list[float]]:
    """Milliseconds of each blocking call in ``calls``, the calls taken in turn ``rounds`` times,
    each time the median of ``repeats``: a slow spell of a shared machine falls on every
    candidate alike instead of on whichever ran then."""
    ms = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            ms[name].append(1e3 * median_seconds(call, repeats))
    return ms
