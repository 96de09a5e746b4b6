"""attnjax/train/keys.py: the run's keys and the step keys are JAX's split and fold_in of the
seed's key, bit for bit."""

import jax
import ml_collections
import numpy as np

from attnjax.train import keys


def test_run_keys_are_the_split_of_the_seeds_key():
    for seed in (0, 7, 2**31 - 1, -3):
        config = ml_collections.ConfigDict({"seed": seed})
        expected = np.asarray(jax.random.split(jax.random.PRNGKey(seed)))
        init_rng, train_rng = keys.run_keys(config)
        np.testing.assert_array_equal(init_rng, expected[0])
        np.testing.assert_array_equal(train_rng, expected[1])


def test_step_keys_from_host_memory_are_the_per_step_fold_in():
    train_rng = jax.random.split(jax.random.PRNGKey(7))[1]
    step_keys = keys.StepKeys(ml_collections.ConfigDict({"seed": 7}), train_rng, chunk=8)
    # In order, across chunk boundaries, then backwards and far ahead (a resumed run starts
    # anywhere).
    for index in list(range(20)) + [3, 1000, 999, 7]:
        np.testing.assert_array_equal(
            step_keys(index), np.asarray(jax.random.fold_in(train_rng, index))
        )
