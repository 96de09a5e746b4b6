"""Resuming a checkpoint on another number of processes, over any number of devices.

The train stream is one global sequence of batches whatever the process count
(``attnjax.data.pipeline.process_batches``): process ``p`` of ``n`` reads its rows of global
batch ``t``. The iterator state each process checkpoints (``data/process_<p>-of-<n>.json``),
``{"next_index": t}``, is therefore the same on every process: it is the global position. A
run on ``m`` processes sets each of its iterators to that position, whatever ``n`` was; the
model state restores onto any mesh already (Orbax reshards it).

One layout cannot be resumed elsewhere: a data pipeline with worker processes
(``config.data.worker_count > 0``) checkpoints per-worker states, not a position; it resumes on
the process count that saved it, and a run without worker processes resumes it from the
position its states stand for only where they are positions.
"""

from __future__ import annotations

import json
import re

from etils import epath

POSITION_KEY = "next_index"
_PROCESS_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


class CheckpointLayoutError(ValueError):
    """An intact checkpoint that this run's layout (its processes, its data pipeline) cannot
    resume: never taken for damage, never moved aside."""


def position(iterator_state) -> int | None:
    """The global position ``iterator_state`` stands for, or None where it is no position (a
    pipeline with worker processes)."""
    if isinstance(iterator_state, dict) and set(iterator_state) == {POSITION_KEY}:
        value = iterator_state[POSITION_KEY]
        if isinstance(value, int) and value >= 0:
            return value
    return None


def iterator_state(global_position: int) -> dict:
    """What a process's iterator is set to so that its next batch is its rows of global batch
    ``global_position``."""
    return {POSITION_KEY: int(global_position)}


def saved_iterator_states(data_dir) -> list:
    """The iterator states a checkpoint's ``data`` item holds, by process index.

    A set of files that does not cover processes ``0 .. n - 1`` of one count ``n`` is damage
    (``ValueError``), as an unreadable file is."""
    data_dir = epath.Path(data_dir)
    found = {}
    for path in data_dir.iterdir():
        match = _PROCESS_FILE.fullmatch(path.name)
        if match:
            found[int(match.group(1))] = (int(match.group(2)), path)
    counts = {count for count, _ in found.values()}
    if len(counts) != 1 or sorted(found) != list(range(counts.pop())):
        raise ValueError(
            f"{data_dir} holds iterator states {sorted(p.name for _, p in found.values())}; "
            f"expected process_<i>-of-<n>.json for every i in 0 .. n-1"
        )
    return [json.loads(found[index][1].read_text()) for index in sorted(found)]


def saved_position(states: list) -> int | None:
    """The global position every process's saved state agrees on, or None."""
    positions = {position(state) for state in states}
    return positions.pop() if len(positions) == 1 else None


def layout_error(directory, step: int, states: list, process_count: int, current_state):
    """The one-line error for a checkpoint this run cannot resume (it is not damaged)."""
    at = saved_position(states)
    saved = (
        f"global position {at}"
        if at is not None
        else "per-worker iterator states (config.data.worker_count > 0)"
    )
    current = (
        "iterators with worker processes (config.data.worker_count > 0)"
        if position(current_state) is None
        else "plain iterators"
    )
    return CheckpointLayoutError(
        f"checkpoint {step} in {directory} is intact but was saved by {len(states)} process(es) "
        f"with {saved}; this run has {process_count} process(es) with {current}, which take "
        f"only the states of as many processes: rerun on {len(states)} process(es), or with "
        f"--config.data.worker_count=0 where the checkpoint holds a global position"
    )
