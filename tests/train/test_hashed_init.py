"""attnjax/train/hashed_init.py: the tasks' initialisations with their hashes batched give the
plain initialisation's values bit for bit, in a program with fewer hash loops."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import load_config, tiny_vit

from attnjax.models import gpt
from attnjax.tasks import classification
from attnjax.tasks import vqgan as vqgan_task
from attnjax.train import hashed_init


def loops(fn, *args) -> int:
    """The while loops of ``fn``'s lowered program: on a CPU, one per Threefry hash call."""
    return jax.jit(fn).lower(*args).as_text().count("stablehlo.while")


def assert_bitwise_equal(fn, *args):
    """``hashed_together(fn)`` against ``fn``, each jitted: the same tree, the same bits.
    -> (loops of fn, loops of the batched fn)."""
    batched = hashed_init.hashed_together(fn)
    expected, actual = jax.jit(fn)(*args), jax.jit(batched)(*args)
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for path, value in jax.tree_util.tree_leaves_with_path(expected):
        got = np.asarray(dict(jax.tree_util.tree_leaves_with_path(actual))[path])
        assert got.dtype == value.dtype and got.shape == value.shape, path
        np.testing.assert_array_equal(got.view(np.uint8), np.asarray(value).view(np.uint8))
    return loops(fn, *args), loops(batched, *args)


def vqgan_inits():
    config = load_config("vqgan_digits")
    config.loss.disc_weight = 0.8  # with its PatchGAN discriminator
    model = vqgan_task.create_model(config)
    return [vqgan_task._keyed(model["autoencoder"].init, 0).__wrapped__,
            vqgan_task._keyed(model["discriminator"].init, 1).__wrapped__]  # fmt: skip


def test_the_vqgans_autoencoder_and_discriminator_inits_are_bitwise_the_plain_ones():
    images = jax.random.uniform(jax.random.PRNGKey(3), (4, 16, 16, 1), minval=-1.0, maxval=1.0)
    autoencoder, discriminator = vqgan_inits()
    plain, batched = assert_bitwise_equal(autoencoder, jax.random.PRNGKey(7), images)
    # A hash per parameter and per key folded in (13 loops, some shared by equal shapes) ->
    # as many as the longest chain of keys.
    assert batched <= 3 < plain, (plain, batched)
    assert_bitwise_equal(discriminator, jax.random.PRNGKey(7), images)  # ActNorm: data-dependent


def test_the_vit_and_gpt_inits_are_bitwise_the_plain_ones_under_either_threefry():
    vit = classification.create_model(tiny_vit(load_config("vit_digits")))
    prior = gpt.GPT(vocab_size=20, block_size=16, n_layer=2, n_head=2, n_embd=16)
    for partitionable in (False, True, False):  # its random bits differ: no program kept across
        with jax.threefry_partitionable(partitionable):
            plain, batched = assert_bitwise_equal(
                lambda r, x: vit.init(r, x, train=False)["params"],
                jax.random.PRNGKey(1),
                jnp.zeros((1, 16, 16, 1)),
            )
            assert batched < plain
            assert_bitwise_equal(
                lambda r, x: prior.init(r, x)["params"],
                jax.random.PRNGKey(2),
                jnp.zeros((1, 16), jnp.int32),
            )


def compiled_loops(fn, *args) -> int:
    """The while loops XLA compiled ``fn`` into (the lowered program calls one function per
    distinct hash shape, which XLA then inlines at every call)."""
    return jax.jit(fn).lower(*args).compile().as_text().count(" while(")


def test_large_draws_of_one_shape_share_a_loop_and_a_program_it_cannot_rewrite_runs_as_it_is():
    size = hashed_init.LARGEST_BATCHED + 1

    def drawing(blocks: int):
        def draws(key):
            first, second = jax.random.split(key)
            return {
                "large": jax.random.normal(first, (size,)),
                "small": jax.random.uniform(jax.random.fold_in(second, 3), (5, 7)),
                "chained": jax.random.bits(jax.random.fold_in(jax.random.fold_in(key, 1), 2), (9,)),
                # ViT blocks' matrices: one shape, a key each.
                "blocks": [
                    jax.random.normal(jax.random.fold_in(key, i), (2, size)) for i in range(blocks)
                ],
            }

        return draws

    for partitionable in (False, True):  # the bits under either; the loops under the default
        with jax.threefry_partitionable(partitionable):
            assert_bitwise_equal(drawing(5), jax.random.PRNGKey(0))
    # As written, a loop per large draw; batched, the blocks' draws are one loop over them
    # around one hash loop, however many blocks.
    plain, batched = (
        [compiled_loops(wrap(drawing(n)), jax.random.PRNGKey(0)) for n in (2, 5)]
        for wrap in (lambda fn: fn, hashed_init.hashed_together)
    )
    assert plain[1] >= plain[0] + 3 and batched[1] == batched[0] < plain[0], (plain, batched)

    def folded(key):  # a typed key comes in as its data
        return [jax.random.normal(jax.random.fold_in(key, i), (3, i + 1)) for i in range(4)]

    plain, batched = assert_bitwise_equal(folded, jax.random.key(0))
    assert batched < plain

    def typed_keys(seed):  # a slice of a key array: not a key operation the rewrite expands
        keys = jax.random.split(jax.random.key(seed), 3)
        return jax.random.normal(keys[1], (4,))

    plain, batched = assert_bitwise_equal(typed_keys, jnp.uint32(5))
    assert batched == plain
