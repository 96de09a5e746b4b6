"""A bound on how long a run may make no progress, so that a dead or stalled peer never hangs it.

A process of a multi-process run that waits for a peer which died or stopped waits inside a
collective (or an Orbax barrier) that no Python exception can interrupt. XLA:CPU's gloo
collectives end such a wait after their own timeout by aborting the process; NCCL and TPU
collectives have no such bound. The loop therefore marks the start of each phase
(``enter("step", 17)``, ``"evaluation"``, ``"save"``, ...) and a daemon thread checks that the
phase in progress ends within its bound. When one does not, the process prints one line naming
the phase, the step and the seconds waited, writes every thread's Python stack (faulthandler)
to ``<workdir>/watchdog-process_<i>.txt`` and exits with ``EXIT_CODE`` at once (``os._exit``:
the blocked main thread would never run a cleanup; the checkpoint being written stays in
Orbax's temporary directory, which restore never reads).

Bounds (``config.watchdog``): the first occurrence in a process of a phase that compiles or
reads a checkpoint (``SLOW_FIRST``: step, evaluation, restore, and the final wait for the last
write) may take ``first_seconds``; so do the steps until the step time is measured (at the second
log after the start). Afterwards a step may take ``max(floor_seconds, factor * log_every *
seconds per step)`` (a step that fetches the logged metrics waits for all ``log_every`` steps
queued before it), and an evaluation ``max(floor_seconds, factor * the longest one after the
first)``. A save compiles nothing and its write goes on in the background: every save, the first
included, may take ``max(floor_seconds, factor * the longest earlier save)``, so that a peer
stalled at a resumed run's first save is not waited for ``first_seconds``.

A process that fails (a full disk, a non-finite loss) publishes a one-line account in the
runtime's key-value store (``publish_failure``); the others' watchdogs read it at once and stop
with that line (status 1) instead of waiting out their bound in a collective that the failed
process will never join.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import threading
import time

import jax

from attnjax import storage

FAILURE_EXIT_CODE = 1
_FAILURE_KEYS = "attnjax/failed/"
EXIT_CODE = 124  # as coreutils' timeout: "timed out", apart from errors (1) and requeue (75)
DEFAULTS = dict(floor_seconds=120.0, factor=20.0, first_seconds=1800.0)
SLOW_FIRST = frozenset({"step", "evaluation", "restore", "finish"})
POLL_SECONDS = 0.5
PUBLISH_SECONDS = 5.0
LINGER_SECONDS = 4 * POLL_SECONDS


def settings(config) -> dict:
    """``config.watchdog`` over ``DEFAULTS``; a bound that is not a positive number is refused
    with one line naming it."""
    given = config.get("watchdog", None) or {}
    given = dict(given.to_dict() if hasattr(given, "to_dict") else given)
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"config.watchdog has unknown field(s) {unknown}; expected {DEFAULTS}.")
    values = {**DEFAULTS, **given}
    for key, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"config.watchdog.{key}={value!r} must be a positive number.")
    return {key: float(value) for key, value in values.items()}


def longest_bound(config) -> float:
    """Seconds no bound of the watchdog exceeds before the step time is known: what a
    backend's own timeout must exceed for the watchdog to speak first."""
    bounds = settings(config)
    return bounds["first_seconds"] + bounds["floor_seconds"]


def stacks_path(workdir: str) -> str:
    return storage.join(workdir, f"watchdog-process_{jax.process_index()}.txt")


