"""Data parallelism and sharded parameters around a task's pure ``train_step``: declared.

Two ways to run the same step function over every device of every process:

* ``"jit"`` (default, what JAX recommends): a mesh over all devices (``config.mesh``, default
  ``{"data": -1}``; see ``attnjax.parallel.sharding``); the batch is a global array split along its
  leading axis over the ``data`` and ``fsdp`` axes, the state is laid out by the task's
  partition rules (replicated under pure data parallelism, split over ``fsdp`` otherwise), and
  XLA inserts the collectives. The step sees the global batch (``axis_name=None``).
* ``"pmap"``: the state is replicated with a leading ``[local_devices]`` axis, the batch is
  reshaped to ``[local_devices, batch / devices, ...]``, and the step runs per device with
  ``axis_name="data"`` so it ``lax.pmean``s gradients and metrics itself.

Both donate the state buffers. ``Prefetcher`` keeps the next batches on the devices while the
current step runs, so no host-to-device copy sits between two steps.

Several processes (hosts): ``maybe_initialize_distributed`` joins them into one JAX runtime
before any device is touched; ``python -m attnjax.parallel.launch`` starts them on one machine.
"""

from __future__ import annotations

import collections
import functools
import glob
import importlib.metadata
import os
from typing import Callable, Iterator

import flax.linen as nn
import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attnjax import xla_cpu
from attnjax.ops.platform import cpu_cores
from attnjax.parallel import sharding, watchdog

MODES = ("jit", "pmap")
AXIS = "data"
# What jax.distributed.initialize() does not read from the environment itself.
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
# JAX's default: a process whose heartbeats stop this long is declared dead, and the others are
# ended with it. Above the watchdog's floor, so that a stalled peer is reported by the watchdog.
HEARTBEAT_TIMEOUT_SECONDS = 300
CPU_COLLECTIVE_TIMEOUT_FLAGS = (
    "--xla_cpu_collective_timeout_seconds",
    "--xla_cpu_collective_call_terminate_timeout_seconds",
)


def _int_from_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} is not an integer.") from None


def maybe_initialize_distributed(config=None) -> None:
    """Joins this process to a multi-process JAX runtime when asked; else does nothing.

    Asked by ``$JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0) with
    ``$JAX_NUM_PROCESSES`` and ``$JAX_PROCESS_ID`` (what ``python -m attnjax.parallel.launch``
    sets), or by ``config.distributed=True`` on clusters JAX detects itself (SLURM, TPU pods,
    Open MPI), where ``jax.distributed.initialize()`` finds all three on its own. CPU devices
    exchange data through gloo (the CPU client has no collectives across processes otherwise).

    ``config.heartbeat_timeout_seconds`` (default ``HEARTBEAT_TIMEOUT_SECONDS``) goes to
    ``jax.distributed.initialize``. gloo's own collective timeouts, which abort the process, are
    raised above the watchdog's bounds (``attnjax.parallel.watchdog``) unless ``$XLA_FLAGS`` sets
    them: the watchdog, which serves every platform, then reports a stalled peer first.
    """
    wanted = (config is not None and config.get("distributed", False)) or os.environ.get(
        ENV_COORDINATOR
    )
    if not wanted or jax.distributed.is_initialized():
        return
    num_processes, process_id = _int_from_env(ENV_NUM_PROCESSES), _int_from_env(ENV_PROCESS_ID)
    if os.environ.get(ENV_COORDINATOR) and (num_processes is None or process_id is None):
        raise ValueError(
            f"${ENV_COORDINATOR} is set but ${ENV_NUM_PROCESSES}={num_processes} "
            f"and ${ENV_PROCESS_ID}={process_id}; set both (python -m "
            f"attnjax.parallel.launch does)."
        )
    if (
        num_processes is not None
        and process_id is not None
        and not (0 <= process_id < num_processes)
    ):
        raise ValueError(
            f"${ENV_PROCESS_ID}={process_id} is outside [0, ${ENV_NUM_PROCESSES}={num_processes})."
        )
    config = {} if config is None else config
    heartbeat = config.get("heartbeat_timeout_seconds", HEARTBEAT_TIMEOUT_SECONDS)
    if not isinstance(heartbeat, int) or isinstance(heartbeat, bool) or heartbeat < 1:
        raise ValueError(
            f"config.heartbeat_timeout_seconds={heartbeat!r} must be a positive integer."
        )
    os.environ["XLA_FLAGS"] = with_collective_timeouts(
        os.environ.get("XLA_FLAGS", ""), int(watchdog.longest_bound(config)) + 60
    )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=os.environ.get(ENV_COORDINATOR) or None,
        num_processes=num_processes,
        process_id=process_id,
        heartbeat_timeout_seconds=heartbeat,
    )
    logging.info(
        "jax.distributed: process %d of %d, %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.device_count(),
    )


