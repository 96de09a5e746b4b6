"""Orbax checkpoints of a training run, and loading a trained run for inference.

A workdir holds::

    config.json              the run's config (written once the run is known to be valid)
    checkpoints/<step>/      latest checkpoints: "state" (the task's train state as a nested
                             dict: step, params, opt_state, ...; each process writes the shards
                             it holds) and "data" (each process's train iterator state,
                             ``process_<i>-of-<n>.json``: the global data position, the same
                             on every process), the last ``max_to_keep`` kept
    checkpoints_best/<step>/ optional: the state at the best ``config.best_metric`` so far

Saving is asynchronous (Orbax copies to host, then writes in a background thread);
``Checkpointer.close()`` waits for the writes. Restarting a run in the same workdir restores
the latest checkpoint (state, optimiser state, data iterator position, step; per-step RNG keys
are derived from ``(seed, step)``), so it continues exactly where it stopped. A checkpoint
restores onto any mesh (its arrays are resharded to the target's layout), e.g. one written by
8 devices with sharded parameters restores whole on one device for inference, and a run saved
by N processes resumes on any number (``attnjax.parallel.elastic``).
"""

from __future__ import annotations

import functools
import json
import logging as std_logging
from typing import Sequence

import flax.serialization
import grain
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from attnjax import storage
from attnjax.parallel import elastic
from attnjax.train import checkpoint_integrity

CONFIG_FILE = "config.json"
# Config fields besides ``task`` that define the model a checkpoint holds, for a task that
# declares none (a task's ``IDENTITY_FIELDS``); a resumed run must agree on them.
DEFAULT_IDENTITY_FIELDS = ("model",)
# Fields inside those that say how a step computes, not what the checkpoint holds: a run may
# resume with remat switched on to fit a smaller device, or from a config written before the
# field existed.
NOT_IDENTITY = ("remat",)


def _checkpoint_dir(workdir: str, best: bool = False) -> str:
    return storage.join(storage.absolute(workdir), "checkpoints_best" if best else "checkpoints")


def latest_step(workdir: str, best: bool = False) -> int | None:
    """The newest checkpoint step saved in ``workdir`` (``None`` when there is none).

    Orbax writes a step under a temporary name and renames it when complete, so only finished
    checkpoints are counted.
    """
    directory = _checkpoint_dir(workdir, best)
    if not storage.isdir(directory):
        return None
    return max(ocp.utils.checkpoint_steps(storage.path(directory)), default=None)


