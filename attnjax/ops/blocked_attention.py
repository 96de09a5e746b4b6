"""Blocked (flash-style) attention whose memory grows linearly with the sequence length.

Same semantics as ``attention.dot_product_attention`` (PyTorch's ``scaled_dot_product_attention``):
a boolean mask is True where a query may attend to a key, a float mask is added to the scores
(``-inf`` masks a key out), ``is_causal`` is the top-left aligned ``tril(ones(L, S))``, and a
query row whose keys are all masked returns zeros.

The forward pass walks over key blocks with an online softmax (running max ``m`` and running sum
``l`` per query row), so it never holds more than a ``[batch, heads, query_block, key_block]``
tile of scores. It keeps the output and the row log-sum-exp ``m + log(l)`` ``[batch, heads, L]``;
the backward pass (``jax.custom_vjp``) recomputes each tile's probabilities from them instead of
storing the ``[L, S]`` matrix. Under ``is_causal`` the key blocks that lie entirely above the
diagonal are never visited. Lengths that do not divide the block sizes are padded and the padded
keys masked.

Which path runs when no ``implementation`` is given is ``attnjax.ops.kernel_choice``'s rule.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attnjax.ops.masks import as_4d, check_mask_shape, pad_axis, split_mask

Array = jax.Array

# Tile sizes when none are given; attention.dot_product_attention passes its platform's
# (attnjax.ops.kernel_choice.blocked_tiles).
DEFAULT_QUERY_BLOCK = 128
DEFAULT_KEY_BLOCK = 128


class _Blocks(NamedTuple):
    """Static configuration of one blocked call (hashable: a ``custom_vjp`` non-diff argument)."""

    is_causal: bool
    query_block: int
    key_block: int
    query_length: int  # before padding
    key_length: int


def _tile(x, block: _Blocks, query_start, key_start):
    """The ``[.., query_block, key_block]`` tile of a broadcastable mask (singleton axes kept)."""
    if x is None:
        return None
    starts = (0, 0, query_start if x.shape[2] > 1 else 0, key_start if x.shape[3] > 1 else 0)
    sizes = (
        x.shape[0],
        x.shape[1],
        block.query_block if x.shape[2] > 1 else 1,
        block.key_block if x.shape[3] > 1 else 1,
    )
    return jax.lax.dynamic_slice(x, starts, sizes)


def _rows(x, start, size):
    """Rows ``start:start+size`` of a ``[batch, heads, length, ...]`` array."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=2)


def _scores(q_tile, k_tile, keep, bias, block: _Blocks, query_start, key_start, masked=True):
    """Scaled scores of one tile and where they are allowed: (``[b, h, bq, bk]`` f32, bool or
    None for a tile that ``masked=False`` declares wholly allowed)."""
    scores = jnp.einsum("bhqd,bhkd->bhqk", q_tile, k_tile, preferred_element_type=jnp.float32)
    if not masked:
        return scores, None
    tile_bias = _tile(bias, block, query_start, key_start)
    if tile_bias is not None:
        scores = scores + tile_bias.astype(jnp.float32)
    key_index = key_start + jnp.arange(block.key_block)
    allowed = (key_index < block.key_length)[None, None, None, :]
    tile_keep = _tile(keep, block, query_start, key_start)
    if tile_keep is not None:
        allowed = allowed & tile_keep
    if block.is_causal:
        query_index = query_start + jnp.arange(block.query_block)
        allowed = allowed & (query_index[:, None] >= key_index[None, :])
    return scores, allowed


