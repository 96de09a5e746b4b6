"""Faults a long run meets, tried for real on train.py: kill -9, SIGTERM, NaN losses, damaged
checkpoints, a full disk, two runs on one workdir (attnjax/preemption.py, workdir_lock.py,
checkpoint_integrity.py, nonfinite.py and their hooks in tasks/loop.py)."""

import glob
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, tiny_vit_config, tiny_vit_flags

from attnjax.tasks import train_and_evaluate
from attnjax.train import checkpoint, nonfinite, optim, preemption, workdir_lock

# One worker runs this module, so that its uninterrupted reference run is trained once.
pytestmark = pytest.mark.xdist_group("faults")

STEPS = 100
FLAGS = [
    *tiny_vit_flags(),
    "--config.warmup_steps=5",
    f"--config.num_train_steps={STEPS}",
    "--config.log_every=25",
    "--config.eval_every=50",
    "--config.checkpoint_every=25",
    "--config.model.dropout_rate=0.1",
    "--config.data.crop_padding=1",  # random crops: the data stream's RNG must resume too
]


def command(workdir, digits_dir, *extra):
    return [
        sys.executable,
        "train.py",
        "--config",
        "configs/vit_digits.py",
        "--workdir",
        workdir,
        f"--config.data.data_dir={digits_dir}",
        *FLAGS,
        *extra,
    ]


def config_like_flags(digits_dir, **overrides):
    settings = dict(
        warmup_steps=5, num_train_steps=STEPS, log_every=25, eval_every=50, checkpoint_every=25
    )
    config = tiny_vit_config(digits_dir, **{**settings, **overrides})
    config.model.dropout_rate = 0.1
    config.data.crop_padding = 1
    return config


@pytest.fixture(scope="module")
def env():
    # Every run compiles the same programs: later ones load them from the suite's compilation
    # cache (conftest.py), which the environment names.
    return dict(os.environ)


@pytest.fixture(scope="module")
def reference(digits_dir, env, tmp_path_factory):
    """An uninterrupted run: the workdir every fault is compared with (and copied from)."""
    workdir = str(tmp_path_factory.mktemp("reference") / "run")
    subprocess.run(
        command(workdir, digits_dir),
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    return workdir


def params(workdir, best=False):
    _, tree = checkpoint.load(workdir, best=best)
    return flax.traverse_util.flatten_dict(tree, sep="/")


def assert_same_params(workdir, reference):
    expected = params(reference)
    got = params(workdir)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():  # bit-identical: same programs, same inputs
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def digest(directory):
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "**"), recursive=True)):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


