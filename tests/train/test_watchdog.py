"""attnjax/train/watchdog.py: a phase that outlasts its bound ends the process with one line,
every thread's stack on disk and status 124, in a real process."""

import os
import re
import subprocess
import sys
import time

import ml_collections
import pytest
from helpers import ROOT

from attnjax.train import watchdog

# A step of 10 ms logged every 5 steps: after it is measured a step may take
# max(floor 0.5, factor 2 x 5 x 0.01) = 0.5 s; before, first_seconds 1.5.
STALLS = """
import sys, time
import ml_collections
from attnjax.train import watchdog
config = ml_collections.ConfigDict(dict(log_every=5, watchdog=dict(
    floor_seconds=0.5, factor=2.0, first_seconds=1.5)))
dog = watchdog.Watchdog(config, sys.argv[1])
dog.enter("step", 1)
time.sleep(1.0)  # the first step: within first_seconds
dog.measured(0.01)
dog.enter("step", 2)
time.sleep(30)
"""


def test_a_stalled_step_ends_the_process_with_one_line_and_the_stacks(tmp_path):
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", STALLS, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == watchdog.EXIT_CODE == 124, proc.stderr
    stacks = os.path.join(tmp_path, "watchdog-process_0.txt")
    line = proc.stderr.strip().splitlines()[-1]
    match = re.fullmatch(
        r"watchdog: process 0 of 1 made no progress in the step of step 2 for ([\d.]+) s "
        r"\(bound 0.5 s\); stopping with status 124, every thread's stack in " + re.escape(stacks),
        line,
    )
    assert match, proc.stderr
    assert 0.5 <= float(match.group(1)) < 0.5 + 2 * watchdog.POLL_SECONDS
    assert elapsed < 25  # not the 30 s sleep
    with open(stacks) as f:
        text = f.read()
    sleep = STALLS.splitlines().index("time.sleep(30)") + 1
    assert f'File "<string>", line {sleep} in <module>' in text  # the main thread, asleep
    assert "in _watch" in text  # the watchdog's own thread


# A save compiles nothing: its first occurrence gets the floor, not first_seconds, so a peer
# stalled at a resumed run's first save is not waited for 30 minutes.
FIRST_SAVE_STALLS = """
import sys, time
import ml_collections
from attnjax.train import watchdog
config = ml_collections.ConfigDict(dict(log_every=5, watchdog=dict(
    floor_seconds=0.5, factor=2.0, first_seconds=60.0)))
dog = watchdog.Watchdog(config, sys.argv[1])
dog.enter("restore", 0)
time.sleep(1.0)  # reading a checkpoint: within first_seconds
dog.enter("save", 30)
time.sleep(30)
"""


def test_a_stalled_first_save_gets_the_floor_not_the_compile_allowance(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", FIRST_SAVE_STALLS, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == watchdog.EXIT_CODE, proc.stderr
    assert re.search(
        r"made no progress in the save of step 30 for [01]\.\d s \(bound 0.5 s\)", proc.stderr
    ), proc.stderr


@pytest.mark.parametrize(
    "watch, message",
    [
        (dict(floor_seconds=0), r"config.watchdog.floor_seconds=0 must be a positive number."),
        (dict(factor="x"), r"config.watchdog.factor='x' must be a positive number."),
        (dict(first=1), r"config.watchdog has unknown field\(s\) \['first'\]; expected "),
    ],
)
def test_bad_bounds_are_refused_naming_the_field(watch, message):
    with pytest.raises(ValueError, match=message):
        watchdog.settings(ml_collections.ConfigDict(dict(watchdog=watch)))
    assert watchdog.settings(ml_collections.ConfigDict()) == watchdog.DEFAULTS