class Watchdog:
    """Phases of one run and the thread that bounds them; ``stop()`` ends the watch."""

    def __init__(self, config, workdir: str):
        self.bounds = settings(config)
        self.log_every = int(config.log_every)
        self.workdir = workdir
        self.seconds_per_step: float | None = None
        self._completed: set[str] = set()  # phases whose first occurrence ended
        self._longest: dict[str, float] = {}  # by phase, their first occurrence excluded
        self._phase: tuple[str, int, float, float] | None = None  # name, step, start, bound
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._failed: list[str] = []
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()
        # The store lives in process 0: while that process is stopped, a read of it never
        # returns. Reading in a thread of its own keeps the bounds checked meanwhile.
        self._listener = threading.Thread(target=self._listen, name="watchdog-peers", daemon=True)
        self._listener.start()

    def enter(self, phase: str, step: int | None = None) -> None:
        """The previous phase ended; ``phase`` of ``step`` (default: the previous phase's step)
        begins now."""
        now = time.monotonic()
        with self._lock:
            if self._phase is not None:
                name, previous_step, start, _ = self._phase
                step = previous_step if step is None else step
                if name in self._completed or name not in SLOW_FIRST:
                    self._longest[name] = max(self._longest.get(name, 0.0), now - start)
                self._completed.add(name)
            self._phase = (phase, 0 if step is None else step, now, self._bound(phase))

    def measured(self, seconds_per_step: float) -> None:
        """The loop's step time, measured between two logs (compilation excluded)."""
        self.seconds_per_step = seconds_per_step

    def fail(self, error: BaseException) -> None:
        """A failure learnt outside the main thread (an asynchronous write), which may be
        waiting at a barrier the others never reach: tells the others, prints one line and
        exits with ``FAILURE_EXIT_CODE`` at once."""
        sys.stderr.write(
            f"\nerror: process {jax.process_index()} of {jax.process_count()} failed: "
            f"{one_line(error)}\n"
        )
        sys.stderr.flush()  # before the others learn of it: process 0's end may abort this one
        publish_failure(error)
        exit_failed()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
        self._listener.join(timeout=2 * POLL_SECONDS)  # may be inside a read that never returns

    def _bound(self, phase: str) -> float:
        floor, factor, first = (
            self.bounds[k] for k in ("floor_seconds", "factor", "first_seconds")
        )
        if phase == "step":
            if self.seconds_per_step is None:
                return first
            return max(floor, factor * self.log_every * self.seconds_per_step)
        if phase in SLOW_FIRST and phase not in self._completed:
            return first
        return max(floor, factor * self._longest.get(phase, 0.0))

    def _listen(self) -> None:
        while not self._failed and not self._stopped.wait(POLL_SECONDS):
            self._failed = peer_failures()

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_SECONDS):
            failed = self._failed
            if failed:
                sys.stderr.write(
                    f"\nerror: process {jax.process_index()} of {jax.process_count()} stops "
                    f"because {failed[0]}\n"
                )
                exit_failed()
            with self._lock:
                if self._phase is None:
                    continue
                name, step, start, bound = self._phase
                waited = time.monotonic() - start
            if waited > bound:
                self._fire(name, step, waited, bound)

    def _fire(self, phase: str, step: int, waited: float, bound: float) -> None:
        path = stacks_path(self.workdir)
        # On a line of its own: a progress bar may have left the cursor mid-line.
        sys.stderr.write(
            f"\nwatchdog: process {jax.process_index()} of {jax.process_count()} made no progress "
            f"in the {phase} of step {step} for {waited:.1f} s (bound {bound:.1f} s); stopping "
            f"with status {EXIT_CODE}, every thread's stack in {path}\n"
        )
        sys.stderr.flush()
        try:
            # faulthandler writes to a file descriptor: a local file, copied to a bucket.
            with tempfile.TemporaryFile("w+") as stacks:
                faulthandler.dump_traceback(stacks, all_threads=True)
                stacks.seek(0)
                storage.write_atomic(path, stacks.read())
        finally:
            os._exit(EXIT_CODE)


def exit_failed() -> None:
    """Ends a process of several with ``FAILURE_EXIT_CODE`` at once: JAX's shutdown would wait
    at a barrier for peers that may be gone. Process 0 holds the coordination service, whose end
    makes the others' clients abort them (SIGABRT): it stays ``LINGER_SECONDS`` first, so that
    their watchdogs read its published failure and stop with its line."""
    sys.stdout.flush()
    sys.stderr.flush()
    if jax.process_index() == 0:
        time.sleep(LINGER_SECONDS)
    os._exit(FAILURE_EXIT_CODE)


def _store():
    """The multi-process runtime's key-value store, or None on one process."""
    if jax.process_count() == 1:
        return None
    from jax._src import distributed  # the store has no public API; only its client is used

    return distributed.global_state.client


def one_line(error: BaseException) -> str:
    """``"<type>: <first line of the message>"``: how train.py and the other processes are told
    of a failure."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def publish_failure(error: BaseException) -> None:
    """Tells the other processes, one line, that this one failed with ``error``."""
    store = _store()
    if store is None:
        return
    line = f"process {jax.process_index()} failed: {one_line(error)}"

    def publish():
        try:
            store.key_value_set(f"{_FAILURE_KEYS}{jax.process_index()}", line)
        except Exception:  # already published, or the store is gone: the others' bound holds
            pass

    # A stopped process 0 holds the store: the write would never return, and the error it
    # reports must still reach this process's own output.
    writer = threading.Thread(target=publish, name="watchdog-publish", daemon=True)
    writer.start()
    writer.join(timeout=PUBLISH_SECONDS)


def peer_failures() -> list[str]:
    """What the other processes published with ``publish_failure``."""
    store = _store()
    if store is None:
        return []
    try:
        entries = store.key_value_dir_get(_FAILURE_KEYS)
    except Exception:  # the store is unreachable: the phase's bound still holds
        return []
    own = f"{_FAILURE_KEYS}{jax.process_index()}"
    return [value for key, value in sorted(entries) if key.rstrip("/") != own]
