"""The run's random keys: ``(init_rng, train_rng)`` from the config's seed, and step ``i``'s key
``fold_in(train_rng, i)``, each from a kept program (``attnjax.train.executables``) so that a
repeated run compiles none of the small programs they would otherwise take, and delivered as
host arrays."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from attnjax.train import executables


class StepKeys:
    """``fold_in(train_rng, i)`` for step ``i``, computed ``chunk`` steps at a time into host
    memory.

    A key made on the device per step is a small computation queued behind the running step, and
    the loop waits for it before it can dispatch the next one; keys from host memory let the
    loop run ahead of the device, as it does with batches. Same keys as folding in one by one.
    One kept program (``executables``): a repeated run loads it instead of compiling it."""

    def __init__(self, config, train_rng, chunk: int):
        self.train_rng = train_rng
        self.chunk = max(int(chunk), 1)
        self.first, self.keys = None, None
        self.fold = executables.jit(config, "step_keys", functools.partial(_fold, size=self.chunk))

    def __call__(self, index: int) -> np.ndarray:
        if self.first is None or not self.first <= index < self.first + self.chunk:
            self.first = index
            self.keys = np.asarray(self.fold(self.train_rng, np.uint32(index)))
        return self.keys[index - self.first]


def _fold(rng, first, *, size: int):
    steps = first + jnp.arange(size, dtype=jnp.uint32)
    return jax.vmap(lambda i: jax.random.fold_in(rng, i))(steps)


def run_keys(config) -> tuple[np.ndarray, np.ndarray]:
    """``(init_rng, train_rng)``: ``jax.random.split(jax.random.PRNGKey(config.seed))`` as host
    arrays, from one kept program rather than three small ones compiled by every start."""
    split = executables.jit(
        config, "run_keys", lambda seed: jax.random.split(jax.random.PRNGKey(seed))
    )
    keys = np.asarray(split(np.int32(config.seed)))
    return keys[0], keys[1]
