"""XLA:CPU set up for speed, in one place: the flags every attnjax command and library import
hands XLA before its backend starts.

Importing ``attnjax`` calls ``configure()``: the flags ``compat.xla_cpu_speed_flags()`` picks for
the installed jaxlib are added to ``$XLA_FLAGS``, except any the user's own ``$XLA_FLAGS`` sets
already (theirs wins), and none at all with ``ATTNJAX_XLA_CPU_FLAGS=0`` (XLA's own defaults, to
measure them). XLA reads ``$XLA_FLAGS`` once, when its first backend starts: a process that
used a device before importing attnjax keeps the flags it started with. The measurements behind
each flag, per operation family and jaxlib: benchmarks/results/xla_cpu_flags.md
(``benchmarks/xla_cpu_flags.py``).

This module reads versions from package metadata and never imports jax, so that it can run
before jax does.
"""

from __future__ import annotations

import os
import sys

from attnjax import compat

SWITCH = "ATTNJAX_XLA_CPU_FLAGS"
# Above this many output elements a run-once program compiles as XLA's defaults have it: the
# run-once options save 0.9-4.4 s of compiling whatever the model's size, while unoptimised code
# draws each initial value about 47 ns slower (ViT-B/16's 87M parameters in 4.6 s instead of
# 0.7 s: 2.7 s lost; ViT-S/16's 22M: 1.2 s saved, within this VM's spread). Up to 8M elements
# (at most 0.4 s of running) the unoptimised one is sooner (benchmarks/results/run_once.md).
RUN_ONCE_MAX_ELEMENTS = 1 << 23
RUN_ONCE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_parallel_codegen_split_count": 1}


def _name(flag: str) -> str:
    return flag.split("=", 1)[0]


def merged(xla_flags: str, flags: list[str]) -> str:
    """``xla_flags`` with each of ``flags`` appended whose name it does not set already."""
    given = {_name(flag) for flag in xla_flags.split()}
    return " ".join([*xla_flags.split(), *(f for f in flags if _name(f) not in given)])


def configure() -> list[str]:
    """Adds attnjax's XLA:CPU flags to ``$XLA_FLAGS`` -> the flags added (``[]`` where the switch
    is off, the user set each one, or a backend is running already)."""
    if os.environ.get(SWITCH, "1") == "0" or _backend_started():
        return []
    before = os.environ.get("XLA_FLAGS", "")
    after = merged(before, compat.xla_cpu_speed_flags())
    os.environ["XLA_FLAGS"] = after
    return after.split()[len(before.split()) :]


def in_effect() -> str:
    """The ``$XLA_FLAGS`` XLA read when its backend started (what a run's log records), provided
    nothing changed the variable since."""
    return os.environ.get("XLA_FLAGS", "")


def _backend_started() -> bool:
    """Whether this process started an XLA backend already (jax imported and a device used):
    flags set now would be ignored, and the log would then name flags XLA never read."""
    if "jax" not in sys.modules:
        return False
    return compat.xla_backends_started()


def run_once_options(output_elements: int) -> dict | None:
    """XLA compiler options for a CPU program that a run calls once (a model's initialisation,
    its optimiser's zeros, the run's keys) and whose outputs hold ``output_elements``: LLVM's
    optimisation off, the loop emitters where jaxlib has them, and the code generated on the
    compiling thread, not in parts on XLA's shared pool, where they would wait behind the train
    step's compile. Such programs compile in a fraction of the time and leave the cores to the
    train step compiling beside them; their outputs agree with the default's to float32
    rounding. None (XLA's defaults) above ``RUN_ONCE_MAX_ELEMENTS``."""
    if output_elements > RUN_ONCE_MAX_ELEMENTS:
        return None
    options = dict(RUN_ONCE_OPTIONS)
    for flag in compat.xla_cpu_loop_emitter_flags():
        name, value = flag.removeprefix("--").split("=", 1)
        options[name] = {"true": True, "false": False}.get(value, value)
    return options
