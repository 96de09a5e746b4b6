"""A run's files on a local disk or in a Cloud Storage bucket (``gs://``), through one path
type: ``etils.epath`` (what Orbax reads and writes checkpoints with).

Locations are strings everywhere in attnjax: a local path, made absolute, or a bucket URL kept
as it is. Object stores differ from a disk in three ways that matter to a run, and each function
here hides one:

* no rename: a whole-object write is atomic (readers see the old object or the new one), so
  ``write_atomic`` writes in place there and through a private file plus ``os.replace`` on disk;
* no append: ``AppendFile`` keeps the file's bytes and writes the whole object on each
  ``flush`` (what TensorFlow's GCS writer does), so a line reaches storage before ``flush``
  returns;
* no exclusive open: ``create_exclusive`` sends the create-only precondition
  (``ifGenerationMatch=0`` on GCS) and callers that must be sure a write of theirs won read the
  object back (``attnjax.train.workdir_lock``).

Credentials and endpoints are the storage clients' own: ``gcsfs`` for files (Application
Default Credentials; ``STORAGE_EMULATOR_HOST`` for an emulator) and TensorStore for Orbax's
arrays (``TENSORSTORE_GCS_HTTP_URL``, ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` for one).
"""

from __future__ import annotations

import contextlib
import os
import uuid

from etils import epath

REMOTE_SCHEMES = ("gs://",)


def is_remote(location) -> bool:
    """Whether ``location`` is in object storage."""
    return os.fspath(location).startswith(REMOTE_SCHEMES)


def absolute(location) -> str:
    """``location`` as attnjax keeps it: absolute when local, unchanged when remote."""
    location = os.fspath(location)
    return location if is_remote(location) else os.path.abspath(os.path.expanduser(location))


def path(location) -> epath.Path:
    return epath.Path(absolute(location))


def join(location, *names: str) -> str:
    location = os.fspath(location)
    if is_remote(location):
        return "/".join([location.rstrip("/"), *names])
    return os.path.join(location, *names)


def _bucket(location):
    """``(filesystem, key)`` of a remote ``location``, its listings cache emptied: another
    process (a host of the same run, the next job) may have written there since this one
    looked."""
    import fsspec  # etils' own dependency for buckets

    filesystem, key = fsspec.core.url_to_fs(os.fspath(location))
    filesystem.invalidate_cache(key)
    return filesystem, key


def exists(location) -> bool:
    if is_remote(location):
        filesystem, key = _bucket(location)
        return filesystem.exists(key)
    return os.path.exists(location)


def isdir(location) -> bool:
    if is_remote(location):
        filesystem, key = _bucket(location)
        return filesystem.isdir(key)
    return os.path.isdir(location)


def makedirs(location) -> None:
    """Creates the directory (a no-op in object storage, where prefixes need no creating)."""
    if not is_remote(location):
        os.makedirs(location, exist_ok=True)


def listdir(location) -> list[str]:
    if is_remote(location):
        filesystem, key = _bucket(location)
        return sorted(os.path.basename(p.rstrip("/")) for p in filesystem.ls(key, detail=False))
    return sorted(os.listdir(location))


def read_bytes(location) -> bytes:
    """Raises ``FileNotFoundError`` where there is no such file, local or remote."""
    if is_remote(location):
        return path(location).read_bytes()
    with open(location, "rb") as f:
        return f.read()


def read_text(location) -> str:
    return read_bytes(location).decode()


def write_atomic(location, data: bytes | str) -> None:
    """Writes the whole file so that a reader, or a run killed meanwhile, sees the old content
    or the new, never a part; a write that fails (a full disk) raises and leaves no part."""
    data = data.encode() if isinstance(data, str) else data
    if is_remote(location):
        path(location).write_bytes(data)
        return
    private = f"{location}.{uuid.uuid4().hex}.tmp"  # unique across hosts sharing the disk
    try:
        with open(private, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(private, location)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(private)
        raise


def create_exclusive(location, data: bytes | str) -> bool:
    """Creates the file with ``data`` unless it exists -> whether this call created it.

    On a disk the create is ``O_EXCL`` and ``data`` is fsynced before it returns (a reader may
    meet the file still empty). In object storage the object appears whole, and the create-only
    precondition makes it exclusive where the store checks it (GCS does; not every emulator)."""
    data = data.encode() if isinstance(data, str) else data
    if is_remote(location):
        filesystem, key = _bucket(location)  # epath.Path offers no exclusive mode
        if filesystem.exists(key):
            return False
        try:
            with filesystem.open(key, "xb") as f:
                f.write(data)
        except FileExistsError:
            return False
        return True
    try:
        fd = os.open(location, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return True


def remove(location) -> None:
    if is_remote(location):
        path(location).unlink()
    else:
        os.remove(location)


def rename(source, target) -> None:
    """Moves a file or a directory (in object storage: a copy of each object, then a delete)."""
    if is_remote(source):
        # Copy and delete, the move every GCS-protocol server has (gcsfs's own rename tries the
        # newer move API first and, where it is missing, retries it for half a minute).
        filesystem, key = _bucket(source)
        _, target_key = _bucket(target)
        filesystem.copy(key, target_key, recursive=filesystem.isdir(key))
        filesystem.rm(key, recursive=True)
    else:
        os.rename(source, target)


def modified_time(location) -> float:
    """Seconds since the epoch of the last write; raises ``FileNotFoundError``."""
    if is_remote(location):
        filesystem, key = _bucket(location)
        return filesystem.modified(key).timestamp()
    return os.path.getmtime(location)


class AppendFile:
    """A file that grows by ``write`` and reaches storage on each ``flush``.

    On a disk an ordinary file opened for appending. In object storage the file's bytes (those
    it held when opened, then each write) stay in memory and ``flush`` rewrites the object: one
    writer per file, as the run's process 0 is for its logs."""

    def __init__(self, location, binary: bool = True):
        self.location, self.binary = os.fspath(location), binary
        self._remote = is_remote(self.location)
        if self._remote:
            self._content = bytearray(read_bytes(location) if exists(location) else b"")
            self._dirty = False
        else:
            self._file = open(self.location, "ab" if binary else "a")

    def write(self, data: bytes | str) -> None:
        if not self._remote:
            self._file.write(data)
            return
        self._content += data.encode() if isinstance(data, str) else data
        self._dirty = True

    def flush(self) -> None:
        if not self._remote:
            self._file.flush()
        elif self._dirty:
            path(self.location).write_bytes(bytes(self._content))
            self._dirty = False

    def close(self) -> None:
        self.flush()
        if not self._remote:
            self._file.close()

    def __enter__(self) -> "AppendFile":
        return self

    def __exit__(self, *_) -> None:
        self.close()


def append_text(location, text: str) -> None:
    """Adds ``text`` at the end of the file (creating it)."""
    with AppendFile(location, binary=False) as f:
        f.write(text)
