"""One training run per workdir: ``<workdir>/run.lock`` names the host and pid that own it.

Two runs writing the same checkpoints and metrics would interleave them silently, so the
second is refused with one line naming the first. A lock left by a run that died without
cleaning up (``kill -9``, a crashed machine) is taken over, with a warning, when its pid no
longer lives on this host; a lock held from another host cannot be checked from here and is
refused, with the path to delete once that run is known to be gone. A lock of this very
process (an earlier ``train_and_evaluate`` call in it that failed) is taken over too.
"""

from __future__ import annotations

import json
import os
import socket
import uuid

from absl import logging

LOCK_FILE = "run.lock"


class WorkdirLockedError(RuntimeError):
    """Another live run owns the workdir."""


def _read_owner(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _try_create(path: str, owner: dict) -> bool:
    # Written in full under a private name, then hard-linked into place: the link is atomic
    # and fails if the lock exists, so no run ever reads a half-written lock.
    private = f"{path}.{owner['token']}"
    with open(private, "w") as f:
        json.dump(owner, f)
    try:
        os.link(private, path)
    except FileExistsError:
        return False
    finally:
        os.remove(private)
    return True


def acquire(workdir: str) -> dict:
    """Creates the lock -> the owner record written; raises ``WorkdirLockedError`` if taken."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise NotADirectoryError(
            f"--workdir {workdir!r} is a file; expected a directory (new or of an earlier run)."
        )
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, LOCK_FILE)
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex}
    for _ in range(3):
        if _try_create(path, owner):
            return owner
        other = _read_owner(path)
        if other is None:
            continue  # released between our create and read
        host, pid = other.get("host"), other.get("pid")
        # This process's own pid: a lock left by an earlier call that failed before releasing.
        stale = (
            host == owner["host"]
            and isinstance(pid, int)
            and (pid == owner["pid"] or not _pid_alive(pid))
        )
        if not stale:
            raise WorkdirLockedError(
                f"workdir {workdir!r} is in use by another run (host {host}, pid {pid}); wait "
                f"for it to finish, use another --workdir, or delete {path} if that run is gone."
            )
        # Renaming is atomic: of several runs taking over the same stale lock, one wins.
        aside = f"{path}.stale-{owner['token']}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        os.remove(aside)
        logging.warning(
            "took over the lock of %s from a run that is gone (host %s, pid %s)", workdir, host, pid
        )
    raise WorkdirLockedError(f"workdir {workdir!r}: could not create {path} after 3 tries.")


def release(workdir: str, owner: dict | None) -> None:
    """Removes the lock if it is still ``owner``'s (None: this process holds none)."""
    path = os.path.join(workdir, LOCK_FILE)
    if owner is not None and _read_owner(path) == owner:
        os.remove(path)
