"""Training from a folder of images keeps what training from TFDS keeps: 2 processes x 2 devices
train what 1 process x 4 devices trains, and a run killed with SIGKILL and rerun ends bit for bit
where the uninterrupted run ends (its grain iterator state, decoding in grain's threads,
restored from the checkpoint)."""

import os
import signal
import subprocess
import sys
import time

import flax
import numpy as np
import pytest
from helpers import ROOT, assert_close, tiny_vit_flags, xla_flags

from attnjax.train import checkpoint

# Real JAX processes: one xdist worker runs them with the other multi-process tests, one at a time.
pytestmark = pytest.mark.xdist_group("multiprocess")

STEPS = 4
# SGD: Adam would blow the rounding noise of gloo's reduction order up to full steps (see
# tests/train/test_multiprocess.py).
FLAGS = (
    "--config.optimizer=sgd",
    "--config.learning_rate=0.3",
    *tiny_vit_flags(),
    "--config.warmup_steps=1",
    "--config.log_every=2",
    "--config.eval_every=4",
    "--config.checkpoint_every=2",
    f"--config.num_train_steps={STEPS}",
)


def _command(folder, workdir, *flags):
    return [
        "train.py",
        f"--config={os.path.join(ROOT, 'configs', 'vit_digits.py')}",
        f"--workdir={workdir}",
        f"--config.data.name=folder:{folder}",
        *FLAGS,
        *flags,
    ]


def _env(devices=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or "CACHE" in k}
    if devices:
        env.update(XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu")
    return env


def _params(workdir):
    return flax.traverse_util.flatten_dict(checkpoint.load(workdir)[1], sep="/")


def _steps(workdir):
    directory = os.path.join(workdir, "checkpoints")
    return (
        sorted(int(n) for n in os.listdir(directory) if n.isdigit())
        if os.path.isdir(directory)
        else []
    )


def _start(command, env, log):
    with open(log, "w") as output:
        return subprocess.Popen(command, env=env, cwd=ROOT, stdout=output, stderr=output)


def _finish(proc, log):
    proc.wait(timeout=400)
    with open(log) as output:
        assert proc.returncode == 0, output.read()[-4000:]


def test_folder_runs_on_two_processes_and_after_a_kill_equal_one_uninterrupted_run(
    digits_folder, tmp_path
):
    # Two JAX processes at a time, as in tests/train/test_multiprocess.py: the uninterrupted run
    # beside the one killed (decoding in grain's threads) after its first checkpoint, then beside
    # its rerun; then 2 processes x 2 devices.
    one, killed = str(tmp_path / "one"), str(tmp_path / "killed")
    uninterrupted = _start(
        [sys.executable, *_command(digits_folder, one)], _env(4), tmp_path / "one.log"
    )
    command = [sys.executable, *_command(digits_folder, killed, "--config.data.read_threads=2")]
    proc = subprocess.Popen(command, env=_env(4), cwd=ROOT, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not _steps(killed) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and _steps(killed)[-1] < STEPS, _steps(killed)
    rerun = _start(command, _env(4), tmp_path / "rerun.log")
    _finish(uninterrupted, tmp_path / "one.log")
    _finish(rerun, tmp_path / "rerun.log")
    reference, resumed = _params(one), _params(killed)
    for key, value in reference.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)

    two = str(tmp_path / "two")
    launch = [sys.executable, "-m", "attnjax.parallel.launch", "--processes=2"]
    command = [*launch, "--devices-per-process=2", "--", *_command(digits_folder, two)]
    _finish(_start(command, _env(), tmp_path / "two.log"), tmp_path / "two.log")
    got = _params(two)
    assert sorted(got) == sorted(reference)
    for key, value in reference.items():
        scale = float(np.abs(value).max())
        assert_close(got[key], value, rtol=1e-5, atol=max(1e-6, 1e-5 * scale), what=key)