def _key_blocks_for(block: _Blocks, query_block_index, num_key_blocks: int, masked: bool):
    """How many leading key blocks a query block needs (all, or up to the causal diagonal), and
    how many of those it sees whole (no mask, no padded key, below the diagonal): their tiles
    skip the masking."""
    full = block.key_length // block.key_block if not masked else 0
    if not block.is_causal:
        return num_key_blocks, full
    last_query = (query_block_index + 1) * block.query_block - 1
    return (
        jnp.minimum(num_key_blocks, last_query // block.key_block + 1),
        jnp.minimum(full, (query_block_index * block.query_block + 1) // block.key_block),
    )


def _query_blocks_from(block: _Blocks, key_block_index, num_query_blocks: int, masked: bool):
    """The first query block that sees a key block, and the first that sees it whole."""
    key_start = key_block_index * block.key_block
    first = key_start // block.query_block if block.is_causal else 0
    if masked:
        return first, num_query_blocks
    key_end = key_start + block.key_block - 1
    whole = -(-key_end // block.query_block) if block.is_causal else 0
    return first, jnp.where(key_end >= block.key_length, num_query_blocks, whole)


def _forward(query, key, value, keep, bias, block: _Blocks):
    """Padded ``[b, h, L, E]`` inputs -> (out ``[b, h, L, Ev]``, row log-sum-exp ``[b, h, L]``)."""
    batch, heads, length, _ = query.shape
    num_query_blocks = length // block.query_block
    num_key_blocks = key.shape[2] // block.key_block
    out_dtype = jnp.promote_types(query.dtype, value.dtype)

    def query_step(i, carry):
        out, lse = carry
        query_start = i * block.query_block
        q_tile = _rows(query, query_start, block.query_block)

        def key_step(j, state, masked=True):
            acc, row_max, row_sum = state
            key_start = j * block.key_block
            scores, allowed = _scores(
                q_tile,
                _rows(key, key_start, block.key_block),
                keep,
                bias,
                block,
                query_start,
                key_start,
                masked,
            )
            if allowed is not None:
                scores = jnp.where(allowed, scores, -jnp.inf)
            new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))
            # A row with nothing allowed yet has max -inf; shifting by 0 keeps exp() at 0, not NaN.
            shift = jnp.where(jnp.isneginf(new_max), 0.0, new_max)
            probs = jnp.exp(scores - shift[..., None])
            correction = jnp.exp(row_max - shift)
            v_tile = _rows(value, key_start, block.key_block)
            acc = acc * correction[..., None] + jnp.einsum(
                "bhqk,bhkd->bhqd",
                probs.astype(value.dtype),
                v_tile,
                preferred_element_type=jnp.float32,
            )
            return acc, new_max, row_sum * correction + jnp.sum(probs, axis=-1)

        init = (
            jnp.zeros((batch, heads, block.query_block, value.shape[-1]), jnp.float32),
            jnp.full((batch, heads, block.query_block), -jnp.inf, jnp.float32),
            jnp.zeros((batch, heads, block.query_block), jnp.float32),
        )
        needed, whole = _key_blocks_for(
            block, i, num_key_blocks, keep is not None or bias is not None
        )
        state = jax.lax.fori_loop(0, whole, functools.partial(key_step, masked=False), init)
        acc, row_max, row_sum = jax.lax.fori_loop(whole, needed, key_step, state)
        empty = row_sum == 0.0
        tile_out = jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, row_sum)[..., None])
        # +inf for an empty row makes every recomputed probability exp(s - inf) = 0 in backward.
        tile_lse = jnp.where(empty, jnp.inf, row_max + jnp.log(jnp.where(empty, 1.0, row_sum)))
        out = jax.lax.dynamic_update_slice_in_dim(out, tile_out.astype(out_dtype), query_start, 2)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, tile_lse, query_start, 2)
        return out, lse

    init = (
        jnp.zeros((batch, heads, length, value.shape[-1]), out_dtype),
        jnp.zeros((batch, heads, length), jnp.float32),
    )
    return jax.lax.fori_loop(0, num_query_blocks, query_step, init)


