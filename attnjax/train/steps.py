"""A run's train and eval steps: jitted for its mesh (``compile``), kept as compiled under jit so
that a repeated run loads them (``kept``, attnjax/train/executables.py), and a train step not kept
yet compiled on a thread ahead of its first call, from the shapes of a batch (``placed_batch``):
XLA compiles while the caller reads the data and builds the initial state."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np

from attnjax.ops import autotune
from attnjax.parallel import data_parallel
from attnjax.train import executables


def compile_steps(config, task, model, dp, state) -> tuple[Callable, Callable]:
    """The jitted ``train_step(state, batch, rng)`` and ``eval_step(state, batch)``; ``state``
    may be abstract (``jax.ShapeDtypeStruct``s: only its layout is read)."""
    train_step = dp.compile_train_step(
        functools.partial(task.train_step, config=config, model=model),
        dp.state_shardings(state) if dp.mode == "jit" else None,
        data_parallel.train_step_compiler_options(config, dp.mesh) if dp.mode == "jit" else None,
    )
    eval_step = dp.compile_eval_step(functools.partial(task.eval_step, config=config, model=model))
    return train_step, eval_step


def kept(config, task, model, dp, state, ahead=None) -> tuple[Callable, Callable]:
    """The train and eval steps for ``state`` (values or shapes); under jit kept, so that a
    repeated run loads them as compiled. ``ahead``, ``(placed_batch(a train batch), a host
    key)``: a train step not kept yet compiles on a thread from here, its CPU kernel choices
    timed first on idle cores (its first call waits for it)."""
    train_step, eval_step = compile_steps(config, task, model, dp, state)
    if dp.mode != "jit":
        return train_step, eval_step
    identity = executables.identity_of(config, task)
    train_step, eval_step = executables.cached_steps(identity, train_step, eval_step)
    if ahead and hasattr(train_step, "prepare"):  # not with the cache off, nor multi-process
        with autotune.timing_window():  # a step's key is a host key like the run's
            train_step.prepare(state, ahead[0], np.zeros_like(ahead[1]))
    return train_step, eval_step


def placed_batch(batch, dp) -> dict:
    """A process's batch (arrays or ``jax.ShapeDtypeStruct``s) as a jitted step takes it:
    ``jax.ShapeDtypeStruct``s of the global batch on ``dp``'s mesh, 64-bit host values narrowed
    as JAX narrows them (the program a call of that batch looks up)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            (x.shape[0] * jax.process_count(), *x.shape[1:]),
            jax.dtypes.canonicalize_dtype(x.dtype),
            sharding=dp.batch_sharding,
        ),
        batch,
    )
