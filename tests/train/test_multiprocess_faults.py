"""One of several processes fails: a SIGTERM to one, a stalled one (SIGSTOP), one killed
mid-save, one whose disk is full. The others never hang, nothing complete is damaged, and a
relaunch, on another process count (1 x 4, 4 x 1), ends where an uninterrupted run ends
(attnjax/parallel/watchdog.py, elastic.py, launch.py, preemption.py)."""

import glob
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import flax
import numpy as np
import pytest
from helpers import ROOT, assert_close, tiny_vit_flags, xla_flags

from attnjax.parallel import launch, watchdog
from attnjax.train import checkpoint, preemption

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
# Files of at most 4 KiB for the wrapped process (EFBIG, ENOSPC's per-process sibling), the
# wrapper the random-faults benchmark uses too.
from multiprocess_faults import FULL_DISK  # noqa: E402

# Several JAX processes each: the one xdist worker of the multi-process tests runs them in turn.
pytestmark = pytest.mark.xdist_group("multiprocess")

STEPS = 60
FLOOR = 20.0  # the watchdog's floor: above a loaded 2-core machine's slowest save (10+ s seen)
# SGD: under Adam, parameters whose gradient is zero (attention key biases) move by rounding
# noise, which differs between gloo's and one process's reduction order.
FLAGS = (
    "--config.optimizer=sgd",
    "--config.learning_rate=0.3",
    *tiny_vit_flags(),
    "--config.warmup_steps=2",
    f"--config.num_train_steps={STEPS}",
    "--config.log_every=5",
    # Evaluated at 30 and 60: the best-metric checkpointer saves beside the latest one on every
    # process (the two once collided on Orbax's barrier).
    f"--config.eval_every={STEPS // 2}",
    "--config.checkpoint_every=10",
    f"--config.watchdog.floor_seconds={FLOOR}",
    "--config.watchdog.first_seconds=120",
)


def train_command(workdir, data_dir, *extra):
    config = os.path.join(ROOT, "configs", "vit_digits.py")
    return ["train.py", f"--config={config}", f"--workdir={workdir}"] + [
        f"--config.data.data_dir={data_dir}",
        *FLAGS,
        *extra,
    ]


def base_env():
    """The environment less JAX's settings, but for the suite's compilation cache."""
    return {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or "CACHE" in k}


def run_one_process(command, devices):
    env = dict(base_env(), XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, *command], env=env, cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


