"""Data parallelism around a task's pure ``train_step``: declared, not written.

Two ways to run the same step function over every device of every process:

* ``"jit"`` (default, what JAX recommends): a 1-D mesh ``("data",)`` over all devices; the
  batch is a global array sharded along its leading axis, the state is replicated, and XLA
  inserts the gradient all-reduce. The step sees the global batch (``axis_name=None``).
* ``"pmap"``: the state is replicated with a leading ``[local_devices]`` axis, the batch is
  reshaped to ``[local_devices, batch / devices, ...]``, and the step runs per device with
  ``axis_name="data"`` so it ``lax.pmean``s gradients and metrics itself.

Both donate the state buffers. ``Prefetcher`` keeps the next batches on the devices while the
current step runs, so no host-to-device copy sits between two steps.
"""
from __future__ import annotations

import collections
import functools
import os
from typing import Callable, Iterator

import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

MODES = ("jit", "pmap")
AXIS = "data"


def maybe_initialize_distributed(config) -> None:
    """``jax.distributed.initialize()`` when ``config.distributed`` or the environment asks.

    The environment asks with ``JAX_COORDINATOR_ADDRESS`` (plus ``JAX_NUM_PROCESSES`` and
    ``JAX_PROCESS_ID``), or on clusters JAX detects itself (SLURM, TPU pods) via
    ``config.distributed=True``.
    """
    if not (config.get("distributed", False) or os.environ.get("JAX_COORDINATOR_ADDRESS")):
        return
    if jax.distributed.is_initialized():
        return
    jax.distributed.initialize()
    logging.info("jax.distributed: process %d of %d, %d global devices", jax.process_index(),
                 jax.process_count(), jax.device_count())


class DataParallel:
    """Placement and compilation for one ``mode`` (``"jit"`` or ``"pmap"``).

    ``batch_size`` is the global batch; it must split evenly over the devices.
    """

    def __init__(self, mode: str, batch_size: int, eval_batch_size: int | None = None):
        if mode not in MODES:
            raise ValueError(f"config.parallel={mode!r} is not supported; expected one of {MODES}.")
        for name, size in (("config.batch_size", batch_size),
                           ("config.eval_batch_size", eval_batch_size or batch_size)):
            if size % jax.device_count():
                raise ValueError(f"{name}={size} is not divisible by the {jax.device_count()} "
                                 f"devices ({jax.process_count()} process(es)); data parallelism "
                                 f"needs an equal share per device.")
        self.mode = mode
        self.mesh = jax.make_mesh((jax.device_count(),), (AXIS,),
                                  axis_types=(jax.sharding.AxisType.Auto,))
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P(AXIS))
        # pmap's layout: a leading [local_devices] axis, one slice per local device.
        self.stacked = NamedSharding(jax.sharding.Mesh(np.array(jax.local_devices()), (AXIS,)),
                                     P(AXIS))

    # ---- placement --------------------------------------------------------------------------

    def replicate(self, state):
        """Host/single-device state -> replicated device state."""
        if self.mode == "pmap":
            n = jax.local_device_count()
            return jax.tree.map(lambda x: jax.device_put(
                np.broadcast_to(np.asarray(x), (n, *np.shape(x))), self.stacked), state)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.replicated, np.asarray(x)),
            state)

    def unreplicate(self, state):
        """Device state -> one copy (what checkpoints store and inference uses)."""
        if self.mode == "pmap":
            return jax.tree.map(lambda x: x[0], state)
        return state

    def shard_batch(self, batch):
        """Per-process host batch ``[b, ...]`` -> device batch (global in jit mode)."""
        if self.mode == "pmap":
            n = jax.local_device_count()
            return jax.tree.map(
                lambda x: jax.device_put(x.reshape(n, -1, *x.shape[1:]), self.stacked), batch)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x), batch)

    def fetch(self, tree):
        """Replicated device values (metrics) -> host numpy, one copy."""
        if self.mode == "pmap":
            tree = jax.tree.map(lambda x: x[0], tree)
        return jax.tree.map(np.asarray, jax.device_get(tree))

    # ---- compilation ------------------------------------------------------------------------

    def compile_train_step(self, train_step: Callable) -> Callable:
        """``train_step(state, batch, rng, axis_name=...)`` -> compiled ``step(state, batch, rng)``.

        ``rng`` is one key; under pmap each device folds in its index (dropout differs per
        device slice, as it does across a global batch under jit).
        """
        if self.mode == "pmap":
            def per_device(state, batch, rng):
                rng = jax.random.fold_in(rng, jax.lax.axis_index(AXIS))
                return train_step(state, batch, rng, axis_name=AXIS)

            return jax.pmap(per_device, axis_name=AXIS, in_axes=(0, 0, None),
                            donate_argnums=(0,))
        step = functools.partial(train_step, axis_name=None)
        return jax.jit(step, out_shardings=(self.replicated, self.replicated),
                       donate_argnums=(0,))

    def compile_eval_step(self, eval_step: Callable) -> Callable:
        """``eval_step(state, batch) -> sums`` -> compiled function returning global sums."""
        if self.mode == "pmap":
            def per_device(state, batch):
                return jax.lax.psum(eval_step(state, batch), AXIS)

            return jax.pmap(per_device, axis_name=AXIS)
        return jax.jit(eval_step, out_shardings=self.replicated)


class Prefetcher:
    """Iterates ``(device_batch, iterator_state)`` with ``size`` batches already on the devices.

    ``iterator_state`` is the host iterator's state right after producing that batch: restoring
    it resumes with the batch that follows, whatever has been prefetched since.
    """

    def __init__(self, iterator, put: Callable, size: int = 2):
        self._iterator, self._put = iterator, put
        self._queue = collections.deque()
        self._size = max(size, 1)

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        while len(self._queue) < self._size:
            batch = next(self._iterator)
            self._queue.append((self._put(batch), self._iterator.get_state()))
        return self._queue.popleft()

