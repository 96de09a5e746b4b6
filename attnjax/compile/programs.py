"""A config's programs compiled for a target's devices, from abstract inputs: the train step, the
eval step and, for a task with ``sample_step``, the sampler; what each holds and computes.

Nothing is initialised or run: the train state's shapes come from ``jax.eval_shape`` of the
task's ``create_train_state``, batches from the task's ``abstract_batch``, and the mesh, layouts
and jitted steps from the training loop itself (``loop.make_data_parallel``,
``steps.compile_steps``), so what compiles here is what ``train.py`` would run.

FLOPs: ``flops`` counts the matrix products and convolutions of the program as traced (the whole
global batch; ``attnjax.train.performance.product_flops``): model FLOPs, the same for every
target, and it sees inside the kernels a TPU or GPU program hides in custom calls. A ``while``
loop of unknown length (the sampler's) counts its body once. ``xla_flops`` is XLA's count of the
traced program lowered for this host (elementwise work too; any loop's body once), and
``compiled_flops_per_device`` the backend's count of the optimised per-device program where it
gives one (TPU; XLA:GPU gives none).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
import time

import jax
import jax.numpy as jnp

from attnjax.compile import collectives as collective_bytes
from attnjax.compile.targets import Target
from attnjax.ops import autotune
from attnjax.parallel import data_parallel
from attnjax.train import loop, performance, steps

_COLLECTIVE = re.compile(r"\b(" + "|".join(collective_bytes.KINDS) + r")(?:-start)?\(")
# Custom calls that run a hand-written kernel (Pallas on TPU, Triton or cuDNN on GPU).
_KERNEL = re.compile(
    r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton|__cudnn\$[^"]*)"'
)
# XLA:TPU's refusals: "... Used 37.29G of 15.75G hbm. ..." or "... (37.29G) exceeds available
# HBM (15.75G)": what the program needs, what the chip has.
_HBM_USED = re.compile(
    r"Used ([\d.]+[KMGT]?) of ([\d.]+[KMGT]?) hbm|\(([\d.]+[KMGT]?)\) exceeds available HBM "
    r"\(([\d.]+[KMGT]?)\)"
)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclasses.dataclass
class Program:
    """One compiled program: bytes are per device, ``flops`` per call over all devices."""

    name: str
    examples: int  # per call, all devices
    compile_seconds: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs written into donated arguments: counted once
    temp_bytes: int
    flops: float
    xla_flops: float | None
    compiled_flops_per_device: float | None
    collectives: dict  # kind -> how many in the program text
    collective_bytes: dict  # kind -> bytes moved per device per call (``collectives``)
    kernel_calls: int
    has_loops: bool

    @property
    def bytes_per_device(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


class DoesNotFit(Exception):
    """A program the compiler refused for its memory: ``needed`` and ``available`` bytes per
    device (None where the compiler did not say)."""

    def __init__(self, program: str, needed: int | None, available: int | None, message: str):
        super().__init__(message)
        self.program, self.needed, self.available = program, needed, available


def _bytes(text: str) -> int:
    return int(float(text.rstrip("KMGT")) * _UNITS[text[-1] if text[-1] in "KMGT" else ""])


def abstract_state(config, task, model, batch):
    """The task's train state as ``jax.ShapeDtypeStruct``s (nothing initialised, no
    ``init_from`` file read)."""
    return loop.abstract_train_state(config, task, model, batch, jax.random.PRNGKey(config.seed))


def _compiled_flops(compiled) -> float | None:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    return float(cost["flops"]) if cost and cost.get("flops", 0) > 0 else None


def compile_program(name: str, jitted, function, args, examples: int, target: Target) -> Program:
    """Lowers ``jitted`` for ``args`` (placed ``ShapeDtypeStruct``s) on ``target`` and compiles
    it; ``function`` is the same computation unjitted, for the traced FLOP count."""
    start = time.perf_counter()
    try:
        compiled = jitted.lower(*args).compile(target.compiler_options or None)
    except Exception as error:  # XLA's errors are runtime errors of several types
        text = str(error)
        if "Ran out of memory" not in text and "RESOURCE_EXHAUSTED" not in text:
            raise
        match = _HBM_USED.search(text)
        used = [group for group in match.groups() if group] if match else []
        needed, available = (_bytes(used[0]), _bytes(used[1])) if used else (None, None)
        raise DoesNotFit(name, needed, available, text.strip().splitlines()[0]) from None
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    hlo = compiled.as_text() or ""
    traced = performance.trace_for_host(function, *args)
    flops, loops = performance.product_flops(traced.jaxpr)
    with jax.default_device(jax.devices("cpu")[0]):
        lowered = traced.lower()
    return Program(
        name=name,
        examples=examples,
        compile_seconds=seconds,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        flops=flops,
        xla_flops=performance.lowered_flops(lowered),
        compiled_flops_per_device=_compiled_flops(compiled),
        collectives=dict(sorted(collections.Counter(_COLLECTIVE.findall(hlo)).items())),
        collective_bytes=collective_bytes.moved_bytes(hlo),
        kernel_calls=len(_KERNEL.findall(hlo)),
        has_loops=loops,
    )


def compile_programs(config, task, target: Target, only=None) -> tuple[dict, list[Program]]:
    """The train step, eval step and (a task with ``sample_step``) the sampler of ``config``
    compiled for ``target`` -> ``(mesh axis sizes, programs)``; ``only``: the names to compile
    (default all)."""
    if target.platform != "cpu":
        autotune.set_enabled(False)  # choices timed on this CPU say nothing about the target
    model = task.create_model(config)
    dp = loop.make_data_parallel(config, task, devices=list(target.devices))
    train_size = int(config.batch_size)
    eval_size = int(config.get("eval_batch_size") or train_size)
    train_batch = task.abstract_batch(config, train_size)
    eval_batch = {
        **task.abstract_batch(config, eval_size),
        "mask": jax.ShapeDtypeStruct((eval_size,), jnp.float32),
    }
    state = abstract_state(config, task, model, train_batch)
    train_step, eval_step = steps.compile_steps(config, task, model, dp, state)
    placed = data_parallel.placed_shapes(state, dp.state_shardings(state))
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=dp.replicated)
    plans = {
        "train": (
            train_step,
            # model FLOPs: what remat recomputes is not counted
            functools.partial(
                task.train_step,
                config=config,
                model=performance.without_remat(model),
                axis_name=None,
            ),
            (placed, steps.placed_batch(train_batch, dp), rng),
            train_size,
        ),
        "eval": (
            eval_step,
            functools.partial(task.eval_step, config=config, model=model),
            (placed, steps.placed_batch(eval_batch, dp)),
            eval_size,
        ),
    }
    if hasattr(task, "sample_step"):
        sample = functools.partial(task.sample_step, config=config, model=model)
        plans["sample"] = (
            jax.jit(sample),
            sample,
            (placed, steps.placed_batch(eval_batch, dp), rng),
            eval_size,
        )
    names = [name for name in plans if only is None or name in only]
    mesh = {name: int(size) for name, size in dp.mesh.shape.items()}
    return mesh, [compile_program(name, *plans[name], target=target) for name in names]
