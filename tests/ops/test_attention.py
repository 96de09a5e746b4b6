"""attnjax.ops.attention against torch.nn.functional.scaled_dot_product_attention and by
construction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

from attnjax.ops import attention, masks

F = torch.nn.functional
# Jitted once per shape: one XLA compile per test case instead of one per eager op.
SDPA = jax.jit(
    attention.scaled_dot_product_attention,
    static_argnames=("is_causal", "scale", "dropout_rate", "return_weights"),
)


def torch_sdpa(query, key, value, mask=None, is_causal=False, scale=None):
    """PyTorch reference; a boolean/float numpy mask is passed as ``attn_mask``."""
    args = [torch.tensor(np.asarray(x)) for x in (query, key, value)]
    attn_mask = None if mask is None else torch.tensor(np.asarray(mask))
    return F.scaled_dot_product_attention(
        *args, attn_mask=attn_mask, is_causal=is_causal, scale=scale
    )


def fully_masked_rows(mask, is_causal, shape_ls):
    """Boolean ``[..., L]`` of query rows that may attend to nothing, from the numpy mask."""
    keep = np.ones(shape_ls, dtype=bool)
    if mask is not None:
        keep = keep & (mask if mask.dtype == bool else ~np.isneginf(mask))
    if is_causal:
        keep = keep & np.tril(np.ones(shape_ls[-2:], dtype=bool))
    return ~keep.any(-1)


def random_mask(rng, kind, shape):
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random(shape) > 0.3
    mask = rng.normal(size=shape).astype(np.float32)
    return np.where(rng.random(shape) > 0.3, mask, -np.inf).astype(np.float32)


# --------------------------------------------------------------------------------------------
# scaled_dot_product_attention == PyTorch
# --------------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    leading=st.sampled_from([(), (3,), (2, 3), (2, 1), (1, 2, 2)]),
    key_leading_ones=st.booleans(),
    length=st.integers(1, 6),
    key_length=st.integers(1, 7),
    depth=st.integers(1, 8),
    value_depth=st.integers(1, 8),
    mask_kind=st.sampled_from(["none", "bool", "float"]),
    mask_leading=st.sampled_from(["full", "ones", "none"]),
    is_causal=st.booleans(),
    scale=st.sampled_from([None, 1.0, 0.37]),
    seed=st.integers(0, 2**16),
)
def test_sdpa_matches_torch(
    leading,
    key_leading_ones,
    length,
    key_length,
    depth,
    value_depth,
    mask_kind,
    mask_leading,
    is_causal,
    scale,
    seed,
):
    rng = np.random.default_rng(seed)
    key_leading = tuple(1 for _ in leading) if key_leading_ones else leading
    query = rng.normal(size=leading + (length, depth)).astype(np.float32)
    key = rng.normal(size=key_leading + (key_length, depth)).astype(np.float32)
    value = rng.normal(size=key_leading + (key_length, value_depth)).astype(np.float32)
    mask_shape = {"full": leading, "ones": tuple(1 for _ in leading), "none": ()}[mask_leading]
    mask = random_mask(rng, mask_kind, mask_shape + (length, key_length))
    if is_causal and mask is not None:
        # PyTorch refuses attn_mask together with is_causal; fold the causal part into its mask.
        causal = np.tril(np.ones((length, key_length), dtype=bool))
        mask = (
            mask & causal
            if mask.dtype == bool
            else np.where(causal, mask, -np.inf).astype(np.float32)
        )
        is_causal = False

    ours = SDPA(query, key, value, mask, is_causal=is_causal, scale=scale)
    theirs = torch_sdpa(query, key, value, mask, is_causal, scale).numpy()
    assert ours.shape == theirs.shape

    dead = np.broadcast_to(
        fully_masked_rows(mask, is_causal, (length, key_length)), theirs.shape[:-1]
    )
    ours = np.asarray(ours)
    assert np.all(ours[dead] == 0.0), "fully masked rows must be zeros"
    assert_close(ours[~dead], theirs[~dead], what="attention output")


@pytest.mark.parametrize(
    "mask_kind, is_causal, value_depth",
    [
        ("none", False, 8),
        ("bool", False, 8),
        ("float", False, 5),
        ("none", True, 8),
        ("bool", False, 12),
    ],
)
def test_sdpa_gradients_match_torch(mask_kind, is_causal, value_depth):
    rng = np.random.default_rng(1)
    query = rng.normal(size=(2, 3, 5, 8)).astype(np.float32)
    key = rng.normal(size=(2, 3, 6, 8)).astype(np.float32)
    value = rng.normal(size=(2, 3, 6, value_depth)).astype(np.float32)
    # every row keeps its first key, so PyTorch's gradients are finite everywhere
    mask = random_mask(rng, mask_kind, (2, 1, 5, 6))
    if mask is not None:
        mask[..., 0] = True if mask.dtype == bool else 0.5
    cotangent = rng.normal(size=(2, 3, 5, value_depth)).astype(np.float32)

    def loss(q, k, v):
        out = attention.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, scale=0.3)
        return jnp.sum(out * cotangent)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(query, key, value)

    tensors = [torch.tensor(x, requires_grad=True) for x in (query, key, value)]
    attn_mask = None if mask is None else torch.tensor(mask)
    out = F.scaled_dot_product_attention(
        *tensors, attn_mask=attn_mask, is_causal=is_causal, scale=0.3
    )
    (out * torch.tensor(cotangent)).sum().backward()
    for name, ours, tensor in zip(("query", "key", "value"), grads, tensors):
        assert_close(ours, tensor.grad.numpy(), what=f"d loss / d {name}")


def test_fully_masked_rows_are_zero_with_finite_gradients():
    rng = np.random.default_rng(2)
    query, key, value = (rng.normal(size=(1, 2, 4, 4)).astype(np.float32) for _ in range(3))
    mask = np.ones((4, 4), dtype=bool)
    mask[1] = False
    float_mask = np.where(mask, 0.0, -np.inf).astype(np.float32)
    for m in (mask, float_mask):
        out, weights = SDPA(query, key, value, m, return_weights=True)
        assert np.all(np.asarray(out)[:, :, 1] == 0) and np.all(np.asarray(weights)[:, :, 1] == 0)
        assert np.allclose(np.asarray(weights).sum(-1)[:, :, [0, 2, 3]], 1.0, atol=1e-6)
        grads = jax.jit(jax.grad(lambda *qkv: SDPA(*qkv, m).sum(), (0, 1, 2)))(query, key, value)
        assert all(np.isfinite(np.asarray(g)).all() for g in grads)
        assert np.all(np.asarray(grads[0])[:, :, 1] == 0)
        # torch 2.13's SDPA also gives zeros here (nn.MultiheadAttention still gives NaN)
        assert_close(out, torch_sdpa(query, key, value, m).numpy(), what="output with a dead row")


@pytest.mark.parametrize(
    "mask_kind, is_causal, key_length",
    [
        ("none", False, 7),
        ("bool", False, 7),
        ("float", True, 7),
        ("none", True, 7),
        ("none", True, 5),
        ("bool", True, 5),
    ],
)
def test_fused_and_explicit_paths_agree(mask_kind, is_causal, key_length):
    rng = np.random.default_rng(3)
    query = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
    key = rng.normal(size=(2, key_length, 3, 8)).astype(np.float32)
    value = rng.normal(size=(2, key_length, 3, 8)).astype(np.float32)
    mask = random_mask(rng, mask_kind, (2, 1, 5, key_length))
    if mask is not None:
        mask[0, 0, 2] = False if mask.dtype == bool else -np.inf  # one fully masked row
    results = {}
    for implementation in ("xla", "explicit"):

        def fn(q, k, v, implementation=implementation):
            return attention.dot_product_attention(
                q, k, v, mask, is_causal=is_causal, implementation=implementation
            )

        grad_fn = jax.jit(jax.grad(lambda *qkv: jnp.sum(fn(*qkv) ** 2), (0, 1, 2)))
        results[implementation] = (jax.jit(fn)(query, key, value), grad_fn(query, key, value))
    assert_close(results["xla"][0], results["explicit"][0], what="fused vs explicit output")
    for g_fused, g_explicit in zip(results["xla"][1], results["explicit"][1]):
        # Causal row 0 sees one key: its query gradient is 0 exactly (softmax of one score), which
        # the two paths round differently (the explicit one normalises after the value product,
        # so that gradient is the difference of two equal terms: 3e-6 at scale 1 on this CPU);
        # the absolute tolerance is 1e-5 of the gradient's scale.
        scale = max(1.0, float(np.abs(g_fused).max()))
        assert_close(g_fused, g_explicit, atol=1e-5 * scale, what="fused vs explicit gradient")
    if mask is not None:
        assert np.all(np.asarray(results["xla"][0])[0, 2] == 0)


def test_weights_match_softmax_formula():
    rng = np.random.default_rng(4)
    query, key, value = (rng.normal(size=(3, 4, 6)).astype(np.float64) for _ in range(3))
    out, weights = attention.scaled_dot_product_attention(
        query.astype(np.float32),
        key.astype(np.float32),
        value.astype(np.float32),
        return_weights=True,
    )
    scores = query @ np.swapaxes(key, -1, -2) / np.sqrt(6)
    expected = np.exp(scores - scores.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    assert_close(weights, expected, what="weights")
    assert_close(out, expected @ value, what="output")


def test_dropout_drops_and_rescales_weights():
    rng = np.random.default_rng(5)
    query, key, value = (rng.normal(size=(2, 2, 8, 4)).astype(np.float32) for _ in range(3))
    _, clean = SDPA(query, key, value, return_weights=True)
    out, dropped = SDPA(
        query, key, value, dropout_rate=0.25, dropout_rng=jax.random.key(0), return_weights=True
    )
    clean, dropped = np.asarray(clean), np.asarray(dropped)
    kept = dropped != 0
    assert 0.6 < kept.mean() < 0.9
    assert_close(dropped[kept], clean[kept] / 0.75, what="kept weights")
    assert_close(out, np.asarray(dropped) @ value, what="output uses the dropped weights")


# --------------------------------------------------------------------------------------------
# Worked examples, computed by hand
# --------------------------------------------------------------------------------------------


def test_three_token_worked_example():
    inputs = np.array([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]], np.float32)
    w_query = np.array([[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]], np.float32)
    w_key = np.array([[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]], np.float32)
    w_value = np.array([[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]], np.float32)
    out = attention.scaled_dot_product_attention(
        inputs @ w_query, inputs @ w_key, inputs @ w_value, scale=1.0
    )
    expected = [[1.9366, 6.6831, 1.5951], [2.0, 7.9640, 0.0540], [1.9997, 7.7599, 0.3584]]
    np.testing.assert_allclose(out, expected, atol=1e-4)


def test_causal_uniform_attention_is_prefix_mean():
    x = np.random.default_rng(42).normal(size=(4, 8, 2)).astype(np.float32)
    tril = np.tril(np.ones((8, 8), np.float32))
    prefix_mean = (tril / tril.sum(1, keepdims=True)) @ x
    zeros = np.zeros((4, 8, 1), np.float32)  # equal scores -> uniform weights over the visible keys
    out = attention.scaled_dot_product_attention(zeros, zeros, x, is_causal=True)
    assert_close(out, prefix_mean, what="causal mean")


# --------------------------------------------------------------------------------------------
# Mask helpers
# --------------------------------------------------------------------------------------------


def test_mask_helpers():
    np.testing.assert_array_equal(masks.causal_mask(3, 5), np.tril(np.ones((3, 5), bool)))
    np.testing.assert_array_equal(
        masks.causal_mask(4), torch.ones(4, 4, dtype=torch.bool).tril().numpy()
    )
    valid = masks.padding_mask(jnp.array([2, 4]), 4)
    np.testing.assert_array_equal(valid, [[1, 1, 0, 0], [1, 1, 1, 1]])
    pair = masks.make_attention_mask(valid[:, :3], valid)
    assert pair.shape == (2, 1, 3, 4)
    np.testing.assert_array_equal(pair[0, 0], [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    both = masks.combine_masks(pair, masks.causal_mask(3, 4), None)
    np.testing.assert_array_equal(both[1, 0], np.tril(np.ones((3, 4), bool)))
    additive = masks.combine_masks(masks.causal_mask(2), jnp.full((2, 2), 0.5))
    np.testing.assert_array_equal(additive, [[0.5, -np.inf], [0.5, 0.5]])
    assert masks.combine_masks(None, None) is None


def test_padding_masks_match_torch_key_padding():
    rng = np.random.default_rng(6)
    query, key, value = (rng.normal(size=(2, 1, 5, 4)).astype(np.float32) for _ in range(3))
    valid = masks.padding_mask(jnp.array([3, 5]), 5)
    ours = SDPA(query, key, value, valid[:, None, None, :])
    theirs = torch_sdpa(query, key, value, np.asarray(valid)[:, None, None, :]).numpy()
    assert_close(ours, theirs, what="key padding")


# --------------------------------------------------------------------------------------------
# Transformations and errors
# --------------------------------------------------------------------------------------------


def numpy_attention(q, k, v, keep):
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    scores = np.where(keep, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


def test_jit_grad_vmap_through_public_functions():
    rng = np.random.default_rng(9)
    q, k, v = (rng.normal(size=(4, 2, 3, 4)).astype(np.float32) for _ in range(3))
    expected = numpy_attention(q, k, v, np.tril(np.ones((3, 3), bool)))
    sdpa = attention.scaled_dot_product_attention
    causal = jax.jit(lambda a, b, c: sdpa(a, b, c, is_causal=True))
    assert_close(causal(q, k, v), expected, what="jit")
    assert_close(jax.jit(jax.vmap(causal))(q, k, v), expected, what="vmap")
    bthd = [np.swapaxes(t, 1, 2) for t in (q, k, v)]
    fused = jax.jit(lambda *a: attention.dot_product_attention(*a, is_causal=True))(*bthd)
    assert_close(np.swapaxes(fused, 1, 2), expected, what="jit dot_product_attention")

    def one_example(*qkv):
        return attention.dot_product_attention(*(t[None] for t in qkv), is_causal=True)[0]

    per_example = jax.jit(jax.vmap(one_example))
    assert_close(np.swapaxes(per_example(*bthd), 1, 2), expected, what="vmap dot_product_attention")
    np.testing.assert_array_equal(
        jax.jit(masks.causal_mask, static_argnums=(0, 1))(2, 3), [[1, 0, 0], [1, 1, 0]]
    )
    # a float mask is differentiable (e.g. a learned relative-position bias)
    grad_bias = jax.jit(jax.grad(lambda b: jnp.sum(sdpa(q, k, v, b) ** 2)))(jnp.zeros((3, 3)))
    assert grad_bias.shape == (3, 3) and np.abs(np.asarray(grad_bias)).sum() > 0

    def pair_mask(lengths):
        valid = masks.padding_mask(lengths, 3)
        return masks.combine_masks(masks.make_attention_mask(valid, valid), masks.causal_mask(3))

    paired = jax.jit(jax.vmap(pair_mask))(jnp.array([[1, 2], [3, 1]]))
    assert paired.shape == (2, 2, 1, 3, 3)
    np.testing.assert_array_equal(paired[0, 1, 0], [[1, 0, 0], [1, 1, 0], [0, 0, 0]])


ones = np.ones
SDPA_ERRORS = [
    (
        (ones((2, 3, 4)), ones((2, 5, 4)), ones((2, 6, 4))),
        {},
        r"key and value lengths differ: key shape \(2, 5, 4\), value shape \(2, 6, 4\)",
    ),
    (
        (ones((3, 4)), ones((5, 3)), ones((5, 3))),
        {},
        r"query and key feature sizes differ: query shape \(3, 4\), key shape \(5, 3\)",
    ),
    ((ones(4), ones((5, 4)), ones((5, 4))), {}, r"query must have rank >= 2.*got shape \(4,\)"),
    (
        (ones((2, 3, 4)), ones((2, 5, 4)), ones((2, 5, 4)), ones((3, 4), bool)),
        {},
        r"mask of shape \(3, 4\) does not broadcast to \(2, 3, 5\)",
    ),
    (
        (ones((2, 3, 4)), ones((3, 5, 4)), ones((3, 5, 4))),
        {},
        r"leading dims do not broadcast: query shape \(2, 3, 4\), key shape \(3, 5, 4\)",
    ),
    (
        (ones((3, 4)), ones((5, 4)), ones((5, 4))),
        {"dropout_rate": 0.1},
        r"dropout_rate=0.1 needs a dropout_rng",
    ),
    (
        (ones((3, 4)), ones((5, 4)), ones((5, 4))),
        {"dropout_rate": 1.0},
        r"dropout_rate must be in \[0, 1\)",
    ),
]


@pytest.mark.parametrize("args, kwargs, message", SDPA_ERRORS)
def test_bad_sdpa_inputs_raise_value_error(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        attention.scaled_dot_product_attention(*args, **kwargs)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: attention.dot_product_attention(
                ones((2, 3, 4)), ones((2, 3, 4)), ones((2, 3, 4))
            ),
            r"query must be \[batch, length, heads, head_dim\], got shape \(2, 3, 4\)",
        ),
        (
            lambda: attention.dot_product_attention(
                ones((1, 3, 2, 4)), ones((1, 5, 2, 4)), ones((1, 4, 2, 4))
            ),
            r"value shape \(1, 4, 2, 4\) does not match key shape \(1, 5, 2, 4\)",
        ),
        (lambda: masks.padding_mask(jnp.ones((2, 2)), 3), r"lengths must have shape \[batch\]"),
        (
            lambda: masks.combine_masks(ones((2, 3), bool), ones((4, 3), bool)),
            r"do not broadcast together",
        ),
    ],
)
def test_bad_inputs_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()