def with_collective_timeouts(xla_flags: str, seconds: int) -> str:
    """``xla_flags`` with XLA:CPU's collective timeouts set to ``seconds`` where it sets none."""
    return xla_cpu.merged(xla_flags, [f"{flag}={seconds}" for flag in CPU_COLLECTIVE_TIMEOUT_FLAGS])


# The device files each accelerator plugin drives, by the start of its package's name: a plugin
# installed where its device is not (libtpu in attnjax's dev extra, for compile-only TPU
# programs) leaves JAX on the CPU, which should then get its devices.
ACCELERATOR_DEVICE_FILES = {
    "libtpu": ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*"),
    "jax-cuda": ("/dev/nvidia[0-9]*",),
    "jax-rocm": ("/dev/kfd",),
}


def accelerator_present() -> bool:
    """Whether a GPU or TPU plugin for JAX is installed and its device exists on this machine."""
    names = {
        (d.metadata["Name"] or "").lower().replace("_", "-")
        for d in importlib.metadata.distributions()
    }
    return any(
        any(name.startswith(plugin) for name in names) and any(map(glob.glob, device_files))
        for plugin, device_files in ACCELERATOR_DEVICE_FILES.items()
    )


def _accelerator_expected() -> bool:
    """Whether JAX will pick a GPU or TPU: ``$JAX_PLATFORMS`` names one first, or a plugin for one
    is installed beside its device. There the CPU backend holds no data and keeps one device."""
    platforms = (os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "").lower()
    if platforms:
        return not platforms.split(",")[0].strip() == "cpu"
    return accelerator_present()


# The CPU device count use_cpu_cores chose for this process (None: it chose none).
_chosen_cpu_devices: int | None = None


def set_cpu_devices(count: int) -> bool:
    """Gives the CPU backend ``count`` devices -> whether it did. Call before any device is used.

    Left alone (``False``): a count chosen already (``--xla_force_host_platform_device_count``
    in ``$XLA_FLAGS``, or ``jax_num_cpu_devices``), multi-process runs, whose launcher gives each
    process its devices, machines where JAX will use a GPU or TPU, and a backend already started.
    """
    if (
        "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
        or jax.config.jax_num_cpu_devices >= 0
        or os.environ.get(ENV_COORDINATOR)
        or _accelerator_expected()
    ):
        return False
    try:
        jax.config.update("jax_num_cpu_devices", int(count))
    except RuntimeError as error:  # a device was used already: the backend keeps its count
        logging.warning("CPU device count left as it is: %s", error)
        return False
    return True


def cpu_devices_wanted(config) -> int:
    """``config.cpu_devices`` if > 0, else the largest count up to the cores that divides
    ``config.batch_size`` and ``config.eval_batch_size`` (each device takes an equal share)."""
    requested = int(config.get("cpu_devices", 0))
    if requested < 0:
        raise ValueError(f"config.cpu_devices={requested} must be >= 0 (0: one per core).")
    sizes = [int(size) for size in (config.batch_size, config.get("eval_batch_size") or 0) if size]
    return requested or max(n for n in range(1, cpu_cores() + 1) if all(s % n == 0 for s in sizes))


def use_cpu_cores(*configs) -> int | None:
    """Gives the CPU backend as many devices as the ``configs`` want (``cpu_devices_wanted``, the
    largest) -> that count, or ``None`` where ``set_cpu_devices`` left it alone (every device is
    then used). Call before any device is used.

    One device per core was faster than one device on every CPU training step measured, with
    XLA's convolutions threaded (attnjax.xla_cpu's flags) or not: VQGAN 899 against 923 ms, GPT
    1661 against 1925 ms (benchmarks/results/xla_cpu_flags.md, benchmarks/results/cpu_devices.md).
    """
    global _chosen_cpu_devices
    wanted = max(cpu_devices_wanted(config) for config in configs)
    if not set_cpu_devices(wanted):
        return None
    _chosen_cpu_devices = wanted
    return wanted


