"""What the host offers the kernels that depend on it: the CPU cores this process may use, and
the processor's name."""

from __future__ import annotations

import os
import platform


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask on Linux, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def processor() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
