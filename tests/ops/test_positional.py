"""attnjax.ops.positional against the written formula, timm's resampling and Flax's
transformations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_close
from timm.layers import resample_abs_pos_embed

from attnjax.models import position_embedding
from attnjax.ops import positional


def formula(positions, dim, base=10000.0):
    """PE[pos, 2i] = sin(pos / base^(2i/dim)), PE[pos, 2i+1] = cos(same), in float64, entry by
    entry."""
    table = np.zeros((len(positions), dim))
    for row, pos in enumerate(positions):
        for column in range(dim):
            two_i = column - column % 2
            angle = pos / base ** (two_i / dim)
            table[row, column] = np.sin(angle) if column % 2 == 0 else np.cos(angle)
    return table


@pytest.mark.parametrize(
    "length, dim, base", [(1, 1, 10000.0), (50, 16, 10000.0), (7, 5, 10000.0), (33, 6, 100.0)]
)
def test_sinusoidal_matches_formula(length, dim, base):
    ours = positional.sinusoidal_encoding(length, dim, base)
    assert ours.shape == (length, dim) and ours.dtype == jnp.float32
    # float32 angles: |error| <= pos * 2^-24 for positions < 64
    np.testing.assert_allclose(ours, formula(range(length), dim, base), rtol=1e-5, atol=1e-5)


def test_sinusoidal_worked_example_follows_the_formula():
    # A worked example with PE_1 = [0.8415, 0.5403, 0.0001, 1.0000] for d=4 circulates; the
    # formula's third entry is sin(1 / 10000^(2/4)) = sin(0.01) = 0.0100. The formula wins.
    pe1 = np.asarray(positional.sinusoidal_encoding(2, 4)[1])
    np.testing.assert_allclose(pe1, [0.8415, 0.5403, 0.0100, 1.0000], atol=1e-4)
    assert abs(pe1[2] - 0.0001) > 5e-3


def test_sincos_2d_is_row_then_column_encoding():
    ours = np.asarray(positional.sincos_2d_encoding(3, 4, 8))
    assert ours.shape == (12, 8)
    rows, cols = np.divmod(np.arange(12), 4)  # token r * grid_w + c
    expected = np.concatenate([formula(rows, 4), formula(cols, 4)], axis=1)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)


def test_learned_position_embedding_adds_its_parameter():
    module = position_embedding.LearnedPositionEmbedding()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 3)), jnp.float32)
    variables = module.init(jax.random.key(0), x)
    table = variables["params"]["pos_embedding"]
    assert table.shape == (1, 5, 3)
    assert 0.005 < float(jnp.std(table)) < 0.05
    assert_close(
        module.apply(variables, x), np.asarray(x) + np.asarray(table), what="x + pos_embedding"
    )
    with pytest.raises(
        ValueError, match=r"inputs of shape \(2, 6, 3\) do not match pos_embedding \(1, 5, 3\)"
    ):
        module.apply(variables, jnp.ones((2, 6, 3)))


@pytest.mark.parametrize("method", ["bicubic", "bilinear"])
@pytest.mark.parametrize("new_grid", [(6, 6), (3, 5), (4, 4)])
def test_resize_matches_timm(method, new_grid):
    posemb = np.random.default_rng(1).normal(size=(1, 1 + 16, 8)).astype(np.float32)
    ours = positional.resize_position_embedding(
        posemb, new_grid, num_prefix_tokens=1, method=method
    )
    theirs = resample_abs_pos_embed(
        torch.tensor(posemb), list(new_grid), num_prefix_tokens=1, interpolation=method
    )
    assert ours.shape == (1, 1 + new_grid[0] * new_grid[1], 8)
    np.testing.assert_array_equal(ours[:, :1], posemb[:, :1])
    assert_close(ours, theirs.numpy(), rtol=1e-5, atol=2e-6, what=f"{method} resize")


def test_resize_rectangular_grid_without_prefix():
    posemb = np.random.default_rng(2).normal(size=(1, 2 * 3, 4)).astype(np.float32)
    ours = positional.resize_position_embedding(
        posemb, (4, 6), num_prefix_tokens=0, method="bilinear", old_grid_hw=(2, 3)
    )
    theirs = resample_abs_pos_embed(
        torch.tensor(posemb), [4, 6], old_size=[2, 3], num_prefix_tokens=0, interpolation="bilinear"
    )
    assert_close(ours, theirs.numpy(), what="rectangular resize")


def test_jit_grad_vmap_through_positional():
    sin = jax.jit(positional.sinusoidal_encoding, static_argnums=(0, 1))
    assert_close(sin(9, 6), positional.sinusoidal_encoding(9, 6), what="jit")
    # d PE[pos, 2i] / d base = cos(angle) * angle * (-2i/dim) / base
    grad = jax.jit(jax.grad(lambda b: positional.sinusoidal_encoding(4, 4, b)[3, 2]))(100.0)
    angle = 3 / 100.0**0.5
    assert_close(grad, np.cos(angle) * angle * (-0.5) / 100.0, what="d PE / d base")
    bases = jnp.array([100.0, 10000.0])
    assert_close(
        jax.jit(jax.vmap(lambda b: positional.sincos_2d_encoding(2, 2, 4, b)))(bases)[1],
        positional.sincos_2d_encoding(2, 2, 4),
        what="vmap over base",
    )
    posemb = jnp.ones((1, 1 + 4, 2))
    resize = jax.jit(positional.resize_position_embedding, static_argnums=(1,))
    assert resize(posemb, (3, 3)).shape == (1, 10, 2)
    stacked = jnp.stack([posemb, 2 * posemb])
    resized = jax.jit(jax.vmap(lambda p: positional.resize_position_embedding(p, (3, 3))))(stacked)
    assert_close(resized[1], 2 * np.asarray(resize(posemb, (3, 3))), what="vmap resize")
    resized_sum = lambda p: positional.resize_position_embedding(p, (3, 3), method="bilinear").sum()
    grad = jax.jit(jax.grad(resized_sum))(posemb)
    # bilinear weights sum to one per output pixel: 9 outputs spread over 4 inputs, prefix 1
    assert_close(grad[0, 1:].sum(0), [9.0, 9.0], what="resize gradient mass")
    module = position_embedding.LearnedPositionEmbedding()
    x = jnp.ones((3, 4, 2))
    variables = jax.jit(module.init)(jax.random.key(0), x)
    per_example = jax.jit(jax.vmap(lambda xi: module.apply(variables, xi[None])[0]))(x)
    assert_close(
        per_example,
        np.asarray(x) + np.asarray(variables["params"]["pos_embedding"]),
        what="vmap module",
    )
    grads = jax.jit(jax.grad(lambda v: module.apply(v, x).sum()))(variables)
    assert_close(
        grads["params"]["pos_embedding"], np.full((1, 4, 2), 3.0), what="d sum / d pos_embedding"
    )


resize = positional.resize_position_embedding


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: positional.sinusoidal_encoding(0, 4), r"length must be a positive int, got 0"),
        (lambda: positional.sinusoidal_encoding(4, 2.5), r"dim must be a positive int, got 2.5"),
        (lambda: positional.sincos_2d_encoding(2, 2, 7), r"dim must be even"),
        (lambda: resize(np.ones((1, 1 + 6, 4)), (3, 3)), r"6 grid tokens .* not a square grid"),
        (lambda: resize(np.ones((1, 5, 4)), (3, 3), method="area"), r"method must be one of"),
        (
            lambda: resize(np.ones((5, 4)), (3, 3)),
            r"posemb must be \[1, tokens, dim\], got shape \(5, 4\)",
        ),
        (
            lambda: resize(np.ones((1, 7, 4)), (3, 3), old_grid_hw=(2, 2)),
            r"old_grid_hw=\(2, 2\) does not match the 6 grid tokens",
        ),
        (
            lambda: resize(np.ones((1, 5, 4)), (0, 3)),
            r"new_grid_hw\[0\] must be a positive int, got 0",
        ),
    ],
)
def test_bad_inputs_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()
