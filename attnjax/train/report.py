"""What a person sees of a run: metrics.jsonl, TensorBoard events, an eval table, PNG curves."""

from __future__ import annotations

import datetime
import json

from attnjax import compat, huge_pages, storage, xla_cpu
from attnjax.data import images
from attnjax.ops.platform import processor
from attnjax.train import events


class MetricWriter:
    """Appends one JSON object per event to ``workdir/metrics.jsonl`` and mirrors the scalars
    to TensorBoard (``workdir/tensorboard``). Only process 0 writes.

    ``resume_step``: the step the run restarts from. Records after it were written by a run
    that stopped before its next checkpoint and will be written again, so they are dropped
    from metrics.jsonl, and TensorBoard is told to purge them (its ``purge_step``): each step
    shows once after any number of restarts."""

    def __init__(self, workdir: str, enabled: bool = True, resume_step: int = 0):
        self.enabled = enabled
        self.path = storage.join(workdir, "metrics.jsonl")
        self._tb = self._file = None
        if enabled:
            _truncate_after(self.path, resume_step)
            self._file = storage.AppendFile(self.path, binary=False)
            # Also on a fresh start: a run killed before its first checkpoint left events.
            self._tb = events.EventFileWriter(
                storage.join(workdir, "tensorboard"), purge_step=resume_step + 1
            )

    def write(self, step: int, scalars: dict) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a run killed later keeps what it logged
        self._tb.write(int(step), scalars)

    def close(self) -> None:
        if self._tb is not None:
            self._file.close()
            self._tb.close()


def _truncate_after(path: str, step: int) -> None:
    """Drops the records of ``path`` after ``step`` (and a last line cut short by a kill)."""
    if not storage.exists(path):
        return
    kept = []
    for line in storage.read_text(path).splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("step", 0) <= step:
            kept.append(line + "\n")
    storage.write_atomic(path, "".join(kept))


def read_metrics(workdir: str) -> list[dict]:
    """The events of ``workdir/metrics.jsonl`` in step order, one per step and kind.

    A run resumed from a checkpoint repeats the steps after that checkpoint; for each step the
    last record of each kind (``train/*`` log, ``eval/*`` results) is kept.
    """
    path = storage.join(workdir, "metrics.jsonl")
    if not storage.exists(path):
        return []
    latest: dict = {}
    for line in storage.read_text(path).splitlines():
        if line.strip():
            record = json.loads(line)
            kind = tuple(sorted({key.split("/")[0] for key in record if "/" in key}))
            latest[(record["step"], kind)] = record
    return sorted(latest.values(), key=lambda record: record["step"])


def record_environment(workdir: str, step: int) -> dict:
    """Appends what this start of the run computes with (processor, JAX versions, the XLA flags
    in effect, glibc's tunables) to ``workdir/environment.jsonl``, a line per start, so that the
    figures of a resumed run can be traced to each process that made them -> the record."""
    record = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "step": int(step),
        "processor": processor(),
        "jax": compat.version("jax"),
        "jaxlib": compat.version("jaxlib"),
        "xla_flags": xla_cpu.in_effect(),
        "glibc_tunables": huge_pages.in_effect(),
    }
    storage.append_text(storage.join(workdir, "environment.jsonl"), json.dumps(record) + "\n")
    return record


def format_table(step: int, metrics: dict) -> str:
    """A short two-column table of eval metrics."""
    width = max(len(k) for k in metrics)
    lines = [f"eval at step {step}", "-" * (width + 12)]
    lines += [f"{k:<{width}}  {v:>9.4f}" for k, v in sorted(metrics.items())]
    return "\n".join(lines)


def plot_curves(workdir: str) -> str | None:
    """``curves.png``: one panel per metric name (train and eval share a panel) vs step."""
    return images.plot_curves(read_metrics(workdir), storage.join(workdir, "curves.png"))