def read_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a run in ``workdir`` was started with."""
    path = storage.join(workdir, CONFIG_FILE)
    if not storage.exists(path):
        raise FileNotFoundError(f"{path} not found: {workdir!r} is not a training workdir.")
    return ml_collections.ConfigDict(json.loads(storage.read_text(path)))


def _jsonable(config) -> dict:
    return json.loads(config.to_json_best_effort())


def write_config(workdir: str, config) -> None:
    storage.makedirs(workdir)
    text = json.dumps(_jsonable(config), indent=2, sort_keys=True)
    storage.write_atomic(storage.join(workdir, CONFIG_FILE), text)


def _identity(value):
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in NOT_IDENTITY}
    return value


def check_compatible(workdir: str, config, fields: Sequence[str] = DEFAULT_IDENTITY_FIELDS) -> None:
    """Raises ``ValueError`` if ``workdir`` holds checkpoints of a different model: one whose
    config differs from ``config`` in ``task`` or one of ``fields``."""
    if latest_step(workdir) is None or not storage.exists(storage.join(workdir, CONFIG_FILE)):
        return
    saved, current = _jsonable(read_config(workdir)), _jsonable(config)
    pairs = {k: (_identity(saved.get(k)), _identity(current.get(k))) for k in ("task", *fields)}
    differ = {k: (a, b) for k, (a, b) in pairs.items() if a != b}
    if differ:
        details = "; ".join(
            f"config.{k}: checkpoint has {a!r}, config has {b!r}" for k, (a, b) in differ.items()
        )
        raise ValueError(
            f"workdir {workdir!r} holds checkpoints of a different model ({details}). "
            f"Use a new --workdir, or the original config to resume."
        )


# Orbax writes a replicated array as one slice per replica, each cut by its own jitted slice:
# a program compiled per array shape and replica at the first save, which for small arrays costs
# far more than writing them in parallel saves (the digits ViT's 60-step run on 4 CPU devices:
# 2.2 s of its 14.6 s of CPU). Arrays whose slice would be under this size are written whole by
# one replica, as Orbax does for any array on one device.
MIN_REPLICA_SLICE_BYTES = 1 << 20


@functools.cache  # once per process: a save in flight keeps the handler it started with
def _write_small_arrays_whole() -> None:
    # Orbax's default jax.Array handler but for the slice size; its array-metadata store is
    # constructed as Orbax's registry does (the store is not exported).
    from orbax.checkpoint._src.metadata import array_metadata_store

    handler = ocp.type_handlers.ArrayHandler(
        array_metadata_store=array_metadata_store.Store(),
        min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
    )
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


class Checkpointer:
    """Latest-N (+ optional best) checkpoints of one run. ``config`` fields:
    ``checkpoint_every``, ``max_to_keep``, ``best_metric`` ("" disables), ``best_mode``."""

    def __init__(self, workdir: str, config):
        self.workdir = workdir
        _write_small_arrays_whole()
        self.manager = ocp.CheckpointManager(
            storage.path(_checkpoint_dir(workdir)),
            options=ocp.CheckpointManagerOptions(max_to_keep=config.max_to_keep, create=True),
            item_names=("state", "data"),
        )
        self.best_metric = config.get("best_metric", "")
        self.best_manager = None
        if self.best_metric:
            mode = config.get("best_mode", "max")
            if mode not in ("max", "min"):
                raise ValueError(f"config.best_mode={mode!r}; expected 'max' or 'min'.")
            metric = self.best_metric
            self.best_manager = ocp.CheckpointManager(
                storage.path(_checkpoint_dir(workdir, best=True)),
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=1,
                    best_fn=lambda m: float(m[metric]),
                    best_mode=mode,
                    create=True,
                    # Both managers may save the same step; Orbax names its cross-process
                    # barriers by step, so they need distinct prefixes not to collide.
                    multiprocessing_options=ocp.options.MultiprocessingOptions(
                        barrier_sync_key_prefix="best"
                    ),
                ),
                item_names=("state",),
            )

    def save(self, step: int, state, data_state: dict) -> None:
        """``state``: host or global device arrays; ``data_state``: this process's iterator."""
        # An earlier asynchronous write's failure surfaces here too.
        with checkpoint_integrity.disk_full_as_write_error(str(self.manager.directory)):
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(flax.serialization.to_state_dict(state)),
                    data=grain.checkpoint.CheckpointSave(_IteratorState(data_state)),
                ),
            )

    def save_best(self, step: int, state, metrics: dict) -> None:
        if self.best_manager is None:
            return
        if self.best_metric not in metrics:
            raise ValueError(
                f"config.best_metric={self.best_metric!r} is not among the eval "
                f"metrics {sorted(metrics)}."
            )
        if not np.isfinite(metrics[self.best_metric]):
            return  # a NaN would compare as "best" and push out the real best checkpoint
        with checkpoint_integrity.disk_full_as_write_error(str(self.best_manager.directory)):
            self.best_manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(flax.serialization.to_state_dict(state))
                ),
                metrics={k: float(v) for k, v in metrics.items()},
            )

    def restore(self, state, iterator, step: int | None = None):
        """Restores into the structure and shardings of ``state`` (placed device arrays, or host
        arrays on one process) -> the restored state; ``iterator`` (this process's train
        iterator) is set to its saved position.

        Any process count resumes a checkpoint that holds a global data position
        (``attnjax.parallel.elastic``); per-worker iterator states need the count that saved them
        (else ``CheckpointLayoutError``, one line naming both)."""
        step = self.manager.latest_step() if step is None else step
        target = jax.tree.map(
            ocp.utils.to_shape_dtype_struct, flax.serialization.to_state_dict(state)
        )
        states = elastic.saved_iterator_states(self.manager.directory / str(step) / "data")
        position = elastic.saved_position(states)
        current = iterator.get_state()
        if position is not None and elastic.position(current) is not None:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
            )
            iterator.set_state(elastic.iterator_state(position))
        elif len(states) == jax.process_count():
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target),
                    data=grain.checkpoint.CheckpointRestore(iterator),
                ),
            )
        else:
            raise elastic.layout_error(
                self.manager.directory, step, states, jax.process_count(), current
            )
        return flax.serialization.from_state_dict(state, restored["state"])

    def restore_intact(self, state, iterator):
        """Restores the newest intact checkpoint (see ``checkpoint_integrity``) and sets
        ``iterator`` to its position -> ``(step, state)``, or ``(None, state)`` when there is
        none."""
        steps = list(self.manager.all_steps())
        if not steps:
            return None, state
        return checkpoint_integrity.restore_newest_intact(
            str(self.manager.directory),
            steps,
            lambda step: self.restore(state, iterator, step),
            on_moved=self.manager.reload,
        )

    def close(self) -> None:
        """Waits for pending asynchronous writes."""
        for manager in (self.manager, self.best_manager):
            if manager is None:
                continue
            with checkpoint_integrity.disk_full_as_write_error(str(manager.directory)):
                manager.wait_until_finished()
                manager.close()  # an asynchronous write's failure may surface here instead


