"""What the host offers the kernels that depend on it: the CPU cores this process may use, and
the processor's name and kind."""

from __future__ import annotations

import functools
import os
import platform


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask on Linux, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@functools.cache  # every CPU kernel choice's key reads it; a many-core host lists every core
def _cpuinfo() -> dict:
    """The fields of the first processor in ``/proc/cpuinfo`` (empty where there is none)."""
    fields: dict = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():  # the end of the first processor's block
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def processor() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` says."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine() or "unknown"


def processor_details() -> str:
    """``family F model M, BogoMIPS B, AVX-512 yes|no`` from ``/proc/cpuinfo`` (empty elsewhere):
    what tells apart VMs of one model name, whose speeds differ by up to 2.8x."""
    fields = _cpuinfo()
    if not fields:
        return ""
    avx512 = "yes" if "avx512f" in fields.get("flags", "").split() else "no"
    return (
        f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}, "
        f"BogoMIPS {fields.get('bogomips', '?')}, AVX-512 {avx512}"
    )
