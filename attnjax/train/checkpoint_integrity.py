"""What a run does with damaged checkpoints and failed checkpoint writes.

Orbax writes a checkpoint under ``<step>.orbax-checkpoint-tmp`` and renames it to ``<step>``
only once complete, so a crash mid-write leaves a temporary directory that restore never
sees. Files damaged later (a truncated copy, a full disk during an rsync) only show when
restored; then the newest checkpoint that restores, with finite values, is used instead, and
each damaged one is moved to ``damaged-<step>`` beside it (kept for inspection, never
deleted; Orbax ignores names that are not step numbers).
"""

from __future__ import annotations

import contextlib
import errno
import logging as std_logging
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from attnjax import storage
from attnjax.parallel.elastic import CheckpointLayoutError

DAMAGED_PREFIX = "damaged-"
# OS errors that mean "the disk (or the process's file size limit) is full".
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# Orbax's writer (TensorStore) reports the OS error inside a ValueError's message; nested in
# another error's repr, its quotes come escaped.
_TENSORSTORE_ERRNO = re.compile(r"os_error_code=\\?'(\d+)")


class DamagedCheckpointError(RuntimeError):
    """No checkpoint of the workdir could be restored."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the ones written before are intact."""


def _all_finite(tree) -> bool:
    """Whether every float of ``tree`` is finite. Arrays split over several processes are
    checked by one jitted reduction that every process runs (no process can read the others'
    shards), so all of them reach the same verdict."""
    split = []
    for x in jax.tree.leaves(tree):
        if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            continue
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            split.append(x)
        elif not np.isfinite(np.asarray(x)).all():
            return False
    if not split:
        return True
    whole = jax.sharding.NamedSharding(split[0].sharding.mesh, jax.sharding.PartitionSpec())
    finite = jax.jit(
        lambda xs: jnp.stack([jnp.isfinite(x).all() for x in xs]).all(), out_shardings=whole
    )(split)
    return bool(finite)


def move_aside(directory: str, step: int) -> str:
    """Renames ``directory/<step>`` to ``directory/damaged-<step>`` (``-2``, ... if taken)."""
    target = storage.join(directory, f"{DAMAGED_PREFIX}{step}")
    suffix = 1
    while storage.exists(target):
        suffix += 1
        target = storage.join(directory, f"{DAMAGED_PREFIX}{step}-{suffix}")
    storage.rename(storage.join(directory, str(step)), target)
    return target


def restore_newest_intact(
    directory: str,
    steps: list[int],
    restore: Callable[[int], Any],
    on_moved: Callable[[], None] = lambda: None,
):
    """``restore(step) -> state`` of the newest of ``steps`` that restores with finite values
    -> ``(step, state)``; damaged ones are moved aside with a warning
    and ``on_moved()`` called (to rescan the directory). Raises ``DamagedCheckpointError``
    (one line naming the directory and steps) when none is intact; a
    ``CheckpointLayoutError`` from ``restore`` passes unchanged (the checkpoint is healthy)."""
    damaged = []
    for step in sorted(steps, reverse=True):
        try:
            state = restore(step)
            if not _all_finite(state):
                raise ValueError("non-finite values")
        except CheckpointLayoutError:
            raise
        except Exception as error:  # any failure to read a step means that step is unusable
            reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
            if jax.process_index() == 0:
                aside = move_aside(directory, step)
                on_moved()
                logging.warning(
                    "checkpoint %d in %s is damaged (%s: %s); moved to %s, trying the one before",
                    step,
                    directory,
                    type(error).__name__,
                    reason,
                    aside,
                )
            damaged.append(step)
            continue
        if damaged:
            logging.warning(
                "resuming from step %d: the newer checkpoint(s) %s were damaged", step, damaged
            )
        return step, state
    raise DamagedCheckpointError(
        f"no intact checkpoint in {directory}: step(s) {damaged} could not be restored (moved "
        f"to {DAMAGED_PREFIX}<step> for inspection); start a new --workdir, or move one back."
    )


def disk_full_errno(error: BaseException) -> int | None:
    """The disk-full errno behind ``error`` (its causes included), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
            return error.errno
        match = _TENSORSTORE_ERRNO.search(str(error))
        if match and int(match.group(1)) in DISK_FULL_ERRNOS:
            return int(match.group(1))
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def disk_full_as_write_error(directory: str):
    """Re-raises a disk-full failure inside the block as one readable ``CheckpointWriteError``
    naming ``directory``; other errors pass unchanged.

    An asynchronous checkpoint write that failed may surface in any later Orbax call (the next
    save, the final wait, a restore), so every such call is wrapped, not only the save."""
    try:
        yield
    except Exception as error:
        code = disk_full_errno(error)
        if code is None:
            raise
        raise write_error(code, directory) from error


def write_error(code: int, directory: str) -> CheckpointWriteError:
    """The one-line error for a disk-full ``code`` while writing into ``directory``."""
    who = f"process {jax.process_index()} " if jax.process_count() > 1 else ""
    return CheckpointWriteError(
        code,
        f"{who}could not write a checkpoint to {directory}: {os.strerror(code)} (errno "
        f"{errno.errorcode[code]}); the checkpoints written before are intact; free space "
        f"(or raise the file size limit) and rerun the same command",
    )


class _BackgroundWriteFailures(std_logging.Handler):
    """Hands a disk-full error that a background thread logged (with its exception) to
    ``on_failure`` as a ``CheckpointWriteError`` naming the one of ``directories`` it wrote to."""

    def __init__(self, directories: list[str], on_failure: Callable[[BaseException], None]):
        super().__init__(level=std_logging.ERROR)
        self.directories, self.on_failure = directories, on_failure

    def emit(self, record: std_logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        code = None if error is None else disk_full_errno(error)
        if code is None:
            return
        text = f"{record.getMessage()} {error}"
        # The longest match: "checkpoints_best" also contains "checkpoints".
        named = [d for d in self.directories if d in text]
        self.on_failure(write_error(code, max(named or self.directories[:1], key=len)))


@contextlib.contextmanager
def background_write_failures(directories: list[str], on_failure):
    """Within the block, a disk-full failure of an asynchronous checkpoint write is handed to
    ``on_failure`` as soon as Orbax's writer thread logs it.

    With several processes the main thread would not learn of it: its next call into Orbax
    waits for the failed write's end-of-save barrier, which the other processes (waiting for
    this one's part) never pass."""
    handler = _BackgroundWriteFailures(directories, on_failure)
    logger = std_logging.getLogger("absl")  # absl logging, which Orbax writes through
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
