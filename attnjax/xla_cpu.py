"""XLA:CPU set up for speed, in one place: the flags every attnjax command and library import
hands XLA before its backend starts.

Importing ``attnjax`` calls ``configure()``: the flags ``compat.xla_cpu_speed_flags()`` picks for
the installed jaxlib are added to ``$XLA_FLAGS``, except any the user's own ``$XLA_FLAGS`` sets
already (theirs wins), and none at all with ``ATTNJAX_XLA_CPU_FLAGS=0`` (XLA's own defaults, to
measure them). XLA reads ``$XLA_FLAGS`` once, when its first backend starts: a process that
used a device before importing attnjax keeps the flags it started with. The measurements behind
each flag, per operation family and jaxlib: benchmarks/results/xla_cpu_flags.md
(``benchmarks/xla_cpu_flags.py``).

With ``ATTNJAX_CPU_MALLOC=1`` it also keeps the memory a compiled program frees for its next
call (``keep_freed_memory``): XLA:CPU allocates each call's temporary buffers in one ``malloc``
and frees them when it returns, and glibc by default maps such a block afresh and unmaps it at
``free``, so every training step faults its whole working memory in again (39,700 page faults
per MHA step, 317,000 per GPT step). One malloc arena that neither maps nor trims reuses the
pages: MHA 1.41x and ViT cifar 1.15x faster, but convolution steps 0.93-0.98x, and slower still
late in a long process that ran other programs before (the GAN step 0.68x), as every thread's
mid-sized blocks then go through one fragmented heap (benchmarks/results/malloc_cpu.md). So it
is not the default.

This module reads versions from package metadata and never imports jax, so that it can run
before jax does.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

from attnjax import compat

SWITCH = "ATTNJAX_XLA_CPU_FLAGS"
MALLOC_SWITCH = "ATTNJAX_CPU_MALLOC"
# glibc's mallopt parameters (malloc.h) and the values set: one arena, whatever thread allocates
# (a thread's own arena maps every block over its 64 MiB heaps); no block mapped on its own; the
# heap's free top kept up to the largest value mallopt takes (an int).
_MALLOC_SETTINGS = {
    "M_ARENA_MAX": (-8, 1),
    "M_MMAP_MAX": (-4, 0),
    "M_TRIM_THRESHOLD": (-1, 2**31 - 1),
}
_malloc_kept: dict[str, int] = {}


def _name(flag: str) -> str:
    return flag.split("=", 1)[0]


def merged(xla_flags: str, flags: list[str]) -> str:
    """``xla_flags`` with each of ``flags`` appended whose name it does not set already."""
    given = {_name(flag) for flag in xla_flags.split()}
    return " ".join([*xla_flags.split(), *(f for f in flags if _name(f) not in given)])


def configure() -> list[str]:
    """Adds attnjax's XLA:CPU flags to ``$XLA_FLAGS`` and keeps freed memory for reuse -> the
    flags added (``[]`` where the switch is off, the user set each one, or a backend is running
    already)."""
    if _backend_started():
        return []
    if os.environ.get(MALLOC_SWITCH, "0") == "1":
        keep_freed_memory()
    if os.environ.get(SWITCH, "1") == "0":
        return []
    before = os.environ.get("XLA_FLAGS", "")
    after = merged(before, compat.xla_cpu_speed_flags())
    os.environ["XLA_FLAGS"] = after
    return after.split()[len(before.split()) :]


def keep_freed_memory() -> dict[str, int]:
    """Sets glibc's malloc to keep the blocks a process frees for its next allocations (see the
    module's docstring) -> the settings in effect, ``{}`` where the C library is not glibc. Call
    it before XLA starts its threads (``import attnjax`` does, with ``ATTNJAX_CPU_MALLOC=1``)."""
    if platform.libc_ver()[0] != "glibc":
        return dict(_malloc_kept)
    if not _malloc_kept:
        mallopt = ctypes.CDLL(None).mallopt
        for name, (parameter, value) in _MALLOC_SETTINGS.items():
            if mallopt(parameter, value) == 1:
                _malloc_kept[name] = value
    return dict(_malloc_kept)


def malloc_in_effect() -> dict[str, int]:
    """The malloc settings ``keep_freed_memory`` made in this process (what a run's log records)."""
    return dict(_malloc_kept)


def in_effect() -> str:
    """The ``$XLA_FLAGS`` XLA read when its backend started (what a run's log records), provided
    nothing changed the variable since."""
    return os.environ.get("XLA_FLAGS", "")


def _backend_started() -> bool:
    """Whether this process started an XLA backend already (jax imported and a device used):
    flags set now would be ignored, and the log would then name flags XLA never read."""
    if "jax" not in sys.modules:
        return False
    return compat.xla_backends_started()