def _reduce_to(x, shape):
    """Sum ``x`` over the axes where ``shape`` is 1 (the broadcast axes of a mask)."""
    axes = tuple(a for a, (n, m) in enumerate(zip(x.shape, shape)) if m == 1 and n != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _backward(block: _Blocks, residuals, d_out):
    query, key, value, keep, bias, out, lse = residuals
    num_query_blocks = query.shape[2] // block.query_block
    num_key_blocks = key.shape[2] // block.key_block
    # delta_i = sum_d dO_id O_id, the row term of the softmax gradient.
    delta = jnp.einsum("bhld,bhld->bhl", d_out.astype(jnp.float32), out.astype(jnp.float32))

    def key_step(j, carry):
        d_query, d_key, d_value, d_bias = carry
        key_start = j * block.key_block
        k_tile = _rows(key, key_start, block.key_block)
        v_tile = _rows(value, key_start, block.key_block)
        # Under a causal mask the query blocks that end before this key block see none of it.
        first, whole = _query_blocks_from(
            block, j, num_query_blocks, keep is not None or bias is not None
        )

        def query_step(i, state, masked=True):
            d_query, dk_tile, dv_tile, d_bias = state
            query_start = i * block.query_block
            q_tile = _rows(query, query_start, block.query_block)
            do_tile = _rows(d_out, query_start, block.query_block)
            scores, allowed = _scores(
                q_tile, k_tile, keep, bias, block, query_start, key_start, masked
            )
            lse_tile = _rows(lse, query_start, block.query_block)
            probs = jnp.exp(scores - lse_tile[..., None])
            if allowed is not None:
                probs = jnp.where(allowed, probs, 0.0)
            dv_tile = dv_tile + jnp.einsum(
                "bhqk,bhqd->bhkd",
                probs.astype(do_tile.dtype),
                do_tile,
                preferred_element_type=jnp.float32,
            )
            d_probs = jnp.einsum(
                "bhqd,bhkd->bhqk", do_tile, v_tile, preferred_element_type=jnp.float32
            )
            d_scores = probs * (d_probs - _rows(delta, query_start, block.query_block)[..., None])
            if d_bias is not None:
                starts = (
                    0,
                    0,
                    query_start if d_bias.shape[2] > 1 else 0,
                    key_start if d_bias.shape[3] > 1 else 0,
                )
                tile = _reduce_to(d_scores, d_bias.shape)
                current = jax.lax.dynamic_slice(d_bias, starts, tile.shape)
                d_bias = jax.lax.dynamic_update_slice(d_bias, current + tile, starts)
            dk_tile = dk_tile + jnp.einsum(
                "bhqk,bhqd->bhkd", d_scores, q_tile, preferred_element_type=jnp.float32
            )
            dq_tile = jnp.einsum(
                "bhqk,bhkd->bhqd", d_scores, k_tile, preferred_element_type=jnp.float32
            )
            current = _rows(d_query, query_start, block.query_block)
            d_query = jax.lax.dynamic_update_slice_in_dim(
                d_query, current + dq_tile, query_start, 2
            )
            return d_query, dk_tile, dv_tile, d_bias

        init = (
            d_query,
            jnp.zeros(k_tile.shape, jnp.float32),
            jnp.zeros(v_tile.shape, jnp.float32),
            d_bias,
        )
        whole = jnp.minimum(jnp.maximum(first, whole), num_query_blocks)
        state = jax.lax.fori_loop(first, whole, query_step, init)
        d_query, dk_tile, dv_tile, d_bias = jax.lax.fori_loop(
            whole, num_query_blocks, functools.partial(query_step, masked=False), state
        )
        d_key = jax.lax.dynamic_update_slice_in_dim(d_key, dk_tile, key_start, 2)
        d_value = jax.lax.dynamic_update_slice_in_dim(d_value, dv_tile, key_start, 2)
        return d_query, d_key, d_value, d_bias

    init = (
        jnp.zeros(query.shape, jnp.float32),
        jnp.zeros(key.shape, jnp.float32),
        jnp.zeros(value.shape, jnp.float32),
        None if bias is None else jnp.zeros(bias.shape, jnp.float32),
    )
    d_query, d_key, d_value, d_bias = jax.lax.fori_loop(0, num_key_blocks, key_step, init)
    return (
        d_query.astype(query.dtype),
        d_key.astype(key.dtype),
        d_value.astype(value.dtype),
        None,
        None if bias is None else d_bias.astype(bias.dtype),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _blocked(query, key, value, keep, bias, block: _Blocks):
    return _forward(query, key, value, keep, bias, block)[0]


def _blocked_fwd(query, key, value, keep, bias, block: _Blocks):
    out, lse = _forward(query, key, value, keep, bias, block)
    return out, (query, key, value, keep, bias, out, lse)


_blocked.defvjp(_blocked_fwd, _backward)


def blocked_dot_product_attention(
    query,
    key,
    value,
    mask=None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    query_block: int | None = None,
    key_block: int | None = None,
) -> Array:
    """Blocked attention on ``[batch, length, heads, head_dim]`` arrays (JAX's layout).

    Args:
      query: ``[batch, L, heads, E]``.
      key: ``[batch, S, heads, E]``.
      value: ``[batch, S, heads, Ev]``.
      mask: boolean (True = attend) or float (added to the scores), broadcastable to
        ``[batch, heads, L, S]``; a float mask gets a gradient.
      is_causal: top-left aligned causal mask; key blocks above the diagonal are skipped.
      scale: score scale, default ``1 / sqrt(E)``.
      query_block, key_block: tile sizes (clipped to the lengths); None: ``DEFAULT_QUERY_BLOCK``,
        ``DEFAULT_KEY_BLOCK``.

    Returns:
      ``[batch, L, heads, Ev]``; rows whose keys are all masked are zeros.
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    for name, array in (("query", query), ("key", key), ("value", value)):
        if array.ndim != 4:
            raise ValueError(
                f"blocked_dot_product_attention: {name} must be [batch, length, heads, "
                f"head_dim], got shape {array.shape}"
            )
    if key.shape[::2] != query.shape[::2] or key.shape[:3] != value.shape[:3]:
        raise ValueError(
            f"blocked_dot_product_attention: shapes do not match: query {query.shape}, "
            f"key {key.shape}, value {value.shape} (expected [b, L, h, E], [b, S, h, E], "
            "[b, S, h, Ev])"
        )
    query_block = DEFAULT_QUERY_BLOCK if query_block is None else query_block
    key_block = DEFAULT_KEY_BLOCK if key_block is None else key_block
    if query_block < 1 or key_block < 1:
        raise ValueError(
            f"blocked_dot_product_attention: query_block and key_block must be >= 1, "
            f"got {query_block}, {key_block}"
        )
    batch, length, heads, depth = query.shape
    key_length = key.shape[1]
    where = "blocked_dot_product_attention"
    check_mask_shape(mask, (batch, heads, length, key_length), where)
    keep, bias = split_mask(mask, where)
    keep, bias = as_4d(keep), as_4d(bias)
    query_block, key_block = min(query_block, length), min(key_block, key_length)
    # The scale goes into the query once instead of into every tile of scores and their gradients.
    query = query * jnp.asarray(1.0 / math.sqrt(depth) if scale is None else scale, query.dtype)
    block = _Blocks(bool(is_causal), query_block, key_block, length, key_length)
    padded_length = -(-length // query_block) * query_block
    padded_keys = -(-key_length // key_block) * key_block

    def heads_first(x, size):
        return pad_axis(jnp.swapaxes(x, 1, 2), 2, size)

    keep = pad_axis(pad_axis(keep, 2, padded_length, True), 3, padded_keys, False)
    bias = pad_axis(pad_axis(bias, 2, padded_length), 3, padded_keys)
    out = _blocked(
        heads_first(query, padded_length),
        heads_first(key, padded_keys),
        heads_first(value, padded_keys),
        keep,
        bias,
        block,
    )
    return jnp.swapaxes(out[:, :, :length], 1, 2)


__all__ = ("blocked_dot_product_attention",)
