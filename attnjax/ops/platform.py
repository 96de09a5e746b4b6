"""What the host offers the kernels that depend on it: the CPU cores this process may use."""

from __future__ import annotations

import os


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask on Linux, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
