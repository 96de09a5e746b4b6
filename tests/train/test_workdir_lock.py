"""attnjax/train/workdir_lock.py: the workdir lock is a lease, in real processes under their own
hostnames (``unshare --uts``): refused while its owner on another host renews it, taken over
once the owner is killed and the lease has expired, and won by exactly one of two jobs taking
over the same expired lock."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import ROOT

from attnjax.train import workdir_lock

EXPIRY = 2.0  # seconds; renewed every EXPIRY / HEARTBEATS_PER_EXPIRY

# Takes the lock of argv[1] at the wall time argv[2], says "won" or "refused <line>", holds
# the lock argv[3] seconds and releases it.
TAKES = """
import sys, time
from attnjax.train import workdir_lock
workdir, start_at, hold = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
time.sleep(max(start_at - time.time(), 0.0))
try:
    lease = workdir_lock.acquire(workdir, {"lock_expiry_seconds": %r})
except workdir_lock.WorkdirLockedError as error:
    print("refused", error, flush=True)
    sys.exit(3)
print("won", flush=True)
time.sleep(hold)
workdir_lock.release(workdir, lease)
""" % (EXPIRY,)


@pytest.fixture
def start_on_host(as_host):
    """``start_on_host(host, workdir, start_at=, hold=)``: a process taking the lock under the
    hostname ``host``."""

    def start(host: str, workdir, *, start_at: float = 0.0, hold: float = 600.0):
        args = [str(workdir), str(start_at), str(hold)]
        return subprocess.Popen(
            as_host(host, [sys.executable, "-c", TAKES, *args]),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    return start


def read_lock(workdir) -> dict:
    with open(os.path.join(workdir, workdir_lock.LOCK_FILE)) as f:
        return json.load(f)


def test_a_live_owner_elsewhere_is_refused_and_a_killed_one_taken_over_after_expiry(
    tmp_path, start_on_host
):
    owner = start_on_host("old-slice", tmp_path)
    try:
        assert owner.stdout.readline().strip() == "won", owner.stderr.read()
        first = read_lock(tmp_path)
        assert first["host"] == "old-slice" and first["pid"] == owner.pid
        time.sleep(EXPIRY + 0.5)  # past the expiry: only the heartbeat keeps the lock
        renewed = read_lock(tmp_path)
        assert renewed["heartbeat"] > first["heartbeat"] and renewed["token"] == first["token"]
        with pytest.raises(workdir_lock.WorkdirLockedError) as refused:
            workdir_lock.acquire(str(tmp_path), {"lock_expiry_seconds": EXPIRY})
        line = str(refused.value)
        assert "\n" not in line
        assert f"is in use by another run (host old-slice, pid {owner.pid}, since " in line
        assert "; its lock expires at " in line and " UTC unless renewed)" in line
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()

    # Its heartbeat stops with it; once the lease has expired, a job on a new host takes over.
    silent_until = read_lock(tmp_path)["heartbeat"] + EXPIRY
    time.sleep(max(silent_until - time.time(), 0.0) + 0.2)
    successor = start_on_host("new-slice", tmp_path, hold=0.0)
    out, err = successor.communicate(timeout=60)
    assert successor.returncode == 0 and out.strip() == "won", err
    assert "took over the lock" in err and f"host old-slice, pid {owner.pid}: no heartbeat" in err
    assert not os.path.exists(os.path.join(tmp_path, workdir_lock.LOCK_FILE))  # released


def test_two_jobs_taking_over_one_expired_lock_exactly_one_wins(tmp_path, start_on_host):
    expired = time.time() - 10 * EXPIRY
    with open(os.path.join(tmp_path, workdir_lock.LOCK_FILE), "w") as f:
        record = {"host": "dead-slice", "pid": 1, "token": "gone", "expiry_seconds": EXPIRY}
        json.dump({**record, "since": expired, "heartbeat": expired}, f)
    start_at = time.time() + 1.0  # both past their start-up, then at the same moment
    racers = {
        host: start_on_host(host, tmp_path, start_at=start_at, hold=2.0)
        for host in ("racer-a", "racer-b")
    }
    results = {
        host: (proc.communicate(timeout=60), proc.returncode) for host, proc in racers.items()
    }
    winners = [host for host, ((out, _), code) in results.items() if out.startswith("won")]
    assert len(winners) == 1, results
    (loser,) = set(racers) - set(winners)
    (out, err), code = results[loser]
    assert code == 3 and f"(host {winners[0]}, pid {racers[winners[0]].pid}, since" in out, err


def test_an_unreadable_lock_is_held_until_it_expires(tmp_path, monkeypatch):
    monkeypatch.setattr(workdir_lock, "UNREADABLE_GRACE_SECONDS", 0.3)
    lock = os.path.join(tmp_path, workdir_lock.LOCK_FILE)
    open(lock, "w").close()  # as a writer leaves it between its create and its write
    config = {"lock_expiry_seconds": 60.0}
    with pytest.raises(workdir_lock.WorkdirLockedError, match="is unreadable; it is taken over"):
        workdir_lock.acquire(str(tmp_path), config)
    old = time.time() - 61.0
    os.utime(lock, (old, old))  # its writer died long ago
    lease = workdir_lock.acquire(str(tmp_path), config)
    assert read_lock(tmp_path)["host"] == socket.gethostname()
    workdir_lock.release(str(tmp_path), lease)
    assert not os.path.exists(lock)


@pytest.mark.parametrize("value", [0, -1.0, "60", True])
def test_a_lock_expiry_that_is_not_a_positive_number_is_refused(tmp_path, value):
    with pytest.raises(ValueError, match=rf"config.lock_expiry_seconds={value!r} must be"):
        workdir_lock.acquire(str(tmp_path / "run"), {"lock_expiry_seconds": value})
    assert not os.path.exists(tmp_path / "run")  # refused before touching the workdir
