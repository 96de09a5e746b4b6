"""What the rows of ``compare_torch.py`` share: the device each side runs on, an attnjax step
compiled once and timed after (``Jax``), and train and inference steps on either side."""

from __future__ import annotations

import time

import jax
import numpy as np
import optax
import torch

from attnjax.parallel import data_parallel

LEARNING_RATE = 1e-4
_DEVICE = "cpu"  # torch's device; use_devices makes it "cuda" when JAX runs on a GPU too


def device() -> str:
    """torch's device: ``"cuda"`` when JAX runs on a GPU too (see ``use_devices``), else cpu."""
    return _DEVICE


def sync():
    if _DEVICE == "cuda":
        torch.cuda.synchronize()


def placed(state, inputs: tuple, split=None) -> tuple:
    """``(state, inputs, devices)`` for data parallelism as ``train.py`` runs it: with several
    devices, each input split over all of them along the axis ``split`` names for it (default:
    axis 0 of all; ``None``: that input replicated) and the state replicated; where a split axis
    does not divide evenly, both as given, on one device."""
    split = (0,) * len(inputs) if split is None else tuple(split)
    devices = jax.devices()
    sizes = [
        np.shape(leaf)[s]
        for x, s in zip(inputs, split)
        if s is not None
        for leaf in jax.tree.leaves(x)
    ]
    if len(devices) == 1 or not sizes or any(n % len(devices) for n in sizes):
        return state, tuple(inputs), 1
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    P = jax.sharding.PartitionSpec

    def place(s):
        return jax.sharding.NamedSharding(mesh, P() if s is None else P(*[None] * s, "data"))

    state = jax.device_put(state, place(None))
    inputs = tuple(jax.device_put(x, place(s)) for x, s in zip(inputs, split))
    return state, inputs, len(devices)


class Jax:
    """A jitted step ``fn(state, *inputs) -> state`` (or outputs), compiled once, timed after.

    With several devices (one per CPU core, or GPUs) the inputs are split over every device along
    the axis ``split`` names for each (default: axis 0 of all; ``None``: that input is replicated)
    and the state is replicated: data parallelism, as ``train.py`` runs (SDPA splits its heads).
    Where a split axis does not divide evenly, the step runs on one device.
    """

    def __init__(self, fn, state, *inputs, donate: bool = False, split=None):
        state, inputs, self.devices = placed(state, inputs, split)
        jitted = jax.jit(fn, donate_argnums=(0,) if donate else ())
        # The same program with nothing donated, for callers that compile it again under other
        # options and call it more than once on one state (step_options.py).
        self.undonated = jax.jit(fn) if donate else jitted
        start = time.perf_counter()
        self.compiled = jitted.lower(state, *inputs).compile()
        self.compile_s = time.perf_counter() - start
        memory = self.compiled.memory_analysis()
        self.temp_mib = memory.temp_size_in_bytes / 2**20 if memory is not None else float("nan")
        self.state, self.inputs, self.carry = state, inputs, donate

    def __call__(self):
        out = self.compiled(self.state, *self.inputs)
        jax.block_until_ready(out)
        if self.carry:
            self.state = out


def to_torch(x):
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x))).to(device())


def nchw(x):
    return to_torch(np.asarray(x).transpose(0, 3, 1, 2))


def torch_train_step(module, loss_fn):
    optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn().backward()
        optimizer.step()
        sync()

    return step


def jax_train_step(loss_fn, params):
    tx = optax.adamw(LEARNING_RATE)

    def step(state, *inputs):
        params, opt_state = state
        grads = jax.grad(loss_fn)(params, *inputs)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, (params, tx.init(params))


def inference_step(fn):
    def step():
        with torch.no_grad():
            fn()
        sync()

    return step


def add_cpu_devices_flag(parser):
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        help="XLA:CPU devices attnjax splits a batch over (0: one per core; 1: one device)",
    )


def use_devices(cpu_devices: int):
    """Before anything touches a JAX device: ``cpu_devices`` XLA:CPU devices (0: one per core),
    as train.py gives itself (attnjax.parallel.data_parallel.use_cpu_cores);
    torch on CUDA when JAX runs on a GPU."""
    if cpu_devices < 0:
        raise ValueError(f"--cpu-devices={cpu_devices} must be >= 0 (0: one per core)")
    data_parallel.set_cpu_devices(cpu_devices or data_parallel.cpu_cores())
    global _DEVICE
    _DEVICE = "cuda" if torch.cuda.is_available() and jax.default_backend() == "gpu" else "cpu"
