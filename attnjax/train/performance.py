"""How much of its devices a run uses: FLOPs per train step, model FLOPs utilisation (MFU), and
profiler traces of chosen steps.

FLOPs per step are those of the train step's matrix products and convolutions, counted on its
jaxpr (``product_flops``: the whole global batch, loops times their lengths, kernels times their
grids), the model FLOPs MFU is defined by and the count ``attnjax.compile`` predicts with, so a
measured MFU and a predicted one divide the same numerator. The denominator is
the devices' peak (``attnjax.train.accelerators.peak_flops``): a chip's bf16 peak from its table,
``config.peak_flops`` when set, and on a CPU a float32 matrix product timed on this machine.

``config.profile_steps = "100:110"`` writes a ``jax.profiler`` trace of steps 100 to 109 (a
Python range) to ``<workdir>/profile``, for TensorBoard's profile plugin or Perfetto.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable

import jax
import jax.extend
from absl import logging

from attnjax import storage
from attnjax.train import accelerators, executables

NOTE = f".flops{executables.NOTE_SUFFIX}"  # the count's file beside a kept step


class Throughput:
    """Training steps per second, timed from one log (after its evaluation and save) to the
    next: the first interval, which includes compilation, counts only if no later one comes."""

    def __init__(self, start: int, num_steps: int):
        self.start, self.num_steps = start, num_steps
        self.seconds, self.steps, self.tick = 0.0, 0, time.perf_counter()

    def add(self, step: int, count: int) -> None:
        """At a log: ``count`` steps ran since the last."""
        if step > self.start + count or step == self.num_steps:
            self.seconds += time.perf_counter() - self.tick
            self.steps += count

    def restart(self) -> None:
        self.tick = time.perf_counter()


def trace_for_host(function: Callable, *args):
    """``function`` jitted and traced for the host CPU (``args`` may be arrays or
    ``jax.ShapeDtypeStruct``s; their placement is dropped): a ``jax.stages.Traced``
    (``.jaxpr``, ``.lower()``)."""
    bare = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    with jax.default_device(jax.devices("cpu")[0]):
        return jax.jit(function).trace(*bare)


def lowered_flops(lowered) -> float | None:
    """XLA's FLOP count of a ``jax.stages.Lowered`` (elementwise work too; a loop's body once)."""
    cost = lowered.cost_analysis()
    return float(cost["flops"]) if cost and cost.get("flops", 0) > 0 else None


def traced_flops(function: Callable, *args) -> float:
    """``product_flops`` of ``function(*args)`` traced for the host (``trace_for_host``)."""
    return product_flops(trace_for_host(function, *args).jaxpr)[0]


def _dot_flops(eqn) -> float:
    """2 x every multiply-add of a ``dot_general``: the left operand's size times the right
    operand's dimensions that are neither contracted nor batched."""
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
    free = [d for i, d in enumerate(rhs) if i not in (*rhs_contract, *rhs_batch)]
    return 2.0 * math.prod(lhs) * math.prod(free)


