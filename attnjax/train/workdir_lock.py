"""One training run per workdir: ``<workdir>/run.lock`` is a lease that its owner renews.

Two runs writing the same checkpoints and metrics would interleave them silently, so the second
is refused with one line naming the first: its host, pid, since when it holds the workdir and
when its lease expires. The owner (process 0 of a run) rewrites the lock's ``heartbeat`` time
every ``expiry / HEARTBEATS_PER_EXPIRY`` seconds from a daemon thread, until the run ends,
fails or is preempted. A lock is taken over, with a warning naming its owner, when

* its heartbeat is older than its expiry (``config.lock_expiry_seconds``, recorded in the lock),
  whatever its host: a slice recreated after a hard preemption has new hostnames, and its
  restarted job resumes without anyone deleting the lock;
* its pid no longer lives on this host, or is this very process (an earlier
  ``train_and_evaluate`` call in it that failed before releasing): no need to wait.

A run that finds a lock silent for half its expiry (its owner missed beats) waits out the rest
and looks again, so that a job restarted moments after its predecessor died still starts.
Hosts' clocks are assumed to agree to well within the expiry (NTP does).

Atomicity without hard links (Cloud Storage FUSE has none), on a disk or in a bucket
(``attnjax.storage``): the lock is created with an exclusive create (``O_CREAT | O_EXCL`` on a
disk, its JSON written and fsynced in the same call, so a reader can meet an empty or partial
lock; it counts as held while it is young and is read again for ``UNREADABLE_GRACE_SECONDS``,
and only taken over once older than the expiry: a writer that died mid-write). Renewals and
takeovers replace the lock whole (a private file renamed over it on a disk, one object write in
a bucket), so readers see the old record or the new one. Several jobs taking over one expired
lock, or creating one in a bucket whose create-only precondition may go unchecked, each write
theirs and read the lock again ``SETTLE_SECONDS`` later: only the last one written is found, so
exactly one wins and the others are refused by its fresh lease.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from absl import logging

from attnjax import storage

LOCK_FILE = "run.lock"
DEFAULT_EXPIRY_SECONDS = 120.0
# Three beats may be missed (a slow write, a pause) before a live run loses its workdir.
HEARTBEATS_PER_EXPIRY = 4
UNREADABLE_GRACE_SECONDS = 2.0
# Far longer than a takeover's read-to-rename: a competitor that read the expired lock has
# renamed its own in by then.
SETTLE_SECONDS = 0.5
_TRIES = 4


class WorkdirLockedError(RuntimeError):
    """Another live run owns the workdir."""


def expiry_seconds(config=None) -> float:
    """``config.lock_expiry_seconds`` (default ``DEFAULT_EXPIRY_SECONDS``), checked."""
    value = DEFAULT_EXPIRY_SECONDS if config is None else config.get("lock_expiry_seconds", None)
    value = DEFAULT_EXPIRY_SECONDS if value is None else value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(
            f"config.lock_expiry_seconds={value!r} must be a positive number of seconds "
            f"(default {DEFAULT_EXPIRY_SECONDS}), how long a silent run's lock holds its workdir."
        )
    return float(value)


def _read(path: str) -> dict | None:
    """The lock's record; None: no lock; ``{}``: a lock being written, or damaged."""
    try:
        record = json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _read_settled(path: str) -> dict | None:
    """``_read``, waiting up to ``UNREADABLE_GRACE_SECONDS`` for a lock being written."""
    deadline = time.monotonic() + UNREADABLE_GRACE_SECONDS
    record = _read(path)
    while record == {} and time.monotonic() < deadline:
        time.sleep(0.05)
        record = _read(path)
    return record


def _create(path: str, record: dict) -> bool:
    """Whether the lock was created with ``record``. Where the store's create-only write may not
    be checked (object storage), the lock is read back after ``SETTLE_SECONDS``: of several jobs
    creating it at once, the last write is the one found, and the others step back."""
    if not storage.create_exclusive(path, json.dumps(record)):
        return False
    if not storage.is_remote(path):
        return True
    time.sleep(SETTLE_SECONDS)
    return (_read(path) or {}).get("token") == record["token"]


def _replace(path: str, record: dict) -> None:
    storage.write_atomic(path, json.dumps(record))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def _heartbeat(record: dict, path: str) -> float:
    """The owner's last renewal; an unreadable lock's modification time stands in."""
    beat = record.get("heartbeat")
    if isinstance(beat, (int, float)) and not isinstance(beat, bool):
        return float(beat)
    try:
        return storage.modified_time(path)
    except FileNotFoundError:
        return 0.0


def _expiry(record: dict, default: float) -> float:
    # The owner's own expiry: it renews at its pace, whatever this run's config says.
    value = record.get("expiry_seconds")
    return float(value) if isinstance(value, (int, float)) and value > 0 else default


