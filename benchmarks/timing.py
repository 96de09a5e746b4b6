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


def processor_details() -> str:
    """``family F model M, BogoMIPS B, AVX-512 yes|no`` from ``/proc/cpuinfo`` (empty elsewhere):
    what tells this project's VM kinds apart, whose speeds differ by up to 2.8x."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return ""
    avx512 = "yes" if "avx512f" in fields.get("flags", "").split() else "no"
    return (
        f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}, "
        f"BogoMIPS {fields.get('bogomips', '?')}, AVX-512 {avx512}"
    )