def _conv_flops(eqn) -> float:
    """2 x output size x one output's multiply-adds (the kernel over its output-feature axis)."""
    out = eqn.outvars[0].aval.shape
    kernel = eqn.invars[1].aval.shape
    out_features = kernel[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2.0 * math.prod(out) * math.prod(kernel) / out_features


def product_flops(jaxpr) -> tuple[float, bool]:
    """``(FLOPs, whether some were in a loop of unknown length)`` of the matrix products and
    convolutions of ``jaxpr``: model FLOPs as MFU counts them. A ``scan`` counts its body times
    its length, a Pallas kernel its body times its grid, a ``cond`` its costliest branch; a
    ``while`` loop's body once (its trip count is a runtime value)."""
    inner = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr
    total, unknown = 0.0, False
    for eqn in inner.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot_flops(eqn)
            continue
        if name == "conv_general_dilated":
            total += _conv_flops(eqn)
            continue
        counts = [product_flops(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params)]
        if not counts:
            continue
        flops = [c[0] for c in counts]
        unknown = unknown or any(c[1] for c in counts)
        if name == "cond":
            total += max(flops)
        elif name == "scan":
            total += eqn.params["length"] * sum(flops)
        elif name == "pallas_call":
            total += math.prod(eqn.params["grid_mapping"].grid) * sum(flops)
        else:
            total += sum(flops)
            unknown = unknown or (name == "while" and sum(flops) > 0)
    return total, unknown


def without_remat(model):
    """``model`` (a module, or a dict of them as a task's ``create_model`` may return) with
    ``remat=False`` wherever it was on; the same object where nothing changes. A step's
    recomputed forward passes are not model FLOPs, which MFU counts."""
    if isinstance(model, dict):
        plain = {name: without_remat(module) for name, module in model.items()}
        return model if all(plain[name] is model[name] for name in model) else plain
    if getattr(model, "remat", False):
        return model.clone(remat=False)
    return model


def peak_of(devices, config=None) -> tuple[float, str]:
    """``(FLOP/s of all ``devices`` together, its source)``. A CPU's rate is measured for the
    whole machine (one product uses every core), so CPU devices are not added up."""
    peak, source = accelerators.peak_flops(devices[0], config)
    if accelerators.chip_of(devices[0]) is None and not (config and config.get("peak_flops")):
        return peak, source
    return peak * len(devices), f"{len(devices)} x {source}"


class Utilization:
    """``train/tflops_per_device`` and ``train/mfu`` from the steps per second at a log.

    The FLOPs per step come from ``count`` (the jitted train step traced again for arguments of
    the shapes it ran on: a hit in jit's trace cache, milliseconds, where the run traced the
    step; a whole trace, 2.5-4.4 s for ViT-B/16, where it loaded the step compiled, hence the
    count kept beside the step) or are given."""

    def __init__(self, devices, config=None, flops_per_step: float | None = None):
        self.devices, self.config = list(devices), config
        self.flops_per_step, self.peak, self.source = None, None, ""
        if flops_per_step:
            self._set(flops_per_step)

    def _set(self, flops_per_step: float) -> None:
        self.flops_per_step = flops_per_step
        self.peak, self.source = peak_of(self.devices, self.config)
        logging.info(
            "MFU: %.3g FLOP per step against %.3g FLOP/s (%s)",
            flops_per_step,
            self.peak,
            self.source,
        )

    def count(self, jitted_step, *args, kept_by=None) -> None:
        """Counts the products of ``jitted_step(*args)`` (``jax.jit``-ed; once). ``kept_by``: the
        run's step as ``attnjax.train.executables`` keeps it, beside which the count is kept: a
        run that loads its step compiled reads the count instead of tracing the step again."""
        if self.flops_per_step is not None or not hasattr(jitted_step, "trace"):
            return
        kept = kept_by.beside(NOTE, *args) if hasattr(kept_by, "beside") else None
        if kept is not None:
            try:
                self._set(float(kept.read_text()))
                return
            except (OSError, ValueError):  # none kept yet, or damaged: counted and written again
                pass
        self._set(product_flops(jitted_step.trace(*args).jaxpr)[0])
        if kept is not None:
            try:
                storage.write_atomic(kept, repr(self.flops_per_step))
            except OSError as error:  # a full disk: the next run counts again
                logging.warning("%s not written: %s", kept, error)

    def scalars(self, steps_per_sec: float) -> dict:
        if not self.flops_per_step:
            return {}
        rate = self.flops_per_step * steps_per_sec
        return {
            "train/tflops_per_device": rate / len(self.devices) / 1e12,
            "train/mfu": rate / self.peak,
        }


def parse_steps(text: str) -> range | None:
    """``"100:110"`` -> ``range(100, 110)``; ``""`` -> None."""
    if not text:
        return None
    first, sep, stop = str(text).partition(":")
    try:
        steps = range(int(first), int(stop)) if sep else range(int(first), int(first) + 1)
    except ValueError:
        steps = range(0)
    if not steps or steps.start < 1:
        raise ValueError(
            f"config.profile_steps={text!r} is not 'first:stop' with 1 <= first < stop "
            "(steps first .. stop - 1 are traced)."
        )
    return steps


class ProfileWindow:
    """Starts a ``jax.profiler`` trace before the first of ``config.profile_steps`` and stops it
    once the last has finished on the device."""

    def __init__(self, config, workdir: str, enabled: bool = True):
        self.steps = parse_steps(config.get("profile_steps", "")) if enabled else None
        self.directory = os.path.join(workdir, "profile")
        self.active = False

    def before(self, step: int) -> None:
        if self.steps is not None and step == self.steps.start and not self.active:
            jax.profiler.start_trace(self.directory)
            self.active = True

    def after(self, step: int, state) -> None:
        if self.active and step == self.steps[-1]:
            jax.block_until_ready(state)
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            logging.info("profile of steps %s written to %s", self.steps, self.directory)
