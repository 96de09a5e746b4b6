"""Stopping a run cleanly when the scheduler asks: SIGTERM (how TPU/GPU schedulers preempt)
or SIGINT (Ctrl-C).

The first signal only sets a flag; the training loop looks at it after each step, saves a
checkpoint at that step (state and data iterator), waits for the write, and raises
``Preempted``. ``train.py`` then exits with ``REQUEUE_EXIT_CODE`` (75, ``EX_TEMPFAIL`` of
sysexits.h: "temporary failure, try again"), which a scheduler or a wrapper script reads as
"requeue me"; rerunning the same command continues bit-identically. A second signal ends the
process at once, by that signal, as if no handler were installed.

Multi-process runs must all stop at the same step, or the save would wait forever for the
processes that went on. JAX's preemption service (started by ``jax.distributed.initialize``)
catches SIGTERM on every process and picks the step; ``orbax.checkpoint.multihost``'s
``reached_preemption(step)`` reports it, so there the loop asks that instead, and this module
installs no handler (a flag set on one process alone would stop it without the others).
"""

from __future__ import annotations

import os
import signal
import threading

import jax
import orbax.checkpoint as ocp
from absl import logging

REQUEUE_EXIT_CODE = 75


class Preempted(Exception):
    """The run saved its state at ``step`` and stopped because it was asked to."""

    def __init__(self, step: int, directory: str, signal_name: str):
        super().__init__(
            f"stopped by {signal_name} after step {step}; its checkpoint is in "
            f"{directory}; rerun the same command to continue."
        )
        self.step = step


class StopRequest:
    """Signal handlers for the duration of a ``with`` block; ``requested(step)`` asks whether
    to stop after ``step``. Outside the main thread (where Python cannot install handlers)
    nothing is installed."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame):
        del frame
        if self.signal_name is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signal_name = signal.Signals(signum).name
        logging.warning(
            "%s received: saving at the end of this step, then stopping (send it "
            "again to stop at once without saving)",
            self.signal_name,
        )

    def __enter__(self) -> StopRequest:
        if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
            return self
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def requested(self, step: int) -> bool:
        if jax.process_count() > 1 and ocp.multihost.reached_preemption(step):
            self.signal_name = self.signal_name or "SIGTERM"
            return True
        return self.signal_name is not None
