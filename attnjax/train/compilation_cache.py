"""JAX's persistent compilation cache for every attnjax command, so that a resumed, repeated or
restarted run reads its compiled programs from disk instead of compiling them again.

``enable()`` turns it on for the process (``train.py``, ``demo.py``, the sample, export, FID and
compile commands call it first). The directory, in order:

* ``$JAX_COMPILATION_CACHE_DIR`` or a ``jax_compilation_cache_dir`` already configured: the
  user's own cache is used as it is, its size limit too;
* ``$ATTNJAX_COMPILATION_CACHE``: a directory, or ``off`` (also ``0``, ``false``, ``no``);
* ``$XDG_CACHE_HOME/attnjax/jax`` (default ``~/.cache/attnjax/jax``).

The cache holds at most ``$ATTNJAX_COMPILATION_CACHE_MAX_GB`` (default 4) GiB; JAX evicts the
least recently read programs past that, under a file lock, so the processes of a multi-process run
and runs side by side share one directory safely. Programs that compile in under
``MIN_COMPILE_SECONDS`` are not written: reading them back would save nothing.

JAX writes a program's entry, then the file of its last use, and its eviction reads the second of
every entry: a process killed between the two (a preempted run) leaves an entry whose use file is
missing, after which every write to the directory fails. ``enable()`` removes such entries first.

``counts()`` says how many programs came from the cache and how many were compiled; the training
loop logs it with the time of the first step.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import threading

import filelock
import jax
from absl import logging
from jax.experimental.compilation_cache import compilation_cache as jax_cache

ENV_DIR = "ATTNJAX_COMPILATION_CACHE"
ENV_MAX_GB = "ATTNJAX_COMPILATION_CACHE_MAX_GB"
DEFAULT_MAX_GB = 4.0
OFF = ("0", "off", "false", "no")
# Below this a program is compiled again rather than written (each write serialises the
# executable); the digits tasks' train and eval steps take 1-10 s on a CPU, single operations
# run outside jit 0.01-0.05 s.
MIN_COMPILE_SECONDS = 0.2
# How long enable() waits for JAX's lock on the directory before starting without the check; JAX
# itself gives up on a write after 10 s.
LOCK_WAIT_SECONDS = 30.0

_counts = {"hits": 0, "misses": 0, "saved_seconds": 0.0}
# JAX's own timings of the three stages every new program goes through, summed over the process
# (seconds): what a warm start still pays before the cache can answer, and what a cold one adds.
STAGES = {
    "/jax/core/compile/jaxpr_trace_duration": "tracing",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering",
    "/jax/core/compile/backend_compile_duration": "compiling",
}
_stages = dict.fromkeys(STAGES.values(), 0.0)
_listening = False


def default_directory() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "attnjax" / "jax"


def enable() -> str | None:
    """Turns the persistent compilation cache on for this process -> its directory, or None
    where ``$ATTNJAX_COMPILATION_CACHE`` turns it off. Call before the first compilation."""
    _listen()
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return configured
    choice = os.environ.get(ENV_DIR, "").strip()
    if choice.lower() in OFF:
        return None
    directory = pathlib.Path(choice).expanduser() if choice else default_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a read-only home: compile as without a cache
        logging.warning("no compilation cache: %s: %s", directory, error.strerror)
        return None
    max_gb = float(os.environ.get(ENV_MAX_GB, DEFAULT_MAX_GB))
    try:
        removed = remove_interrupted_entries(directory)
    except OSError as error:  # the lock held past the wait (filelock.Timeout), or not writable
        logging.warning("compilation cache %s: entries not checked: %s", directory, error)
        removed = []
    if removed:
        logging.warning(
            "compilation cache %s: removed %d %s a killed process left unfinished: %s",
            directory,
            len(removed),
            "entry" if len(removed) == 1 else "entries",
            ", ".join(removed[:3]) + (", ..." if len(removed) > 3 else ""),
        )
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_compilation_cache_max_size", int(max_gb * 2**30))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # else the user's
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return str(directory)


def remove_interrupted_entries(directory: pathlib.Path) -> list[str]:
    """Deletes the entries of ``directory`` that have no last-use file (JAX's ``<key>-cache``
    without its ``<key>-atime``: the writer was killed in between, perhaps in the middle of the
    entry itself) -> their names. Under JAX's own lock, so no other process is between its two
    writes meanwhile."""
    with filelock.FileLock(directory / ".lockfile", timeout=LOCK_WAIT_SECONDS):
        used = {path.name.removesuffix("-atime") for path in directory.glob("*-atime")}
        removed = []
        for entry in sorted(directory.glob("*-cache")):
            if entry.name.removesuffix("-cache") not in used:
                entry.unlink(missing_ok=True)
                removed.append(entry.name)
    return removed


_bypass_lock = threading.Lock()
_bypass = {"depth": 0, "enabled": None}  # open bypassed() blocks, the setting before the first


@contextlib.contextmanager
def bypassed():
    """Compiles inside neither read nor write the persistent cache. The setting is the whole
    process's: while any thread is inside, every thread's compiles pass the cache, and the last
    to leave restores it (a program compiled ahead on a thread beside the initial state's)."""
    with _bypass_lock:
        if _bypass["depth"] == 0:
            _bypass["enabled"] = jax.config.jax_enable_compilation_cache
            jax.config.update("jax_enable_compilation_cache", False)
            jax_cache.reset_cache()  # JAX decides once per process whether it uses the cache
        _bypass["depth"] += 1
    try:
        yield
    finally:
        with _bypass_lock:
            _bypass["depth"] -= 1
            if _bypass["depth"] == 0:
                jax.config.update("jax_enable_compilation_cache", _bypass["enabled"])
                jax_cache.reset_cache()


def current_directory() -> str | None:
    """The directory JAX's persistent cache uses in this process, or None where it is off."""
    return jax.config.jax_compilation_cache_dir or None


def counts() -> dict:
    """``{"hits", "misses", "saved_seconds"}`` of this process so far: programs read from the
    cache, programs compiled because the cache lacked them, and the compile time saved."""
    return dict(_counts)


def stage_seconds() -> dict:
    """``{"tracing", "lowering", "compiling"}``: seconds this process has spent so far turning
    Python into jaxprs, jaxprs into MLIR, and MLIR into executables (a cache hit's read counts
    as compiling)."""
    return dict(_stages)


def summary() -> str:
    """One line for the log: where the programs came from."""
    directory = current_directory()
    if not directory:
        return "no persistent compilation cache"
    c = counts()
    # JAX counts a hit's saving as its original compile time less the time reading it took: on a
    # loaded machine or a slow disk that is below zero, and the line says so as it is.
    return (
        f"{c['hits']} programs from the compilation cache at {directory} "
        f"({c['saved_seconds']:.1f} s of compiling saved), {c['misses']} compiled and "
        "written to it"
    )


def process_seconds() -> float | None:
    """Seconds since this process started (its interpreter's start, imports included), from
    /proc; None where there is no /proc."""
    # Both clocks count from boot (the boot time itself is whole seconds only: up to 1 s off).
    try:
        fields = pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 of stat(5), counted after the command name
        uptime = float(pathlib.Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - started_ticks / os.sysconf("SC_CLK_TCK")


def _listen() -> None:
    global _listening
    if _listening:
        return
    _listening = True

    def on_event(event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            _counts["hits"] += 1
        elif event == "/jax/compilation_cache/cache_misses":
            _counts["misses"] += 1

    def on_duration(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/compilation_cache/compile_time_saved_sec":
            _counts["saved_seconds"] += duration
        elif event in STAGES:
            _stages[STAGES[event]] += duration

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
