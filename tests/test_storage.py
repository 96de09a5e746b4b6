"""attnjax/storage.py on a local disk and in a bucket of a Cloud Storage server on localhost
(the ``gcs`` fixture), and a training run whose workdir is ``gs://``: stopped by SIGTERM, killed,
and resumed by jobs under new hostnames, ending with the parameters of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import flax
import numpy as np
import pytest
from helpers import ROOT, tiny_vit_flags

from attnjax import huge_pages, storage
from attnjax.train import checkpoint, preemption, workdir_lock


@pytest.fixture(params=["local", "gs"])
def where(request, tmp_path):
    """A new directory, on disk or in the bucket."""
    if request.param == "local":
        return str(tmp_path / "dir")
    request.getfixturevalue("gcs")
    return f"gs://test/{uuid.uuid4().hex}"


def test_a_whole_write_that_fails_leaves_the_old_file_and_no_part(tmp_path):
    """A file size limit of 4 KiB (EFBIG, a full disk's per-process sibling) on a real process."""
    target = tmp_path / "config.json"
    target.write_text("old")
    script = (
        "import resource, signal; from attnjax import storage; "
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
        f"storage.write_atomic({str(target)!r}, b'x' * 8192)"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 1 and "File too large" in run.stderr, run.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    assert target.read_text() == "old"


def test_whole_writes_appends_and_listings(where):
    storage.makedirs(where)
    config = storage.join(where, "config.json")
    storage.write_atomic(config, '{"a": 1}')
    storage.write_atomic(config, '{"a": 2}')
    assert json.loads(storage.read_text(config)) == {"a": 2}

    log = storage.join(where, "metrics.jsonl")
    with storage.AppendFile(log, binary=False) as f:
        f.write("1\n")
        f.flush()
        assert storage.read_text(log) == "1\n"  # in storage once flushed, before closing
        f.write("2\n")
    storage.append_text(log, "3\n")  # a later writer continues the file
    assert storage.read_text(log) == "1\n2\n3\n"

    assert storage.listdir(where) == ["config.json", "metrics.jsonl"]  # no private files left
    assert storage.isdir(where) and not storage.isdir(config) and storage.exists(log)
    assert abs(storage.modified_time(log) - time.time()) < 60
    storage.remove(log)
    assert not storage.exists(log) and storage.listdir(where) == ["config.json"]
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(log)


def test_an_exclusive_create_succeeds_once(where):
    storage.makedirs(where)
    lock = storage.join(where, "run.lock")
    assert storage.create_exclusive(lock, "first")
    assert not storage.create_exclusive(lock, "second")
    assert storage.read_text(lock) == "first"


def test_a_directory_is_renamed_whole(where):
    step = storage.join(where, "7")
    storage.makedirs(storage.join(step, "state"))
    storage.write_atomic(storage.join(step, "state", "a"), b"\x00\x01")
    storage.write_atomic(storage.join(step, "b"), b"b")
    aside = storage.join(where, "damaged-7")
    storage.rename(step, aside)
    assert storage.listdir(where) == ["damaged-7"]
    assert storage.read_bytes(storage.join(aside, "state", "a")) == b"\x00\x01"
    assert storage.read_bytes(storage.join(aside, "b")) == b"b"


def test_locations_are_absolute_on_disk_and_unchanged_in_a_bucket(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.absolute("runs/a") == str(tmp_path / "runs" / "a")
    assert storage.absolute("gs://b/runs/a") == "gs://b/runs/a"
    assert storage.join("gs://b/runs/", "a", "b") == "gs://b/runs/a/b"
    assert str(storage.path("gs://b/runs/a") / "x") == "gs://b/runs/a/x"


# Takes the lock of the workdir argv[1] at the wall time argv[2]: "won" (then holds it 3 s) or
# "refused <line>".
TAKES = """
import sys, time
from attnjax.train import workdir_lock
time.sleep(max(float(sys.argv[2]) - time.time(), 0.0))
try:
    lease = workdir_lock.acquire(sys.argv[1], {"lock_expiry_seconds": 30.0})
except workdir_lock.WorkdirLockedError as error:
    print("refused", error, flush=True)
    sys.exit(3)
print("won", flush=True)
time.sleep(3.0)
workdir_lock.release(sys.argv[1], lease)
"""


def test_two_jobs_creating_a_lock_in_a_bucket_at_once_one_wins(gcs, as_host):
    workdir = f"gs://test/{uuid.uuid4().hex}"
    start_at = time.time() + 3.0  # both past their imports, then at the same moment
    jobs = {
        host: subprocess.Popen(
            as_host(host, [sys.executable, "-c", TAKES, workdir, str(start_at)]),
            cwd=ROOT,
            env={**os.environ, **gcs},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host in ("job-a", "job-b")
    }
    results = {host: (*job.communicate(timeout=120), job.returncode) for host, job in jobs.items()}
    winners = [host for host, (out, _, _) in results.items() if out.startswith("won")]
    assert len(winners) == 1, results
    (loser,) = set(jobs) - set(winners)
    out, err, code = results[loser]
    assert code == 3 and f"is in use by another run (host {winners[0]}, pid " in out, err
    assert not storage.exists(storage.join(workdir, workdir_lock.LOCK_FILE))  # released


# ---- a training run in a bucket ---------------------------------------------------------------

STEPS = 60
FLAGS = [
    *tiny_vit_flags(),
    "--config.warmup_steps=5",
    f"--config.num_train_steps={STEPS}",
    "--config.log_every=10",
    "--config.eval_every=30",
    "--config.checkpoint_every=10",
    "--config.model.dropout_rate=0.1",
    "--config.data.crop_padding=1",  # random crops: the data stream's RNG must resume too
    "--config.lock_expiry_seconds=3",
]


def train_command(workdir, digits_dir):
    config = ["--config", "configs/vit_digits.py", f"--config.data.data_dir={digits_dir}"]
    return [sys.executable, "train.py", *config, "--workdir", workdir, *FLAGS]


def checkpoint_steps(workdir) -> list[int]:
    directory = storage.join(workdir, "checkpoints")
    if not storage.isdir(directory):
        return []
    return sorted(int(name) for name in storage.listdir(directory) if name.isdigit())


def wait_for_checkpoint_after(workdir, step: int, job) -> None:
    deadline = time.time() + 300
    while job.poll() is None and time.time() < deadline:
        if any(s > step for s in checkpoint_steps(workdir)):
            return
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint after step {step}: {job.poll()=}")


def flat_params(workdir):
    return flax.traverse_util.flatten_dict(checkpoint.load(workdir)[1], sep="/")


def test_a_bucket_run_stopped_killed_and_resumed_on_new_hosts_equals_an_unbroken_run(
    digits_dir, gcs, as_host, tmp_path
):
    reference = str(tmp_path / "reference")
    subprocess.run(
        train_command(reference, digits_dir), cwd=ROOT, check=True, capture_output=True, timeout=600
    )
    workdir = f"gs://test/{uuid.uuid4().hex}/run"
    env = {**os.environ, **gcs}

    def start(host, **streams):
        command = as_host(host, train_command(workdir, digits_dir))
        return subprocess.Popen(command, cwd=ROOT, env=env, text=True, **streams)

    # SIGTERM (the platform's notice): the run saves the step it is at and asks to be requeued.
    job = start("slice-a", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_checkpoint_after(workdir, 0, job)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=300)
    assert job.returncode == preemption.REQUEUE_EXIT_CODE, err[-2000:]
    stopped_at = int(err.strip().splitlines()[-1].split("after step ")[1].split(";")[0])
    assert checkpoint_steps(workdir)[-1] == stopped_at < STEPS
    assert not storage.exists(storage.join(workdir, workdir_lock.LOCK_FILE))

    # A hard preemption: the next job dies with its lock held and its heartbeat stopped.
    job = start("slice-b", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_checkpoint_after(workdir, stopped_at, job)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert job.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    held = json.loads(storage.read_text(storage.join(workdir, workdir_lock.LOCK_FILE)))
    assert held["host"] == "slice-b"

    # The recreated slice has other hostnames: its job takes the expired lock over and finishes.
    job = start("slice-c", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-2000:]
    assert "took over the lock" in err and "host slice-b" in err
    assert not storage.exists(storage.join(workdir, workdir_lock.LOCK_FILE))

    expected, got = flat_params(reference), flat_params(workdir)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():  # bit-identical: same programs, same inputs
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    records = [
        json.loads(line)
        for line in storage.read_text(storage.join(workdir, "metrics.jsonl")).splitlines()
    ]
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps == list(range(10, STEPS + 1, 10))  # each step once after the restarts
    starts = storage.read_text(storage.join(workdir, "environment.jsonl")).splitlines()
    assert [json.loads(line)["step"] for line in starts][0] == 0 and len(starts) == 3
    for line in starts:  # each train.py start restarted itself under huge pages where they help
        tunables = json.loads(line)["glibc_tunables"]
        assert ("glibc.malloc.hugetlb=1" in tunables) == huge_pages.available(), tunables
    names = storage.listdir(workdir)
    for name in ("config.json", "curves.png", "eval_images.png", "tensorboard"):
        assert name in names, names
    assert storage.read_bytes(storage.join(workdir, "curves.png")).startswith(b"\x89PNG")