def _stale(other: dict, me: dict, path: str) -> str | None:
    """Why ``other``'s lock may be taken over now, or None while its owner may live."""
    host, pid = other.get("host"), other.get("pid")
    if host == me["host"] and isinstance(pid, int):
        if pid == me["pid"]:
            return "an earlier run in this process"
        if not _pid_alive(pid):
            return "its pid is gone"
    silent = time.time() - _heartbeat(other, path)
    if silent > _expiry(other, me["expiry_seconds"]):
        return f"no heartbeat for {silent:.0f} s"
    return None


def _take_over(path: str, stale: dict, record: dict) -> bool:
    """Renames ``record`` over ``stale``'s lock -> whether it is still ours once settled."""
    current = _read(path)
    if current is None or current.get("token") != stale.get("token"):
        return False  # another run took it over or released it first
    _replace(path, record)
    time.sleep(SETTLE_SECONDS)
    return (_read(path) or {}).get("token") == record["token"]


def _held_line(workdir: str, path: str, other: dict, expiry: float) -> str:
    if not other:
        return (
            f"workdir {workdir!r} is held by a run whose lock {path} is unreadable; it is taken "
            f"over {expiry:.0f} s after its last change, or delete it if that run is gone."
        )
    since = other.get("since")
    since = _when(since) if isinstance(since, (int, float)) else "an unknown time"
    expires = _when(_heartbeat(other, path) + _expiry(other, expiry))
    return (
        f"workdir {workdir!r} is in use by another run (host {other.get('host')}, pid "
        f"{other.get('pid')}, since {since}; its lock expires at {expires} unless renewed); "
        f"wait for it to finish, use another --workdir, or delete {path} if that run is gone."
    )


class Lease:
    """This process's hold on a workdir: the record it wrote, renewed by a daemon thread until
    ``stop()``."""

    def __init__(self, path: str, record: dict):
        self.path = path
        self.record = record
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="workdir-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        interval = self.record["expiry_seconds"] / HEARTBEATS_PER_EXPIRY
        while not self._stopped.wait(interval):
            current = _read(self.path)
            if current == {}:
                continue  # mid-write on a file system without atomic renames: next beat
            if current is None or current.get("token") != self.record["token"]:
                logging.error(
                    "the lock %s was taken over by host %s, pid %s: this run was silent past "
                    "its expiry and no longer owns its workdir",
                    self.path,
                    (current or {}).get("host"),
                    (current or {}).get("pid"),
                )
                return
            self.record = {**self.record, "heartbeat": time.time()}
            try:
                _replace(self.path, self.record)
            except OSError as error:  # a full disk or a storage hiccup: the next beat may pass
                logging.warning("could not renew the lock %s: %s", self.path, error)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def acquire(workdir: str, config=None) -> Lease:
    """Creates the lock and starts renewing it -> the lease; raises ``WorkdirLockedError`` if
    another live run holds it."""
    expiry = expiry_seconds(config)
    if storage.exists(workdir) and not storage.isdir(workdir):
        raise NotADirectoryError(
            f"--workdir {workdir!r} is a file; expected a directory (new or of an earlier run)."
        )
    storage.makedirs(workdir)
    path = storage.join(workdir, LOCK_FILE)
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "token": uuid.uuid4().hex,
        "expiry_seconds": expiry,
    }
    for _ in range(_TRIES):
        record["since"] = record["heartbeat"] = time.time()
        if _create(path, record):
            return Lease(path, record)
        other = _read_settled(path)
        if other is None:
            continue  # released between our create and read
        reason = _stale(other, record, path)
        if reason is None:
            silent = time.time() - _heartbeat(other, path)
            others_expiry = _expiry(other, expiry)
            if silent <= others_expiry / 2:
                raise WorkdirLockedError(_held_line(workdir, path, other, expiry))
            wait = others_expiry - silent
            logging.warning(
                "the lock of %s (host %s, pid %s) has had no heartbeat for %.0f s; waiting "
                "%.0f s for it to expire",
                workdir,
                other.get("host"),
                other.get("pid"),
                silent,
                wait,
            )
            time.sleep(max(wait, 0.0) + 0.1)
            continue
        record["since"] = record["heartbeat"] = time.time()
        if _take_over(path, other, record):
            logging.warning(
                "took over the lock of %s from a run that is gone (host %s, pid %s: %s)",
                workdir,
                other.get("host"),
                other.get("pid"),
                reason,
            )
            return Lease(path, record)
    raise WorkdirLockedError(
        f"workdir {workdir!r}: could not take {path} in {_TRIES} tries; other runs are taking "
        "it and letting it go at the same time."
    )


def release(workdir: str, lease: Lease | None) -> None:
    """Stops renewing and removes the lock if it is still ``lease``'s (None: this process holds
    none)."""
    if lease is None:
        return
    lease.stop()
    path = storage.join(workdir, LOCK_FILE)
    if (_read(path) or {}).get("token") == lease.record["token"]:
        storage.remove(path)
