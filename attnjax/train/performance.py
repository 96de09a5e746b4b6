"""How much of its devices a run uses: FLOPs per train step, model FLOPs utilisation (MFU), and
profiler traces of chosen steps.

FLOPs per step are XLA's count of the train step as traced (``traced_flops``: lowered for the
host CPU before optimisation, the whole global batch), the same count ``attnjax.compile``
reports, so a measured MFU and a predicted one divide the same numerator. The denominator is
the devices' peak (``attnjax.train.accelerators.peak_flops``): a chip's bf16 peak from its table,
``config.peak_flops`` when set, and on a CPU a float32 matrix product timed on this machine.

``config.profile_steps = "100:110"`` writes a ``jax.profiler`` trace of steps 100 to 109 (a
Python range) to ``<workdir>/profile``, for TensorBoard's profile plugin or Perfetto.
"""

from __future__ import annotations

import os
from typing import Callable

import jax
import jax.extend
from absl import logging

from attnjax.train import accelerators


def trace_for_host(function: Callable, *args):
    """``function`` jitted and traced for the host CPU (``args`` may be arrays or
    ``jax.ShapeDtypeStruct``s; their placement is dropped): a ``jax.stages.Traced``
    (``.jaxpr``, ``.lower()``)."""
    bare = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    with jax.default_device(jax.devices("cpu")[0]):
        return jax.jit(function).trace(*bare)


def lower_for_host(function: Callable, *args):
    """``trace_for_host(...).lower()``: a ``jax.stages.Lowered`` for the host CPU."""
    traced = trace_for_host(function, *args)
    with jax.default_device(jax.devices("cpu")[0]):
        return traced.lower()


def loops_products(jaxpr) -> bool:
    """Whether a loop (``while``, ``scan``) of ``jaxpr`` runs matrix products or convolutions:
    XLA counts a loop body's FLOPs once, so such a program's count is short. (Random bits are
    loops too, without products.)"""

    def has_products(inner) -> bool:
        return any(
            eqn.primitive.name in ("dot_general", "conv_general_dilated")
            or any(has_products(sub) for sub in jax.extend.core.jaxprs_in_params(eqn.params))
            for eqn in inner.eqns
        )

    def walk(inner) -> bool:
        for eqn in inner.eqns:
            subs = list(jax.extend.core.jaxprs_in_params(eqn.params))
            if eqn.primitive.name in ("while", "scan") and any(has_products(s) for s in subs):
                return True
            if any(walk(sub) for sub in subs):
                return True
        return False

    return walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)


def lowered_flops(lowered) -> float | None:
    cost = lowered.cost_analysis()
    return float(cost["flops"]) if cost and cost.get("flops", 0) > 0 else None


def traced_flops(function: Callable, *args) -> float | None:
    """XLA's FLOP count of ``function(*args)`` lowered for the host CPU (``lower_for_host``);
    None where XLA gives none. A ``while`` loop's body counts once."""
    return lowered_flops(lower_for_host(function, *args))


def peak_of(devices, config=None) -> tuple[float, str]:
    """``(FLOP/s of all ``devices`` together, its source)``. A CPU's rate is measured for the
    whole machine (one product uses every core), so CPU devices are not added up."""
    peak, source = accelerators.peak_flops(devices[0], config)
    if accelerators.chip_of(devices[0]) is None and not (config and config.get("peak_flops")):
        return peak, source
    return peak * len(devices), f"{len(devices)} x {source}"


class Utilization:
    """``train/tflops_per_device`` and ``train/mfu`` from the steps per second at a log."""

    def __init__(self, flops_per_step: float | None, devices, config=None):
        self.flops_per_step, self.devices = flops_per_step, len(devices)
        self.peak, self.source = peak_of(devices, config) if flops_per_step else (None, "")
        if flops_per_step:
            logging.info(
                "MFU: %.3g FLOP per step against %.3g FLOP/s (%s)",
                flops_per_step,
                self.peak,
                self.source,
            )

    def scalars(self, steps_per_sec: float) -> dict:
        if not self.flops_per_step:
            return {}
        rate = self.flops_per_step * steps_per_sec
        return {
            "train/tflops_per_device": rate / self.devices / 1e12,
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
