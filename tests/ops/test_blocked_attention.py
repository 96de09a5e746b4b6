"""attnjax.ops.blocked_attention against the explicit einsum + softmax path and PyTorch's SDPA."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_close

from attnjax.ops import attention, autotune, blocked_attention, kernel_choice

F = torch.nn.functional
# Small tiles, so every case below spans several query and key blocks and ragged last blocks.
BLOCKED = jax.jit(
    functools.partial(blocked_attention.blocked_dot_product_attention, query_block=8, key_block=16),
    static_argnames=("is_causal", "scale"),
)
EXPLICIT = jax.jit(
    functools.partial(attention.dot_product_attention, implementation="explicit"),
    static_argnames=("is_causal", "scale"),
)


def make_mask(rng, kind, batch, heads, length, key_length):
    """A mask in the [batch, heads, L, S]-broadcastable forms callers pass, with one dead row."""
    if kind == "none":
        return None
    if kind == "bool_ls":
        mask = rng.random((length, key_length)) > 0.3
        mask[3] = False
        return mask
    if kind == "bool_padding":  # [batch, 1, 1, S]: per-example valid keys
        valid = (
            np.arange(key_length)[None, :] < np.array([key_length, key_length - 13])[:batch, None]
        )
        return valid[:, None, None, :]
    if kind == "float_full":
        mask = rng.standard_normal((batch, heads, length, key_length)).astype(np.float32)
        mask[0, 1, 5] = -np.inf
        mask[..., 7] = -np.inf
        return mask
    if kind == "float_heads":  # [heads, L, S]: a per-head bias broadcast over the batch
        return rng.standard_normal((heads, length, key_length)).astype(np.float32)
    raise ValueError(kind)


def inputs(rng, batch, length, key_length, heads, depth, value_depth):
    return (
        rng.standard_normal((batch, length, heads, depth), dtype=np.float32),
        rng.standard_normal((batch, key_length, heads, depth), dtype=np.float32),
        rng.standard_normal((batch, key_length, heads, value_depth), dtype=np.float32),
    )


def outputs_and_gradients(fn, mask_kind, is_causal):
    """Jitted ``(q, k, v, mask, cotangent) -> (out, grads)``; a float mask gets a gradient too."""
    argnums = (0, 1, 2, 3) if mask_kind.startswith("float") else (0, 1, 2)

    def loss(q, k, v, m, cotangent):
        out = fn(q, k, v, m, is_causal=is_causal)
        return jnp.sum(out * cotangent), out

    return jax.jit(jax.grad(loss, argnums, has_aux=True))


@pytest.mark.parametrize(
    "mask_kind,is_causal,length,key_length,value_depth",
    [  # lengths that do not divide the 8 / 16 tiles, S > L, S == L, S < L, Ev != E
        ("none", False, 37, 45, 16),
        ("none", True, 50, 50, 24),
        ("bool_ls", False, 50, 50, 16),
        ("bool_ls", True, 37, 45, 24),
        ("bool_padding", True, 37, 45, 16),
        ("float_full", False, 37, 45, 24),
        ("float_full", True, 50, 50, 16),
        ("float_heads", True, 16, 64, 16),
        ("float_heads", False, 45, 29, 16),
    ],
)
def test_values_and_gradients_match_explicit(mask_kind, is_causal, length, key_length, value_depth):
    rng = np.random.default_rng(length + key_length)
    query, key, value = inputs(rng, 2, length, key_length, 3, 16, value_depth)
    mask = make_mask(rng, mask_kind, 2, 3, length, key_length)
    cotangent = rng.standard_normal((2, length, 3, value_depth)).astype(np.float32)
    args = (query, key, value, mask, cotangent)
    ours, ours_out = outputs_and_gradients(BLOCKED, mask_kind, is_causal)(*args)
    reference, reference_out = outputs_and_gradients(EXPLICIT, mask_kind, is_causal)(*args)
    assert_close(ours_out, reference_out, what="blocked output")
    for name, a, b in zip(("query", "key", "value", "mask"), ours, reference):
        assert_close(a, b, what=f"d{name}")


@pytest.mark.parametrize("is_causal", [False, True])
def test_values_and_gradients_match_torch(is_causal):
    rng = np.random.default_rng(1)
    query, key, value = (rng.standard_normal((2, 3, 41, d), dtype=np.float32) for d in (16, 16, 8))
    mask = rng.standard_normal((41, 41)).astype(np.float32)
    cotangent = rng.standard_normal((2, 3, 41, 8)).astype(np.float32)

    def loss(q, k, v, m):
        out = attention.scaled_dot_product_attention(
            q, k, v, m, is_causal=is_causal, implementation="blocked"
        )
        return jnp.sum(out * cotangent), out

    grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(query, key, value, mask)
    tensors = [torch.tensor(x, requires_grad=True) for x in (query, key, value, mask)]
    # torch takes a float mask together with is_causal only through an explicit combined mask.
    causal = (
        torch.ones(41, 41, dtype=torch.bool).tril()
        if is_causal
        else torch.ones(41, 41, dtype=torch.bool)
    )
    theirs = F.scaled_dot_product_attention(
        *tensors[:3], attn_mask=tensors[3].masked_fill(~causal, float("-inf"))
    )
    (theirs * torch.tensor(cotangent)).sum().backward()
    assert_close(out, theirs.detach().numpy(), what="output vs torch")
    for name, ours, tensor in zip(("query", "key", "value", "mask"), grads, tensors):
        assert_close(ours, tensor.grad.numpy(), what=f"d{name} vs torch")


def test_leading_batch_dims_and_scale():
    rng = np.random.default_rng(2)
    query = rng.standard_normal((2, 4, 3, 33, 8), dtype=np.float32)
    key = rng.standard_normal((1, 4, 3, 40, 8), dtype=np.float32)  # broadcast over the first dim
    value = rng.standard_normal((2, 4, 3, 40, 8), dtype=np.float32)
    mask = rng.random((3, 33, 40)) > 0.2
    ours = attention.scaled_dot_product_attention(
        query, key, value, mask, scale=0.3, implementation="blocked"
    )
    theirs = F.scaled_dot_product_attention(
        *(torch.tensor(x) for x in (query, np.broadcast_to(key, value.shape).copy(), value)),
        attn_mask=torch.tensor(mask),
        scale=0.3,
    )
    assert_close(ours, theirs.numpy(), what="5-d inputs")


def test_fully_masked_rows_are_zero_with_finite_gradients():
    rng = np.random.default_rng(3)
    query, key, value = inputs(rng, 1, 20, 20, 2, 8, 8)
    mask = np.ones((20, 20), dtype=bool)
    mask[4] = False
    mask[17] = False

    def loss(q, k, v):
        return jnp.sum(BLOCKED(q, k, v, mask) ** 2)

    out = BLOCKED(query, key, value, mask)
    np.testing.assert_array_equal(np.asarray(out)[:, [4, 17]], 0.0)
    grads = jax.grad(loss, argnums=(0, 1, 2))(query, key, value)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    np.testing.assert_array_equal(np.asarray(grads[0])[:, [4, 17]], 0.0)


def test_causal_skips_key_blocks_above_the_diagonal():
    # Keys 16..63 lie in whole 16-key blocks that no query of a top-left causal mask with L=16
    # reaches. NaN values there would poison any visited block (0 * NaN = NaN), so finite outputs
    # and gradients show those blocks are never read, forward or backward.
    rng = np.random.default_rng(4)
    query, key, value = inputs(rng, 1, 16, 64, 2, 8, 8)
    value[:, 16:] = np.nan
    key[:, 16:] = np.nan
    out = BLOCKED(query, key, value, is_causal=True)
    reference = EXPLICIT(query, key[:, :16], value[:, :16], is_causal=True)
    assert_close(out, reference, what="causal output with unreachable NaN keys")
    grads = jax.grad(lambda q, k, v: jnp.sum(BLOCKED(q, k, v, is_causal=True) ** 2), (0, 1, 2))(
        query, key, value
    )
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    np.testing.assert_array_equal(np.asarray(grads[2])[:, 16:], 0.0)


def test_jit_and_vmap():
    rng = np.random.default_rng(5)
    query, key, value = (rng.standard_normal((3, 2, 30, 2, 8), dtype=np.float32) for _ in range(3))

    def one(q, k, v):
        return blocked_attention.blocked_dot_product_attention(
            q, k, v, is_causal=True, query_block=8, key_block=8
        )

    ours = jax.jit(jax.vmap(one))(query, key, value)
    for i in range(3):
        assert_close(
            ours[i], EXPLICIT(query[i], key[i], value[i], is_causal=True), what=f"vmap {i}"
        )


def fwd_bwd_temp_bytes(fn, length, heads=8, depth=64):
    shape = jax.ShapeDtypeStruct((1, length, heads, depth), jnp.float32)
    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, is_causal=True)), (0, 1, 2)))
    return step.lower(shape, shape, shape).compile().memory_analysis().temp_size_in_bytes


def test_memory_grows_linearly_with_length():
    # XLA's temporary buffers for a causal forward+backward at L and 4L: linear growth is a 4x
    # ratio; the [L, L] score matrix of the explicit path grows 16x.
    blocked = functools.partial(
        blocked_attention.blocked_dot_product_attention, query_block=256, key_block=256
    )
    small, large = (fwd_bwd_temp_bytes(blocked, n) for n in (1024, 4096))
    assert large / small < 4.5, (small, large)
    scores_4096 = 8 * 4096 * 4096 * 4
    assert large < scores_4096 / 8, (large, scores_4096)
    explicit_small, explicit_large = (fwd_bwd_temp_bytes(EXPLICIT, n) for n in (256, 1024))
    assert explicit_large / explicit_small > 8, (explicit_small, explicit_large)


@pytest.mark.parametrize(
    "length",
    [17, kernel_choice.EXPLICIT_MIN_LENGTH_CPU + 3, kernel_choice.CPU_TIMED_FROM + 3],
)
@pytest.mark.parametrize("fastest", ["xla", "blocked"])
def test_timed_cpu_band_runs_the_fastest_path_and_caches_it(fastest, length, monkeypatch, tmp_path):
    """From CPU_TIMED_FROM to CPU_TIMED_BELOW tokens a differentiated call runs the path with the
    fastest forward + backward, a forward-only call the fastest forward, each timed once per
    shape (faked here: outcomes never hang on timing), with the same values and gradients.
    Below CPU_TIMED_FROM nothing is timed: below EXPLICIT_MIN_LENGTH_CPU XLA's path with its
    backward and the explicit forward, from there the explicit path both ways."""
    cache = tmp_path / "cpu_rules.json"
    monkeypatch.setenv(autotune.ENV_CACHE, str(cache))
    monkeypatch.setattr(autotune, "_enabled", True)
    monkeypatch.setattr(autotune, "_windows", 1)  # as inside a training run's first step
    monkeypatch.setattr(autotune, "_choices", {})
    timed = []

    def time_candidates(candidates):
        timed.append(sorted(candidates))
        return {name: 0.5 if name == fastest else 1.0 for name in candidates}

    monkeypatch.setattr(autotune, "time_candidates", time_candidates)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, length, 2, 8)).astype(np.float32) for _ in range(3))
    mask = rng.random((length, length)) > 0.2

    def grads(fn):
        loss = lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, mask, is_causal=True)))
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)

    def program(fn, differentiated):
        def forward(q):
            return jnp.sum(jnp.sin(fn(q, k, v, mask)))

        return jax.jit(jax.grad(forward) if differentiated else forward).lower(q).as_text()

    def rules():
        return sorted(name.split(" | ")[0] for name in json.loads(cache.read_text()))

    short = length < kernel_choice.CPU_TIMED_FROM
    assert kernel_choice.EXPLICIT_MIN_LENGTH_CPU <= kernel_choice.CPU_TIMED_FROM
    assert kernel_choice.CPU_TIMED_FROM + 3 < kernel_choice.CPU_TIMED_BELOW
    default = grads(attention.dot_product_attention)
    train_text = program(attention.dot_product_attention, True)
    assert ("while" in train_text) == (fastest == "blocked" and not short)
    forward_text = program(attention.dot_product_attention, False)
    assert ("while" in forward_text) == (fastest == "blocked" and not short)
    if short:
        assert timed == [] and not cache.exists()
    else:
        assert timed[0] == ["blocked", "explicit", "xla"]
        # The causal and the full mask are two shapes, each timed once per rule (JAX traces
        # the primal of a differentiated call too: its forward is timed as well).
        assert rules() == ["cpu_attention"] * 2 + ["cpu_attention_forward"] * 2
        assert len(timed) == len(rules())
    if short:  # the explicit path: its very numbers
        ours = jax.jit(lambda q: attention.dot_product_attention(q, k, v, mask))(q)
        np.testing.assert_array_equal(ours, EXPLICIT(q, k, v, mask))
    if short and length >= kernel_choice.EXPLICIT_MIN_LENGTH_CPU:  # and its gradients
        for ours, ref in zip(jax.tree.leaves(default), jax.tree.leaves(grads(EXPLICIT))):
            np.testing.assert_array_equal(ours, ref)
    for ours, ref in zip(jax.tree.leaves(default), jax.tree.leaves(grads(EXPLICIT))):
        assert_close(ours, ref, what=f"{fastest} path against the explicit one")


def test_default_dispatch_takes_blocked_path_for_long_sequences():
    length = max(kernel_choice.BLOCKED_MIN_LENGTH_CPU, 2048)
    default = fwd_bwd_temp_bytes(attention.dot_product_attention, length)
    tiles = kernel_choice.blocked_tiles("cpu", length, length)
    blocked = functools.partial(
        blocked_attention.blocked_dot_product_attention, query_block=tiles[0], key_block=tiles[1]
    )
    assert default == fwd_bwd_temp_bytes(blocked, length)
    assert default < 8 * length * length * 4, default  # below one [heads, L, L] score matrix


def test_bad_arguments_raise_value_errors():
    q = np.zeros((1, 8, 2, 4), np.float32)
    with pytest.raises(ValueError, match=r"mask of shape \(3, 8, 8\)"):
        blocked_attention.blocked_dot_product_attention(q, q, q, np.ones((3, 8, 8), bool))
    with pytest.raises(ValueError, match="int32"):
        blocked_attention.blocked_dot_product_attention(q, q, q, np.ones((8, 8), np.int32))
    with pytest.raises(ValueError, match="query_block and key_block must be >= 1, got 0"):
        blocked_attention.blocked_dot_product_attention(q, q, q, query_block=0)
    with pytest.raises(ValueError, match="shapes do not match"):
        blocked_attention.blocked_dot_product_attention(q, q[:, :, :1], q)