class _IteratorState:
    """A saved iterator position in the form grain's checkpoint handler writes (JSON bytes)."""

    def __init__(self, state: dict):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state, indent=2).encode()


def load(
    workdir: str,
    *,
    step: int | None = None,
    best: bool = False,
    use_ema: bool = True,
    variables: Sequence[str] | None = None,
):
    """Loads a trained run: ``(config, params)``.

    Args:
      workdir: the run's ``--workdir``.
      step: which checkpoint (default: the latest, or the best with ``best=True``).
      best: read ``checkpoints_best/`` (the best ``config.best_metric``) instead of the latest.
      use_ema: return the EMA parameters when the run kept them (what its eval used).
      variables: names of train-state fields besides the params that inference needs (the
        task's ``VARIABLE_FIELDS``: BatchNorm statistics, a quantizer's codebook state); when
        given, a dict ``{"params": ...}`` plus each non-empty one of them is returned instead
        of the params.

    Returns:
      ``(config, params)`` (or ``(config, variables)``) as host numpy trees; tasks with several
      models (e.g. VQGAN) keep one params subtree per model, as their train state does.
    """
    config = read_config(workdir)
    directory = _checkpoint_dir(workdir, best=best)
    if not storage.isdir(directory):
        raise FileNotFoundError(f"no checkpoints under {directory!r}.")
    # read_only guards the run against accidental writes; Orbax warns about it on every open,
    # which is noise for a reader, so its logger is quieted for this block only.
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
    absl_logger = std_logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(std_logging.ERROR)
    try:
        manager = ocp.CheckpointManager(
            storage.path(directory), item_names=("state",), options=options
        )
    finally:
        absl_logger.setLevel(level)
    with manager:
        if step is None:
            step = manager.best_step() if best else manager.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoints under {directory!r}.")
        saved = (
            ocp.StandardCheckpointHandler()
            .metadata(storage.path(directory) / str(step) / "state")
            .tree
        )
        ema = use_ema and bool(saved.get("ema_params"))
        fields = ["ema_params" if ema else "params"]
        fields += [name for name in variables or () if saved.get(name)]
        wanted = {name: saved[name] for name in fields}
        # Only the fields inference reads, as host arrays whatever mesh wrote them: the optimiser
        # state (Adam's two moments per parameter) is most of a train state's bytes and files.
        state = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=wanted,
                    restore_args=jax.tree.map(
                        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted
                    ),
                    partial_restore=True,
                )
            ),
        )["state"]
    params = state.pop(fields[0])
    if variables is None:
        return config, params
    return config, {"params": params, **state}
