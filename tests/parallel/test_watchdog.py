"""attnjax/parallel/watchdog.py: a phase that outlasts its bound ends the process with one line,
every thread's stack on disk and status 124, in a real process."""

import os
import re
import subprocess
import sys
import time

import ml_collections
import pytest
from helpers import ROOT

from attnjax.parallel import watchdog

# A process whose watchdog (floor 0.5 s, factor 2, log_every 5) sees ``before`` take 1 s, then
# ``stalled`` never end.
STALLS = """
import sys, time
import ml_collections
from attnjax.parallel import watchdog
config = ml_collections.ConfigDict(dict(log_every=5, watchdog=dict(
    floor_seconds=0.5, factor=2.0, first_seconds={first_seconds})))
dog = watchdog.Watchdog(config, sys.argv[1])
dog.enter({before})
time.sleep(1.0)  # within first_seconds
{between}
dog.enter({stalled})
time.sleep(30)
"""


def run_stalled(tmp_path, **fields):
    script = STALLS.format(**fields)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return script, proc


def test_a_stalled_step_ends_the_process_with_one_line_and_the_stacks(tmp_path):
    # A step of 10 ms: after it is measured a step may take max(0.5, 2 x 5 x 0.01) = 0.5 s.
    started = time.monotonic()
    script, proc = run_stalled(
        tmp_path,
        first_seconds=1.5,
        before='"step", 1',
        between="dog.measured(0.01)",
        stalled='"step", 2',
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
    sleep = script.splitlines().index("time.sleep(30)") + 1
    assert f'File "<string>", line {sleep} in <module>' in text  # the main thread, asleep
    assert "in _watch" in text  # the watchdog's own thread


def test_a_stalled_first_save_gets_the_floor_not_the_compile_allowance(tmp_path):
    """A save compiles nothing: its first occurrence gets the floor, not first_seconds, so a
    peer stalled at a resumed run's first save is not waited for 30 minutes."""
    _, proc = run_stalled(
        tmp_path, first_seconds=60.0, before='"restore", 0', between="", stalled='"save", 30'
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
