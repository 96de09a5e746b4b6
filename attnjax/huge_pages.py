"""Large host blocks backed by transparent huge pages: how attnjax's commands start on Linux.

XLA:CPU allocates each call's temporary buffers with ``malloc`` and frees them when the call
returns. glibc maps a block that large afresh and unmaps it at ``free``, and hands the top of
its heaps back to the kernel, so every step faults its working memory in again, 4 KiB at a
time. Where the kernel gives transparent huge pages on request
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise``, the usual default), commands
start with three glibc tunables (``TUNABLES``):

- ``glibc.malloc.hugetlb=1``: the memory glibc asks the kernel for comes on huge pages, so it
  faults in 2 MiB at a time;
- ``glibc.malloc.mmap_max=0``: no block is mapped on its own where a heap can hold it (the main
  heap any size, a thread's heaps up to 64 MiB): a freed block is reused by the next call;
- ``glibc.malloc.trim_threshold=2147483647``: a heap keeps its freed top below 2 GiB, which the
  next step would fault in again. A process keeps the memory it freed instead of returning it,
  so its resident size stays near its peak.

Every training step measured runs faster or the same, none slower
(benchmarks/results/malloc_cpu.md, ``benchmarks/malloc_cpu.py``). Numbers are unchanged: only
where the pages come from differs. The first step pays for the pages its heaps grow into: on the
slower 2-core VM it took 1.3-1.9x as long as under glibc's defaults (ViT-B/16's train step 2.2 s
more), won back after 4-25 steps (benchmarks/results/malloc_cpu_slower_vm.md).

glibc reads its tunables once, when a process starts. A command therefore calls
``restart_with_huge_pages()`` first thing: where the setting would help and is not in effect,
the process replaces itself (``exec``: same PID, same arguments, same standard streams) with
``GLIBC_TUNABLES`` extended; the restart costs one Python start and ``import attnjax``, about
0.05 s. A library import never restarts anyone's process. ``ATTNJAX_HUGE_PAGES=0`` keeps glibc's
defaults, and so does a ``GLIBC_TUNABLES`` that names any of the three (the user's malloc).

Never imports jax: it runs before anything else is loaded.
"""

from __future__ import annotations

import os
import sys

SWITCH = "ATTNJAX_HUGE_PAGES"
TUNABLES = {
    "glibc.malloc.hugetlb": "1",
    "glibc.malloc.mmap_max": "0",
    "glibc.malloc.trim_threshold": str(2**31 - 1),
}
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
# The first glibc that knows glibc.malloc.hugetlb.
GLIBC_WITH_TUNABLE = (2, 35)


def thp_mode(path: str = THP_MODE) -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``) or None."""
    try:
        with open(path, encoding="ascii") as modes:
            text = modes.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def glibc_version() -> tuple[int, ...] | None:
    """The running C library's version when it is glibc, else None."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (AttributeError, ValueError, OSError):
        return None
    if name != "glibc":
        return None
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


def tunables_with_huge_pages(tunables: str) -> str | None:
    """``GLIBC_TUNABLES`` with ``TUNABLES`` added, or None where it names any of them already
    (the user's malloc stands)."""
    entries = [entry for entry in tunables.split(":") if entry]
    if any(entry.split("=", 1)[0] in TUNABLES for entry in entries):
        return None
    return ":".join([*entries, *(f"{name}={value}" for name, value in TUNABLES.items())])


def available() -> bool:
    """Whether asking helps here: glibc new enough to know the tunable, and a kernel that gives
    huge pages on request (``always`` gives them without asking, ``never`` not at all)."""
    return (glibc_version() or (0,)) >= GLIBC_WITH_TUNABLE and thp_mode() == "madvise"


def wanted() -> str | None:
    """The ``GLIBC_TUNABLES`` a restart would start with, or None where none is called for:
    switched off, set already, not ``available()``, or no command line to start again."""
    if os.environ.get(SWITCH, "1") == "0" or not available():
        return None
    if not sys.executable or not sys.argv or sys.argv[0] in ("", "-"):
        return None
    return tunables_with_huge_pages(os.environ.get("GLIBC_TUNABLES", ""))


def restart_with_huge_pages() -> None:
    """Replaces this process with itself under ``TUNABLES`` where ``wanted()``;
    returns (doing nothing) otherwise. Call it before importing anything that starts threads."""
    tunables = wanted()
    if tunables is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(
        sys.executable,
        [sys.executable, *sys.orig_argv[1:]],
        {**os.environ, "GLIBC_TUNABLES": tunables},
    )


def in_effect() -> str:
    """The ``GLIBC_TUNABLES`` this process started with (what a run's log records)."""
    return os.environ.get("GLIBC_TUNABLES", "")