def run_devices(config) -> list | None:
    """The devices a run of ``config`` splits its batch over: where ``use_cpu_cores`` gave this
    process more CPU devices than ``config`` wants (a pipeline of several configs), the first
    ``cpu_devices_wanted(config)``; else ``None``, every device."""
    if _chosen_cpu_devices is None or jax.default_backend() != "cpu" or jax.process_count() > 1:
        return None
    wanted = cpu_devices_wanted(config)
    return jax.devices()[:wanted] if wanted < jax.device_count() else None


def train_step_compiler_options(config, mesh) -> dict:
    """XLA options for the train step on ``mesh``. With ``config.model.remat`` on XLA:GPU over
    several devices, the gradients' all-reduce runs synchronously: asynchronous, its scheduling
    keeps every recomputed block's activations alive, and remat then saves almost no memory
    (benchmarks/results/largest_batch.md). The all-reduce no longer overlaps the backward pass:
    remat already trades time for memory."""
    remat = bool((config.get("model") or {}).get("remat", False))
    if remat and mesh.size > 1 and mesh.devices.flat[0].platform == "gpu":
        return {"xla_gpu_disable_async_collectives": "ALLREDUCE"}
    return {}


def placed_shapes(tree, shardings):
    """``tree``'s shapes and dtypes as ``jax.ShapeDtypeStruct``s laid out by ``shardings`` (a tree
    of the same structure): what a program is compiled for, or a checkpoint restored into,
    without any values."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


_WARNED = set()


def _warn_left_whole(whole: list, mesh) -> None:
    """One warning per layout where fsdp leaves large arrays whole on every device."""
    if not whole or (key := (tuple(whole), tuple(mesh.shape.items()))) in _WARNED:
        return
    _WARNED.add(key)
    name, shape, _ = whole[0]
    gib = sum(size for _, _, size in whole) / (1 << 30)
    logging.warning(
        "config.mesh.fsdp=%d divides no dimension of %d arrays of the train state (%.2f GiB, "
        "e.g. %s %s): every device holds them whole; an fsdp size that divides them, or a model "
        "axis, would split them",
        mesh.shape[sharding.FSDP],
        len(whole),
        gib,
        name,
        list(shape),
    )


class DataParallel:
    """Placement and compilation for one ``mode`` (``"jit"`` or ``"pmap"``).

    ``batch_size`` is the global batch; it must split evenly over the batch axes of the mesh.
    ``mesh``: ``config.mesh`` (jit only); ``rules``: partition rules
    (``attnjax.parallel.sharding``); ``devices``: what the mesh spans (jit only; default every
    device, ``run_devices``).
    """

    def __init__(
        self,
        mode: str,
        batch_size: int,
        eval_batch_size: int | None = None,
        *,
        mesh=None,
        rules=None,
        devices=None,
    ):
        if mode not in MODES:
            raise ValueError(f"config.parallel={mode!r} is not supported; expected one of {MODES}.")
        self.mode = mode
        self.mesh = sharding.make_mesh(mesh, devices if mode == "jit" else None)
        self.rules = rules or ((r".*", P()),)
        batch_devices = sharding.batch_size_divisor(self.mesh)
        if mode == "pmap" and batch_devices != jax.device_count():
            raise ValueError(
                f"config.mesh={dict(self.mesh.shape)} splits parameters, which "
                f"config.parallel='pmap' cannot; use 'jit'."
            )
        for name, size in (
            ("config.batch_size", batch_size),
            ("config.eval_batch_size", eval_batch_size or batch_size),
        ):
            if size % batch_devices:
                raise ValueError(
                    f"{name}={size} is not divisible by the {batch_devices} "
                    f"devices ({jax.process_count()} process(es)) the batch is "
                    f"split over; data parallelism needs an equal share per "
                    f"device."
                )
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, sharding.batch_spec(self.mesh))
        # pmap's layout: a leading [local_devices] axis, one slice per local device.
        self.stacked = NamedSharding(
            jax.sharding.Mesh(np.array(jax.local_devices()), (AXIS,)), P(AXIS)
        )

    # ---- placement --------------------------------------------------------------------------

    def state_shardings(self, state):
        """The partition rules applied to ``state`` (a tree of ``NamedSharding``; jit mode)."""
        _warn_left_whole(sharding.left_whole(state, self.mesh, self.rules), self.mesh)
        return sharding.tree_shardings(state, self.mesh, self.rules)

    def place_state(self, state):
        """Host (or already placed) state -> device state: sharded by the rules (jit) or
        replicated with a leading device axis (pmap). Every process passes the same values."""
        if self.mode == "pmap":
            n = jax.local_device_count()
            return jax.tree.map(
                lambda x: jax.device_put(
                    np.broadcast_to(np.asarray(x), (n, *np.shape(x))), self.stacked
                ),
                state,
            )

        def place(x, target):
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                return jax.device_put(x, target)  # a global array: XLA reshards it
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, target, lambda index: x[index])

        return jax.tree.map(place, state, self.state_shardings(state))

    def to_host(self, state):
        """Device state -> one whole host (numpy) copy on every process (images, sampling).

        A collective under jit (the shards are gathered first): every process calls it. Host
        arrays, because a computation on global arrays would need every process to run it.
        """
        if self.mode == "pmap":
            return jax.device_get(jax.tree.map(lambda x: x[0], state))
        return jax.device_get(jax.jit(lambda tree: tree, out_shardings=self.replicated)(state))

    def checkpointable(self, state):
        """What a checkpoint stores: the global (possibly sharded) arrays; each process writes
        its own shards. Under pmap: one host copy."""
        if self.mode == "pmap":
            return jax.device_get(jax.tree.map(lambda x: x[0], state))
        return state

    def shard_batch(self, batch):
        """Per-process host batch ``[b, ...]`` -> device batch (global in jit mode)."""
        if self.mode == "pmap":
            n = jax.local_device_count()
            return jax.tree.map(
                lambda x: jax.device_put(x.reshape(n, -1, *x.shape[1:]), self.stacked), batch
            )
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.batch_sharding, x), batch
        )

    def fetch(self, tree):
        """Replicated device values (metrics) -> host numpy, one copy."""
        if self.mode == "pmap":
            tree = jax.tree.map(lambda x: x[0], tree)
        return jax.tree.map(np.asarray, jax.device_get(tree))

    # ---- compilation ------------------------------------------------------------------------

    def compile_train_step(
        self, train_step: Callable, state_shardings=None, compiler_options=None
    ) -> Callable:
        """``train_step(state, batch, rng, axis_name=...)`` -> compiled ``step(state, batch, rng)``.

        ``rng`` is one key; under pmap each device folds in its index (dropout differs per
        device slice, as it does across a global batch under jit). ``state_shardings`` (jit):
        the layout the new state keeps (``state_shardings(state)``; default replicated);
        ``compiler_options``: XLA's, for the jit (``train_step_compiler_options``).
        """
        if self.mode == "pmap":

            def per_device(state, batch, rng):
                rng = jax.random.fold_in(rng, jax.lax.axis_index(AXIS))
                return train_step(state, batch, rng, axis_name=AXIS)

            return jax.pmap(per_device, axis_name=AXIS, in_axes=(0, 0, None), donate_argnums=(0,))
        step = self.traced_on_mesh(functools.partial(train_step, axis_name=None))
        state_out = self.replicated if state_shardings is None else state_shardings
        return jax.jit(
            step,
            out_shardings=(state_out, self.replicated),
            donate_argnums=(0,),
            compiler_options=compiler_options or None,
        )

    def compile_eval_step(self, eval_step: Callable) -> Callable:
        """``eval_step(state, batch) -> sums`` -> compiled function returning global sums."""
        if self.mode == "pmap":

            def per_device(state, batch):
                return jax.lax.psum(eval_step(state, batch), AXIS)

            return jax.pmap(per_device, axis_name=AXIS)
        return jax.jit(self.traced_on_mesh(eval_step), out_shardings=self.replicated)

    def traced_on_mesh(self, fn: Callable) -> Callable:
        """``fn`` traced with the mesh set (``jax.sharding.use_abstract_mesh``): kernels XLA
        cannot partition (Pallas TPU attention, ``attnjax.ops.splash``) find it and run under
        a ``shard_map`` over the batch; and with the activation axis rules set
        (``sharding.activation_axis_rules``), which the models' logical constraints follow."""

        @functools.wraps(fn)
        def on_mesh(*args, **kwargs):
            rules = sharding.activation_axis_rules(self.mesh)
            with (
                jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh),
                nn.logical_axis_rules(rules),
            ):
                return fn(*args, **kwargs)

        return on_mesh


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
