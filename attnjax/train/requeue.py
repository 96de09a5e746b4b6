"""Reruns a training command while it stops for a preemption: the restart loop of a pod recipe.

    python -m attnjax.train.requeue -- python train.py --config ... --workdir ...

``train.py`` exits with 75 (``EX_TEMPFAIL``, ``attnjax.train.preemption.REQUEUE_EXIT_CODE``)
when it stopped for a preemption after saving; rerunning the same command continues where it
stopped. This wrapper runs the command, and runs it again after ``--delay-seconds`` each time
it exits 75, at most ``--max-runs`` times in all; any other status ends it, and it exits with
the last run's status (128 + N for a run killed by signal N, as a shell reports it).

SIGTERM, SIGINT and SIGHUP sent to the wrapper are passed to the running command, which then
saves and exits 75 as if signalled itself; the wrapper then stops too, with that status, so that
whoever stopped it (a scheduler, a deleted pod, Ctrl-C) decides what runs next. The command
runs in a session of its own, so that a terminal's Ctrl-C or a signal to the wrapper's process
group reaches it once, through the wrapper. A platform that signals every process of the job
itself (systemd at a VM's shutdown) reaches the command twice, and a single-process ``train.py``
takes the second signal as a request to stop at once without saving: there, run it directly.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import time

REQUEUE_EXIT_CODE = 75  # attnjax.train.preemption's, not imported: this module never loads jax
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _Forwarder:
    """Signal handlers passing each signal to the running child, for a ``with`` block."""

    def __init__(self):
        self.child: subprocess.Popen | None = None
        self.received: list[tuple[int, bool]] = []  # (signal, passed to a child)
        self._previous: dict = {}

    def _handle(self, signum, frame):
        del frame
        child = self.child
        if child is not None:
            child.send_signal(signum)  # a no-op once the child has been waited for
        self.received.append((signum, child is not None))

    def start(self, command: list[str]) -> subprocess.Popen:
        """Starts ``command``, passing it any signal received while it was being started."""
        self.child, before = None, len(self.received)
        child = subprocess.Popen(command, start_new_session=True)
        self.child = child
        for signum, sent in self.received[before:]:
            if not sent:
                child.send_signal(signum)
        return child

    def __enter__(self) -> _Forwarder:
        self._previous = {s: signal.signal(s, self._handle) for s in FORWARDED}
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def run_until_done(command: list[str], max_runs: int = 100, delay_seconds: float = 5.0) -> int:
    """Runs ``command`` until it exits other than 75, at most ``max_runs`` times -> the last
    exit status."""
    if not command:
        raise ValueError("no command after '--'; expected e.g. -- python train.py --workdir ...")
    if max_runs < 1:
        raise ValueError(f"--max-runs={max_runs}; expected at least 1.")
    if delay_seconds < 0:
        raise ValueError(f"--delay-seconds={delay_seconds}; expected >= 0.")
    code = 0
    with _Forwarder() as forwarder:
        for run in range(1, max_runs + 1):
            if forwarder.received:  # stopped between two runs: nothing to pass the signal to
                return code if run > 1 else 128 + forwarder.received[0][0]
            child = forwarder.start(command)
            code = child.wait()
            code = 128 - code if code < 0 else code
            if code != REQUEUE_EXIT_CODE or forwarder.received:
                return code
            if run < max_runs:
                print(
                    f"requeue: run {run} of {shlex.join(command)!r} stopped for a preemption "
                    f"after saving (status {code}); run {run + 1} of at most {max_runs} in "
                    f"{delay_seconds:g} s",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(delay_seconds)
    print(
        f"requeue: {shlex.join(command)!r} still stopped for a preemption after {max_runs} "
        f"runs; exiting {code} (raise --max-runs to go on)",
        file=sys.stderr,
        flush=True,
    )
    return code


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnjax.train.requeue",
        description="Rerun a command while it exits 75 (see the module docstring).",
    )
    parser.add_argument("--max-runs", type=int, default=100, help="runs in all, the first included")
    parser.add_argument("--delay-seconds", type=float, default=5.0, help="pause before each rerun")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program [args...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        return run_until_done(command, args.max_runs, args.delay_seconds)
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    sys.exit(main())
