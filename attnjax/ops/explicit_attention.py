"""Attention as einsum + softmax on ``[batch, length, heads, dim]`` arrays: the path that can
return the attention weights and apply dropout to them, and the fastest on CPU for mid-length
sequences (``attnjax.ops.kernel_choice``). Its ``[L, S]`` scores are held whole: memory grows
with the square of the length (``blocked_attention`` is the linear-memory path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnjax.ops.masks import as_4d, causal_mask, large_negative, split_mask


def explicit_attention(
    query, key, value, keep, bias, row_valid, scale, dropout_rate, dropout_rng, need_weights=True
):
    """Einsum + softmax attention on ``[batch, length, heads, dim]`` -> (out, weights or None).

    Heads lead the products; without weights to return, the scale goes into the query and the
    softmax is normalised after the product with the values ([L, Ev] divisions, not [L, S]),
    which is faster on XLA:CPU (benchmarks/results/attention_cpu.md)."""
    logits_dtype = jnp.promote_types(query.dtype, jnp.float32)
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (query, key, value))
    if not need_weights:
        q = q * jnp.asarray(scale, q.dtype)
    logits = jnp.einsum("bhld,bhsd->bhls", q, k, preferred_element_type=logits_dtype)
    if need_weights:
        logits = logits * jnp.asarray(scale, logits_dtype)
    if bias is not None:
        logits = logits + bias.astype(logits_dtype)
    if keep is not None:
        logits = jnp.where(keep, logits, large_negative(logits_dtype))
    if not need_weights:
        unnormalised = jnp.exp(
            logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        )
        out = jnp.einsum("bhls,bhsd->bhld", unnormalised.astype(value.dtype), v)
        out = out / jnp.sum(unnormalised, axis=-1, keepdims=True).astype(value.dtype)
        if row_valid is not None:
            out = jnp.where(row_valid, out, 0.0)
        return jnp.swapaxes(out, 1, 2), None
    weights = jax.nn.softmax(logits, axis=-1)
    if row_valid is not None:
        weights = jnp.where(row_valid, weights, 0.0)
    weights = weights.astype(value.dtype)
    if dropout_rate > 0.0:
        kept = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights = jnp.where(kept, weights / (1.0 - dropout_rate), 0.0).astype(value.dtype)
    return jnp.swapaxes(jnp.einsum("bhls,bhsd->bhld", weights, v), 1, 2), weights


def with_weights(query, key, value, mask, is_causal, scale, dropout_rate, dropout_rng):
    """The explicit path with its weights (and dropout): (out, weights)."""
    keep, bias = split_mask(mask, "dot_product_attention")
    if is_causal:
        causal = causal_mask(query.shape[1], key.shape[1])
        keep = causal if keep is None else jnp.logical_and(keep, causal)
    keep, bias = as_4d(keep), as_4d(bias)
    row_valid = None if keep is None else jnp.any(keep, axis=-1, keepdims=True)
    return explicit_attention(
        query, key, value, keep, bias, row_valid, scale, dropout_rate, dropout_rng, True
    )