class Launcher:
    """``python -m attnjax.parallel.launch`` with its output collected as it comes."""

    def __init__(self, command, processes, devices_per_process):
        argv = [sys.executable, "-m", "attnjax.parallel.launch", f"--processes={processes}"]
        argv += [f"--devices-per-process={devices_per_process}", "--", *command]
        self.proc = subprocess.Popen(
            argv, env=base_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self.lines = []
        self.reader = threading.Thread(
            target=lambda: self.lines.extend(line.decode() for line in self.proc.stdout),
            daemon=True,
        )
        self.reader.start()

    def pids(self):
        found = [re.match(r"\[launch\] process (\d): pid (\d+)", line) for line in self.lines]
        return {int(m.group(1)): int(m.group(2)) for m in found if m}

    def wait(self, timeout=400):
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return self.proc.returncode, "".join(self.lines)


def start_processes(command, tmp_path, name, count=2, devices=2, wrap=None):
    """``count`` processes of one run started as a scheduler would, without the launcher (whose
    killing the others would hide theirs watchdogs) -> ``[(Popen, stderr path)]``; ``wrap``:
    ``{index: argv prefix}``."""
    port = launch.free_port()
    started = []
    for index in range(count):
        env = launch.process_env(
            base_env(), index=index, count=count, port=port, devices_per_process=devices
        )
        env.update(XLA_FLAGS=launch.with_cpu_device_count(os.environ["XLA_FLAGS"], devices))
        if wrap and index in wrap:  # a limit on file sizes: no compilation cache entries either
            env.pop("JAX_COMPILATION_CACHE_DIR")
        err = str(tmp_path / f"{name}-p{index}.err")
        argv = [*(wrap or {}).get(index, []), sys.executable, *command]
        with open(err, "w") as stderr:
            started.append(
                (subprocess.Popen(argv, env=env, cwd=ROOT, stdout=stderr, stderr=stderr), err)
            )
    return started


def wait_until(predicate, processes, timeout=300):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert all(p.poll() is None for p in processes), "a process ended first"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def logged_steps(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as lines:
        return [json.loads(line)["step"] for line in lines if '"train/loss"' in line]


def saved_steps(workdir):
    directory = os.path.join(workdir, "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(int(name) for name in names if name.isdigit())


def writing(workdir):
    return glob.glob(os.path.join(workdir, "checkpoints", "*.orbax-checkpoint-tmp*"))


def complete_checkpoints(workdir):
    """sha256 of every file of every complete checkpoint."""
    digests = {}
    directory = os.path.join(workdir, "checkpoints")
    for step in saved_steps(workdir):
        root = os.path.join(directory, str(step))
        for path in sorted(glob.glob(os.path.join(root, "**"), recursive=True)):
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    digests[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return digests


def flat_params(workdir, **kwargs):
    return flax.traverse_util.flatten_dict(checkpoint.load(workdir, **kwargs)[1], sep="/")


def assert_equal_to_reference(workdir, reference):
    """The latest and the best checkpoint's parameters: gloo's reduction order rounds
    differently from one process's, and a small entry of a tensor carries the error of its
    large ones: 1e-5 of the tensor's scale, 1e-6 for tensors that are rounding noise themselves
    (attention key biases, whose gradient is zero)."""
    for best in (False, True):
        expected, got = flat_params(reference, best=best), flat_params(workdir, best=best)
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            scale = float(np.abs(value).max())
            what = f"{'best ' if best else ''}{key}"
            assert_close(got[key], value, rtol=1e-5, atol=max(1e-6, 1e-5 * scale), what=what)


def test_the_launcher_knows_the_exit_statuses():
    assert launch.REQUEUE_EXIT_CODE == preemption.REQUEUE_EXIT_CODE
    assert launch.WATCHDOG_EXIT_CODE == watchdog.EXIT_CODE


@pytest.fixture(scope="module")
def reference(digits_dir, tmp_path_factory):
    """The uninterrupted run, 1 process x 4 devices: what every relaunch must end with."""
    workdir = str(tmp_path_factory.mktemp("reference") / "run")
    run_one_process(train_command(workdir, digits_dir), devices=4)
    return workdir


def test_sigterm_to_one_process_then_resume_on_other_process_counts(
    reference, digits_dir, tmp_path
):
    """SIGTERM to process 1 only: both processes save the same step and exit 75. That
    checkpoint of 2 processes x 2 devices resumes on 1 x 4, ending with the uninterrupted run's
    parameters (on 4 x 1: the relaunch of the next test)."""
    saved = str(tmp_path / "two")
    run = Launcher(train_command(saved, digits_dir), processes=2, devices_per_process=2)
    wait_until(lambda: max(logged_steps(saved), default=0) >= 25, [run.proc])
    os.kill(run.pids()[1], signal.SIGTERM)
    status, output = run.wait()
    assert status == preemption.REQUEUE_EXIT_CODE, output[-3000:]
    stops = re.findall(r"\[p(\d)\] train.py: stopped by SIGTERM after step (\d+);", output)
    assert sorted(p for p, _ in stops) == ["0", "1"], output[-3000:]
    step = int(stops[0][1])
    assert {int(s) for _, s in stops} == {step} and 25 <= step < STEPS
    assert saved_steps(saved)[-1] == step
    data = os.path.join(saved, "checkpoints", str(step), "data")
    for index in (0, 1):  # the global position, written by each process
        with open(os.path.join(data, f"process_{index}-of-2.json")) as f:
            assert json.load(f) == {"next_index": step}

    run_one_process(train_command(saved, digits_dir), devices=4)
    assert logged_steps(saved)[-1] == STEPS
    assert_equal_to_reference(saved, reference)


def test_stalled_killed_and_full_disk_peers_never_hang_and_the_relaunch_ends_equal(
    reference, digits_dir, tmp_path
):
    workdir = str(tmp_path / "run")
    # Parameters split over both processes: each writes its own shards of every checkpoint.
    command = train_command(workdir, digits_dir, "--config.mesh.data=1", "--config.mesh.fsdp=-1")

    # A stalled peer: the other's watchdog ends it, the launcher ends the stopped one. The
    # stopped one is process 0, which holds JAX's coordination service and its key-value store:
    # a read of the store then never returns, and the bound must hold regardless.
    run = Launcher(command, processes=2, devices_per_process=2)
    wait_until(lambda: max(logged_steps(workdir), default=0) >= 20, [run.proc])
    os.kill(run.pids()[0], signal.SIGSTOP)
    stopped = time.monotonic()
    status, output = run.wait()
    waited = time.monotonic() - stopped
    assert status == watchdog.EXIT_CODE, output[-3000:]
    line = re.search(
        r"\[p1\] watchdog: process 1 of 2 made no progress in the (\w+) of step (\d+) for "
        r"([\d.]+) s \(bound ([\d.]+) s\); stopping with status 124, every thread's stack in "
        + re.escape(os.path.join(workdir, "watchdog-process_1.txt")),
        output,
    )
    assert line, output[-3000:]
    # The bound: the floor, or 20 x the measured step time where a loaded machine makes it more.
    bound = float(line.group(4))
    assert bound >= FLOOR and bound <= float(line.group(3)) < bound + 2  # printed to 0.1 s
    assert "[launch] process 1 exited with 124" in output
    # The bound, the launcher's 5 s grace before SIGKILL for the stopped one, polling.
    assert waited < bound + 10, waited
    print(
        f"stalled peer: watchdog line after {float(line.group(3)):.1f} s, launcher {waited:.1f} s"
    )
    with open(os.path.join(workdir, "watchdog-process_1.txt")) as stacks:
        assert "most recent call first" in stacks.read()

    # kill -9 of one process mid-save: the survivor exits within its bound, by itself.
    before = set(writing(workdir))
    processes = start_processes(command, tmp_path, "killed")
    wait_until(lambda: set(writing(workdir)) - before, [p for p, _ in processes])
    processes[1][0].kill()
    killed = time.monotonic()
    survivor = processes[0][0]
    survivor.wait(timeout=60)
    print(f"kill -9 mid-save: survivor ended {time.monotonic() - killed:.1f} s later")
    assert time.monotonic() - killed < FLOOR + 5
    assert survivor.returncode > 0, open(processes[0][1]).read()[-3000:]

    # A full disk for process 1 alone: nobody hangs, no partial step is taken as the latest, the
    # complete checkpoints are untouched.
    intact = complete_checkpoints(workdir)
    processes = start_processes(command, tmp_path, "full", wrap={1: FULL_DISK})
    for proc, _ in processes:
        proc.wait(timeout=300)
    errors = [open(err).read() for _, err in processes]
    # Process 1's write fails in Orbax's writer thread, which logs it: process 1 publishes it,
    # and process 0's watchdog reads it from the key-value store: one line each, status 1.
    assert [p.returncode for p, _ in processes] == [1, 1], errors[0][-3000:] + errors[1][-3000:]
    what = (
        r"CheckpointWriteError: \[Errno 27\] process 1 could not write a checkpoint to "
        + re.escape(os.path.join(workdir, "checkpoints"))
        + r"(_best)?: File too large \(errno EFBIG\); the checkpoints written before are intact"
    )
    # (Or from its main thread, where Orbax raises the failure there first.)
    ours = r"\n(error: process 1 of 2 failed|train.py: error): "
    assert re.search(ours + what, errors[1]), errors[1][-3000:]
    assert re.search(
        r"\nerror: process 0 of 2 stops because process 1 failed: " + what, errors[0]
    ), errors[0][-3000:]
    assert saved_steps(workdir)[-1] == max(int(k.split("/")[0]) for k in intact)
    after = complete_checkpoints(workdir)
    assert {k: v for k, v in after.items() if k in intact} == intact

    # The relaunch on 4 processes x 1 device: each process reads its shards of the 2 x 2 run's
    # checkpoint and its position in the data from the global one.
    status, output = Launcher(command, processes=4, devices_per_process=1).wait()
    assert status == 0, output[-3000:]
    assert logged_steps(workdir)[-1] == STEPS
    assert_equal_to_reference(workdir, reference)
