"""attnjax/train/requeue.py: ``python -m attnjax.train.requeue -- CMD`` reruns CMD while it exits
75, and only then, exits with its last status and passes its signals on; real processes."""

import os
import signal
import subprocess
import sys

from helpers import ROOT

from attnjax.train import preemption
from attnjax.train import requeue as requeue_module

# Appends one line to argv[1] per run, then exits with the status listed for that run in
# argv[2] (the last one from then on).
COUNTS_RUNS = """
import sys
path, codes = sys.argv[1], [int(c) for c in sys.argv[2].split(",")]
with open(path, "a") as f:
    f.write("run\\n")
runs = sum(1 for _ in open(path))
sys.exit(codes[min(runs, len(codes)) - 1])
"""

# Says "ready", then, at SIGTERM, "saves" for half a second and exits with 75, as train.py does;
# a second SIGTERM meanwhile ends it at once with 99.
SAVES_AT_SIGTERM = """
import signal, sys, time
received = []
def on_term(*_):
    received.append(True)
    if len(received) > 1:
        sys.exit(99)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while not received:
    time.sleep(0.01)
time.sleep(0.5)
sys.exit(75)
"""


def requeue(*args, **kwargs):
    command = [sys.executable, "-m", "attnjax.train.requeue", "--delay-seconds=0", *args]
    return subprocess.Popen(command, cwd=ROOT, text=True, **kwargs)


def runs_of(codes: str, tmp_path, *options):
    log = tmp_path / "runs.txt"
    proc = requeue(
        *options, "--", sys.executable, "-c", COUNTS_RUNS, str(log), codes, stderr=subprocess.PIPE
    )
    _, err = proc.communicate(timeout=60)
    return proc.returncode, len(log.read_text().splitlines()), err


def test_the_wrapper_reruns_on_train_pys_requeue_status():
    # The wrapper keeps its own copy so that it starts without jax.
    assert requeue_module.REQUEUE_EXIT_CODE == preemption.REQUEUE_EXIT_CODE


def test_a_command_stopped_for_a_preemption_is_rerun_until_it_succeeds(tmp_path):
    code, runs, err = runs_of("75,75,0", tmp_path)
    assert (code, runs) == (0, 3), err
    assert "run 1 of " in err and "stopped for a preemption after saving (status 75)" in err


def test_a_failed_command_is_not_rerun(tmp_path):
    code, runs, err = runs_of("1", tmp_path)
    assert (code, runs, err) == (1, 1, "")


def test_the_runs_are_bounded(tmp_path):
    code, runs, err = runs_of("75", tmp_path, "--max-runs=2")
    assert (code, runs) == (75, 2)
    assert err.strip().endswith(
        "still stopped for a preemption after 2 runs; exiting 75 (raise --max-runs to go on)"
    )


def test_sigterm_to_the_wrapper_reaches_the_command_which_is_not_rerun(tmp_path):
    proc = requeue("--", sys.executable, "-c", SAVES_AT_SIGTERM, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 75 and out == ""  # saved and stopped, once


def test_a_signal_to_the_wrappers_process_group_stops_the_command_after_saving(tmp_path):
    proc = requeue(
        "--", sys.executable, "-c", SAVES_AT_SIGTERM, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.killpg(proc.pid, signal.SIGTERM)  # as a terminal or a shell's kill of a job would
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 75
