"""attnjax.models.multihead.MultiHeadAttention: projections and heads against torch's
scaled_dot_product_attention, incremental decoding against the full causal pass, dropout, JAX
transformations and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_close

from attnjax.models import multihead
from attnjax.ops import masks

F = torch.nn.functional


def test_mha_matches_manual_heads():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(2, 5, 12)).astype(np.float32)
    context = rng.normal(size=(2, 7, 6)).astype(np.float32)
    module = multihead.MultiHeadAttention(num_heads=3, head_dim=2, value_dim=5, out_features=4)
    variables = jax.jit(module.init)(jax.random.key(0), x, context)
    out, weights = jax.jit(lambda v: module.apply(v, x, context, return_weights=True))(variables)
    assert out.shape == (2, 5, 4) and weights.shape == (2, 3, 5, 7)

    p = jax.tree.map(np.asarray, variables["params"])
    assert p["query"]["kernel"].shape == (12, 6) and p["value"]["kernel"].shape == (6, 15)
    dense = lambda name, v: v @ p[name]["kernel"] + p[name]["bias"]  # noqa: E731
    q = dense("query", x).reshape(2, 5, 3, 2).transpose(0, 2, 1, 3)
    k = dense("key", context).reshape(2, 7, 3, 2).transpose(0, 2, 1, 3)
    v = dense("value", context).reshape(2, 7, 3, 5).transpose(0, 2, 1, 3)
    reference = F.scaled_dot_product_attention(*map(torch.tensor, (q, k, v))).numpy()
    expected = dense("out", reference.transpose(0, 2, 1, 3).reshape(2, 5, 15))
    assert_close(out, expected, what="MHA output")


def test_mha_decode_matches_full_causal_pass():
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.normal(size=(2, 9, 8)).astype(np.float32))
    module = multihead.MultiHeadAttention(num_heads=2, decode=True)
    variables = jax.jit(module.init)(jax.random.key(1), x)
    assert variables["cache"]["cached_key"].shape == (2, 9, 2, 4)
    full = jax.jit(lambda p: multihead.MultiHeadAttention(num_heads=2).apply(p, x, is_causal=True))(
        {"params": variables["params"]}
    )

    step = jax.jit(lambda v, chunk: module.apply(v, chunk, mutable=["cache"]))
    cache = variables["cache"]
    outputs = []
    for start, stop in [(0, 4)] + [(i, i + 1) for i in range(4, 9)]:  # prefill, then token by token
        out, updates = step({"params": variables["params"], "cache": cache}, x[:, start:stop])
        cache = updates["cache"]
        outputs.append(out)
    assert int(cache["cache_index"]) == 9
    assert_close(jnp.concatenate(outputs, axis=1), full, what="decode vs full causal")


def test_mha_decode_with_padding_mask_and_weights():
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.normal(size=(2, 6, 8)).astype(np.float32))
    keys_valid = masks.padding_mask(jnp.array([6, 4]), 6)[:, None, None, :]  # [batch, 1, 1, S]
    module = multihead.MultiHeadAttention(num_heads=2, head_dim=3, value_dim=5, decode=True)
    variables = jax.jit(module.init)(jax.random.key(2), x)
    full, full_weights = jax.jit(
        lambda p: multihead.MultiHeadAttention(num_heads=2, head_dim=3, value_dim=5).apply(
            p, x, mask=keys_valid, is_causal=True, return_weights=True
        )
    )({"params": variables["params"]})
    step = jax.jit(
        lambda v, chunk: module.apply(
            v, chunk, mask=keys_valid, return_weights=True, mutable=["cache"]
        )
    )
    cache, outputs, weights = variables["cache"], [], []
    for start, stop in [(0, 2), (2, 3), (3, 6)]:
        (out, w), updates = step({"params": variables["params"], "cache": cache}, x[:, start:stop])
        cache = updates["cache"]
        outputs.append(out)
        weights.append(w)
    assert_close(jnp.concatenate(outputs, axis=1), full, what="decode with padding")
    assert_close(
        jnp.concatenate(weights, axis=2),
        full_weights,
        what="decode weights [batch, heads, T, max_length]",
    )


def test_mha_dropout_uses_rng_only_when_training():
    x = jnp.ones((1, 4, 8))
    module = multihead.MultiHeadAttention(num_heads=2, dropout_rate=0.5)
    variables = jax.jit(module.init)(jax.random.key(0), x)
    eval_out, weights = jax.jit(lambda v: module.apply(v, x, return_weights=True))(variables)
    train = jax.jit(
        lambda rng: module.apply(variables, x, deterministic=False, rngs={"dropout": rng})
    )
    a, b = train(jax.random.key(1)), train(jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, eval_out)
    assert not np.allclose(a, train(jax.random.key(2)))
    assert_close(np.asarray(weights).sum(-1), np.ones((1, 2, 4)), what="eval weights sum to 1")


def test_mha_jit_grad_vmap():
    x = np.random.default_rng(9).normal(size=(4, 3, 4)).astype(np.float32)
    module = multihead.MultiHeadAttention(num_heads=2)
    params = jax.jit(module.init)(jax.random.key(0), x)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(module.apply(p, x) ** 2)))(params)
    assert set(grads["params"]) == {"query", "key", "value", "out"}
    assert all(np.abs(np.asarray(g)).sum() > 0 for g in jax.tree.leaves(grads))
    per_example = jax.jit(jax.vmap(lambda xi: module.apply(params, xi[None])[0]))(x)
    assert_close(per_example, jax.jit(module.apply)(params, x), what="vmap MHA")


def _mha(num_heads, *inputs, **kwargs):
    return multihead.MultiHeadAttention(num_heads=num_heads).init(
        jax.random.key(0), *inputs, **kwargs
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: _mha(3, jnp.ones((1, 2, 8))),
            r"num_heads=3 does not divide the query feature size 8",
        ),
        (
            lambda: _mha(2, jnp.ones((2, 8))),
            r"inputs_q must be \[batch, length, features\], got shape \(2, 8\)",
        ),
        (
            lambda: _mha(2, jnp.ones((1, 2, 8)), jnp.ones((1, 3, 8)), jnp.ones((1, 4, 8))),
            r"batch/length mismatch: inputs_q shape \(1, 2, 8\), inputs_k shape \(1, 3, 8\)",
        ),
        (
            lambda: _mha(2, jnp.ones((1, 2, 8)), mask=jnp.ones((3, 2, 2), bool)),
            r"mask of shape \(3, 2, 2\) does not broadcast to \(1, 2, 2, 2\)",
        ),
    ],
)
def test_bad_inputs_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()