def steps_on_disk(workdir, best=False):
    directory = os.path.join(workdir, "checkpoints_best" if best else "checkpoints")
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def copy_run(reference, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(reference, workdir)
    return workdir


def tensorboard_steps(workdir, tag):
    """Steps of ``tag`` TensorBoard shows: event files in time order, a ``file_version`` event
    with a step (tensorboardX's ``purge_step``) hiding that step and later ones written before."""
    from tensorboardX.proto.event_pb2 import Event

    files = []
    for path in glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*")):
        events, data, offset = [], open(path, "rb").read(), 0
        while offset + 12 <= len(data):  # TFRecord: length, crc, payload, crc
            length = struct.unpack("<Q", data[offset : offset + 8])[0]
            if offset + 16 + length > len(data):
                break  # cut short by a kill
            event = Event()
            event.ParseFromString(data[offset + 12 : offset + 12 + length])
            events.append(event)
            offset += 16 + length
        if events:  # a killed run may leave an empty file
            files.append(events)
    shown = []
    for events in sorted(files, key=lambda events: events[0].wall_time):
        for event in events:
            if event.HasField("file_version") and event.step:
                shown = [step for step in shown if step < event.step]
            shown += [event.step for value in event.summary.value if value.tag == tag]
    return shown


def last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


# ---- kill -9 and SIGTERM: the rerun continues bit-identically ------------------------------


def test_sigterm_then_kill9_mid_write_then_rerun_is_bit_identical(
    reference, digits_dir, env, tmp_path
):
    workdir = str(tmp_path / "run")
    checkpoints = os.path.join(workdir, "checkpoints")
    # SIGTERM: the run saves the step it is at and exits with the "requeue" status.
    proc = subprocess.Popen(
        command(workdir, digits_dir),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while (
        not os.path.isdir(os.path.join(checkpoints, "25"))
        and proc.poll() is None
        and time.time() < deadline
    ):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == preemption.REQUEUE_EXIT_CODE, stderr[-2000:]
    message = last_line(stderr)
    assert message.startswith("train.py: stopped by SIGTERM after step "), message
    stopped_at = int(message.split("after step ")[1].split(";")[0])
    assert 25 <= stopped_at < STEPS
    assert max(steps_on_disk(workdir)) == stopped_at  # saved where it stopped, not before
    # The data iterator's position is saved with it: one batch per step taken.
    with open(os.path.join(checkpoints, str(stopped_at), "data", "process_0-of-1.json")) as f:
        assert json.load(f)["next_index"] == stopped_at
    assert not os.path.exists(os.path.join(workdir, workdir_lock.LOCK_FILE))

    # kill -9 while Orbax writes <step>.orbax-checkpoint-tmp* (renamed to <step> when complete).
    proc = subprocess.Popen(
        command(workdir, digits_dir),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline, during_write = time.time() + 300, False
    while proc.poll() is None and time.time() < deadline:
        names = os.listdir(checkpoints)
        if any(".orbax-checkpoint-tmp" in n for n in names):
            during_write = True
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert during_write, "no checkpoint write seen in progress"
    assert os.path.exists(os.path.join(workdir, workdir_lock.LOCK_FILE))  # left by the dead run

    rerun = subprocess.run(
        command(workdir, digits_dir), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "took over the lock" in rerun.stderr  # the dead run's lock is stale
    assert_same_params(workdir, reference)
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps == list(range(25, STEPS + 1, 25))  # each step once after the restarts
    assert tensorboard_steps(workdir, "train/loss") == train_steps
    assert not os.path.exists(os.path.join(workdir, workdir_lock.LOCK_FILE))


# ---- a loss that becomes NaN -----------------------------------------------------------------


def test_nan_loss_stops_naming_the_step_and_keeps_good_checkpoints(
    reference, digits_dir, env, tmp_path
):
    workdir = copy_run(reference, tmp_path)
    before = {
        name: digest(os.path.join(workdir, name)) for name in ("checkpoints", "checkpoints_best")
    }
    run = subprocess.run(
        command(
            workdir,
            digits_dir,
            "--config.learning_rate=1e12",
            f"--config.num_train_steps={STEPS + 100}",
            "--config.checkpoint_every=1",
        ),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 1
    message = last_line(run.stderr)
    assert message.startswith(
        "train.py: error: NonFiniteError: the loss or gradient norm became non-finite at step "
    ), message
    bad_step = int(message.split("at step ")[1].split(" ")[0])
    assert STEPS < bad_step <= STEPS + 100
    # A checkpoint every step: each step before the bad one was saved, finite; none after.
    assert max(steps_on_disk(workdir)) == bad_step - 1
    for step in steps_on_disk(workdir):
        _, saved = checkpoint.load(workdir, step=step)
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(saved)), step
    assert digest(os.path.join(workdir, "checkpoints_best")) == before["checkpoints_best"]


def test_guard_keeps_the_old_state_on_a_nonfinite_step():
    old = optim.TrainState(
        step=jnp.int32(3), params={"w": jnp.ones(2)}, opt_state={"m": jnp.zeros(2)}
    )
    new = optim.TrainState(
        step=jnp.int32(4), params={"w": jnp.full(2, jnp.nan)}, opt_state={"m": jnp.full(2, 5.0)}
    )
    guard = jax.jit(optim.guard_nonfinite, static_argnums=4)
    kept, flag = guard(old, new, jnp.float32(jnp.nan), jnp.float32(1.0), "skip")
    assert int(kept.step) == 4 and float(flag) == 1.0
    np.testing.assert_array_equal(kept.params["w"], np.ones(2))
    np.testing.assert_array_equal(kept.opt_state["m"], np.zeros(2))
    applied, flag = guard(old, new, jnp.float32(0.5), jnp.float32(np.inf), "skip")
    assert float(flag) == 1.0 and np.all(np.asarray(applied.params["w"]) == 1.0)
    applied, flag = guard(
        old, new.replace(params={"w": jnp.full(2, 7.0)}), jnp.float32(0.5), jnp.float32(2.0), "stop"
    )
    assert float(flag) == 0.0 and np.all(np.asarray(applied.params["w"]) == 7.0)


def test_skip_mode_counts_and_stops_after_too_many_in_a_row(digits_dir):
    watch = nonfinite.NonfiniteWatch(
        config_like_flags(digits_dir, nonfinite="skip", max_skipped_steps=3), start_step=10
    )
    watch.check(14, [0.0, 1.0, 1.0, 0.0])  # steps 11..14
    watch.check(14, [1.0, 1.0, 1.0, 1.0])  # already read: not counted again
    assert watch.skipped == 2 and watch.in_a_row == 0
    with pytest.raises(nonfinite.NonFiniteError, match=r"3 steps in a row up to step 17"):
        watch.check(17, [1.0, 1.0, 1.0])
    stop = nonfinite.NonfiniteWatch(config_like_flags(digits_dir), start_step=0)
    with pytest.raises(nonfinite.NonFiniteError, match=r"non-finite at step 2 "):
        stop.check(3, [0.0, 1.0, 1.0])
    for field, value in (("nonfinite", "ignore"), ("max_skipped_steps", 0)):
        with pytest.raises(ValueError, match=rf"config.{field}={value!r}"):
            nonfinite.check_config(config_like_flags(digits_dir, **{field: value}))


# ---- damaged checkpoints -----------------------------------------------------------------------


def test_damaged_latest_checkpoint_falls_back_to_the_newest_intact(
    reference, digits_dir, tmp_path, caplog
):
    workdir = copy_run(reference, tmp_path)
    assert steps_on_disk(workdir) == [STEPS - 25, STEPS]
    latest = os.path.join(workdir, "checkpoints", str(STEPS))
    sizes = {}
    for path in glob.glob(os.path.join(latest, "**"), recursive=True):
        if os.path.isfile(path):
            sizes[path] = os.path.getsize(path) // 2
            os.truncate(path, sizes[path])
    with caplog.at_level("WARNING"):
        result = train_and_evaluate(config_like_flags(digits_dir), workdir)
    assert f"checkpoint {STEPS} in" in caplog.text and "is damaged" in caplog.text
    aside = os.path.join(workdir, "checkpoints", f"damaged-{STEPS}")
    kept = {p.replace(latest, aside): os.path.getsize(p.replace(latest, aside)) for p in sizes}
    assert kept == {p.replace(latest, aside): n for p, n in sizes.items()}  # kept, not deleted
    assert result["step"] == STEPS and steps_on_disk(workdir) == [STEPS - 25, STEPS]
    assert_same_params(workdir, reference)  # retrained 25 steps from the intact one

    for step in steps_on_disk(workdir):
        for path in glob.glob(
            os.path.join(workdir, "checkpoints", str(step), "**", "*"), recursive=True
        ):
            if os.path.isfile(path):
                os.truncate(path, 0)
    with pytest.raises(
        checkpoint.checkpoint_integrity.DamagedCheckpointError,
        match=rf"no intact checkpoint in {workdir}/checkpoints: step\(s\) "
        rf"\[{STEPS}, {STEPS - 25}\]",
    ):
        train_and_evaluate(config_like_flags(digits_dir), workdir)
    assert params(workdir, best=True)  # the best checkpoint is untouched by all this


# ---- a full disk -------------------------------------------------------------------------------


def test_disk_full_while_saving_keeps_previous_checkpoints(reference, digits_dir, env, tmp_path):
    workdir = copy_run(reference, tmp_path)
    before = digest(os.path.join(workdir, "checkpoints"))
    # A real write failure: the kernel refuses to grow any file past 12 KiB (EFBIG, the
    # per-process sibling of ENOSPC; SIGXFSZ ignored, or it would kill the process instead).
    # This model's checkpoint files are 18-27 kB; the logs and lock stay under the limit, and
    # the compilation cache (whose entries are larger) is off.
    limited = "trap '' XFSZ; ulimit -f 12; exec \"$@\""
    train = command(workdir, digits_dir, f"--config.num_train_steps={STEPS + 30}")
    run = subprocess.run(
        ["bash", "-c", limited, "bash", *train],
        cwd=ROOT,
        env={k: v for k, v in env.items() if k != "JAX_COMPILATION_CACHE_DIR"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 1
    # Orbax's writer threads may still log the failed write's traceback after train.py's line.
    errors = [line for line in run.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1, run.stderr[-2000:]
    message = errors[0]
    expected = (
        rf"train.py: error: CheckpointWriteError: \[Errno 27\] could not write a "
        rf"checkpoint to {workdir}/checkpoints(_best)?: File too large \(errno EFBIG\); "
        rf"the checkpoints written before are intact; .*"
    )
    assert re.fullmatch(expected, message), message
    # The failed write stays in Orbax's temporary directory, which restore never reads.
    after = digest(os.path.join(workdir, "checkpoints"))
    partial = {k for k in after if ".orbax-checkpoint-tmp" in k}
    assert partial and {k: v for k, v in after.items() if k not in partial} == before
    assert steps_on_disk(workdir) == [STEPS - 25, STEPS]
    assert_same_params(workdir, reference)


# ---- one run per workdir ----------------------------------------------------------------------


def test_a_second_run_on_a_workdir_is_refused_naming_the_first(
    reference, digits_dir, tmp_path, caplog
):
    workdir = copy_run(reference, tmp_path)
    lock = os.path.join(workdir, workdir_lock.LOCK_FILE)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with open(lock, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": holder.pid, "token": "x"}, f)
        # A lock without renewal times (written by hand here) is as fresh as its file.
        expected = (
            re.escape(
                f"workdir {workdir!r} is in use by another run (host {socket.gethostname()}, "
                f"pid {holder.pid}, since an unknown time; its lock expires at "
            )
            + r"[-0-9: ]+"
            + re.escape(
                " UTC unless renewed); wait for it to finish, use another --workdir, or "
                f"delete {lock} if that run is gone."
            )
        )
        with pytest.raises(workdir_lock.WorkdirLockedError, match=expected):
            train_and_evaluate(config_like_flags(digits_dir), workdir)
    finally:
        holder.kill()
        holder.wait()

    # The holder is dead now: its lock is stale and taken over.
    with caplog.at_level("WARNING"):
        result = train_and_evaluate(config_like_flags(digits_dir), workdir)
    assert f"pid {holder.pid}" in caplog.text and "took over the lock" in caplog.text
    assert result["step"] == STEPS and not os.path.exists(lock)
    with open(lock, "w") as f:  # another host's renewed lock cannot be checked from here
        json.dump({"host": "elsewhere", "pid": 1, "token": "y"}, f)
    with pytest.raises(workdir_lock.WorkdirLockedError, match=r"host elsewhere, pid 1, since"):
        train_and_evaluate(config_like_flags(digits_dir), workdir)


# ---- a weights file with a malicious pickle ---------------------------------------------------


def test_a_pickle_that_runs_code_is_refused(tmp_path):
    import torch

    from attnjax.convert import common as convert_common

    marker = tmp_path / "pwned"

    class RunsCode:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    path = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2), "extra": RunsCode()}, path)
    with pytest.raises(
        pickle.UnpicklingError, match=r"(?s)Weights only load failed.*GLOBAL posix.system"
    ):
        convert_common.load_state_dict(str(path))
    assert not marker.exists()
