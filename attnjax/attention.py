"""Scaled dot-product attention, multi-head attention and attention masks.

Two layouts, one set of semantics (PyTorch's ``scaled_dot_product_attention``):

* ``scaled_dot_product_attention``: PyTorch's layout, query ``[..., L, E]``, key ``[..., S, E]``,
  value ``[..., S, Ev]``, any leading (batch, head) dims with broadcasting.
* ``dot_product_attention``: JAX's layout, ``[batch, length, heads, head_dim]``, what
  ``MultiHeadAttention`` uses after its projections (no transposes on the hot path).

Masks: a boolean mask is True where a query may attend to a key; a float mask is added to the
scores (``-inf`` entries mask a key out). ``is_causal`` is PyTorch's top-left aligned
``tril(ones(L, S))``. A query row whose keys are all masked returns zeros, never NaN (PyTorch's
``nn.MultiheadAttention`` returns NaN there).

Which kernel runs is ``dot_product_attention``'s ``implementation``, by default picked by
``blocked_attention.choose_implementation``: the fused ``jax.nn.dot_product_attention``, an explicit
einsum + softmax (always when weights or dropout are requested) or the linear-memory blocked path.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attnjax.blocked_attention import blocked_dot_product_attention, choose_implementation

Array = jax.Array
_IMPLEMENTATIONS = (None, "xla", "cudnn", "explicit", "blocked")


# --------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------


def causal_mask(query_length: int, key_length: int | None = None) -> Array:
    """Top-left aligned causal mask ``tril(ones(L, S))`` (PyTorch's ``is_causal``): bool ``[L, S]``."""
    key_length = query_length if key_length is None else key_length
    if query_length < 1 or key_length < 1:
        raise ValueError(
            f"causal_mask: query_length and key_length must be >= 1, got {query_length}, {key_length}"
        )
    return jnp.tril(jnp.ones((query_length, key_length), dtype=bool))


def padding_mask(lengths, max_length: int) -> Array:
    """Valid-token mask from sequence lengths: ``lengths [batch]`` -> bool ``[batch, max_length]``.

    True marks a real token (position < length), False padding.
    """
    lengths = jnp.asarray(lengths)
    if lengths.ndim != 1:
        raise ValueError(f"padding_mask: lengths must have shape [batch], got shape {lengths.shape}")
    return jnp.arange(max_length)[None, :] < lengths[:, None]


def make_attention_mask(query_valid, key_valid) -> Array:
    """Pairwise mask from per-token validity: ``[batch, L]``, ``[batch, S]`` -> bool ``[batch, 1, L, S]``.

    A query may attend to a key when both are real tokens; the singleton axis broadcasts over heads.
    """
    query_valid = jnp.asarray(query_valid, dtype=bool)
    key_valid = jnp.asarray(key_valid, dtype=bool)
    if query_valid.ndim != 2 or key_valid.ndim != 2:
        raise ValueError(
            "make_attention_mask: query_valid and key_valid must be [batch, length], got shapes "
            f"{query_valid.shape} and {key_valid.shape}"
        )
    if query_valid.shape[0] != key_valid.shape[0]:
        raise ValueError(
            f"make_attention_mask: batch sizes differ: query_valid {query_valid.shape}, "
            f"key_valid {key_valid.shape}"
        )
    return query_valid[:, None, :, None] & key_valid[:, None, None, :]


def combine_masks(*masks) -> Array | None:
    """Combine masks (``None`` entries ignored) by broadcasting; ``None`` when none is given.

    Boolean masks combine with a logical and. If any mask is a float (additive) mask, the result is
    additive: boolean masks become 0 / -inf and the float masks are summed.
    """
    masks = [jnp.asarray(m) for m in masks if m is not None]
    if not masks:
        return None
    try:
        jnp.broadcast_shapes(*(m.shape for m in masks))
    except ValueError:
        raise ValueError(
            f"combine_masks: mask shapes {[m.shape for m in masks]} do not broadcast together"
        ) from None
    if all(m.dtype == jnp.bool_ for m in masks):
        return functools.reduce(jnp.logical_and, masks)
    additive = [jnp.where(m, 0.0, -jnp.inf) if m.dtype == jnp.bool_ else m for m in masks]
    return functools.reduce(jnp.add, additive)


def _split_mask(mask):
    """A user mask -> (boolean part or None, additive float part or None)."""
    if mask is None:
        return None, None
    mask = jnp.asarray(mask)
    if mask.dtype == jnp.bool_:
        return mask, None
    if not jnp.issubdtype(mask.dtype, jnp.floating):
        raise ValueError(f"mask must be boolean (True = attend) or floating (added), got {mask.dtype}")
    # -inf entries are masked keys: moving them to the boolean part keeps fully masked rows
    # detectable (and the softmax finite) on every path.
    keep = ~jnp.isneginf(mask)
    return keep, jnp.where(keep, mask, 0.0)


def _large_negative(dtype):
    # Finite, so a row whose keys are all masked gives a uniform softmax, not NaN; those rows are
    # then zeroed explicitly. Same constant as jax.nn.dot_product_attention uses.
    return jnp.asarray(-0.7 * float(jnp.finfo(jnp.float32).max), dtype=dtype)


# --------------------------------------------------------------------------------------------
# Attention functions
# --------------------------------------------------------------------------------------------


def _check_dropout(dropout_rate, dropout_rng):
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng (a jax.random key)")


def _check_ranks(where: str, expected: str, rank_ok: Callable[[int], bool], **arrays):
    for name, array in arrays.items():
        if not rank_ok(jnp.ndim(array)):
            raise ValueError(f"{where}: {name} must {expected}, got shape {jnp.shape(array)}")


def _check_mask_shape(mask, target: tuple, where: str):
    if mask is None:
        return
    shape = jnp.shape(mask)
    try:
        broadcast = np.broadcast_shapes(shape, target)
    except ValueError:
        broadcast = None
    if broadcast != tuple(target) or len(shape) > len(target):
        raise ValueError(f"{where}: mask of shape {shape} does not broadcast to {tuple(target)}")


def _explicit_attention(query, key, value, keep, bias, row_valid, scale, dropout_rate, dropout_rng,
                        need_weights=True):
    """Einsum + softmax attention on ``[batch, length, heads, dim]``; returns (out, weights or None).

    Heads lead the products; without weights to return, the scale goes into the query and the
    softmax is normalised after the product with the values ([L, Ev] divisions, not [L, S]): on
    XLA:CPU the MHA step of ``benchmarks/compare_torch.py`` drops from 128 to 76 ms, GPT's 1.8 to 1.4 s."""
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
        logits = jnp.where(keep, logits, _large_negative(logits_dtype))
    if not need_weights:
        unnormalised = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
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


def _fused_attention(query, key, value, keep, bias, scale, is_causal, implementation):
    if implementation is None:
        if (jax.default_backend() == "gpu" and query.dtype in (jnp.float16, jnp.bfloat16)
                and query.shape[-1] % 8 == 0 and query.shape[-1] <= 128):
            try:
                cudnn_bias = None if bias is None else bias.astype(query.dtype)
                return jax.nn.dot_product_attention(query, key, value, cudnn_bias, keep, scale=scale,
                                                    is_causal=is_causal, implementation="cudnn")
            except (NotImplementedError, ValueError, RuntimeError):
                pass  # cuDNN rejects some shapes and layouts at trace time; XLA takes any.
        implementation = "xla"
    return jax.nn.dot_product_attention(query, key, value, bias, keep, scale=scale, is_causal=is_causal,
                                        implementation=implementation)


def dot_product_attention(query, key, value, mask=None, *, is_causal: bool = False,
                          scale: float | None = None, dropout_rate: float = 0.0, dropout_rng=None,
                          return_weights: bool = False, implementation: str | None = None):
    """Multi-head attention on ``[batch, length, heads, head_dim]`` arrays (JAX's layout).

    Args:
      query: ``[batch, L, heads, E]``.
      key: ``[batch, S, heads, E]``.
      value: ``[batch, S, heads, Ev]``.
      mask: boolean (True = attend) or float (added to the scores), broadcastable to
        ``[batch, heads, L, S]``.
      is_causal: also apply the top-left aligned causal mask ``tril(ones(L, S))``.
      scale: score scale, default ``1 / sqrt(E)``.
      dropout_rate, dropout_rng: dropout on the attention weights (explicit path).
      return_weights: also return the weights ``[batch, heads, L, S]`` (after dropout, as PyTorch).
      implementation: None (``blocked_attention.choose_implementation`` picks by backend, dtype
        and shape), "xla", "cudnn", "explicit" (einsum + softmax) or "blocked" (linear memory).
        Weights and dropout always use "explicit"; ``Ev != E`` uses "explicit" or "blocked".

    Returns:
      ``[batch, L, heads, Ev]``, or ``(out, weights)``. Rows whose keys are all masked are zeros.
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    _check_ranks("dot_product_attention", "be [batch, length, heads, head_dim]", lambda n: n == 4,
                 query=query, key=key, value=value)
    batch, length, heads, depth = query.shape
    if key.shape[0] != batch or key.shape[2] != heads or key.shape[3] != depth:
        raise ValueError(f"dot_product_attention: key shape {key.shape} does not match query shape "
                         f"{query.shape} in batch, heads or head_dim")
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(f"dot_product_attention: value shape {value.shape} does not match key shape "
                         f"{key.shape} in batch, length or heads")
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {_IMPLEMENTATIONS}, got {implementation!r}")
    _check_dropout(dropout_rate, dropout_rng)
    key_length = key.shape[1]
    _check_mask_shape(mask, (batch, heads, length, key_length), "dot_product_attention")
    scale = 1.0 / math.sqrt(depth) if scale is None else scale
    needs_weights = return_weights or dropout_rate > 0.0
    if implementation is None and not needs_weights:
        implementation = choose_implementation(
            jax.default_backend(), query.dtype, length, key_length, depth, value.shape[-1])
    if implementation == "blocked" and not needs_weights:
        return blocked_dot_product_attention(query, key, value, mask, is_causal=is_causal, scale=scale)

    explicit = needs_weights or value.shape[-1] != depth or implementation == "explicit"
    keep, bias = _split_mask(mask)
    # A plain square causal mask goes to the kernel as a flag (cuDNN then skips the masked blocks);
    # anything else is folded into the boolean mask.
    kernel_causal = is_causal and keep is None and length == key_length and not explicit
    if is_causal and not kernel_causal:
        causal = causal_mask(length, key_length)
        keep = causal if keep is None else jnp.logical_and(keep, causal)
    row_valid = None
    if keep is not None:
        keep = jnp.reshape(keep, (1,) * (4 - keep.ndim) + keep.shape)
        row_valid = jnp.any(keep, axis=-1, keepdims=True)  # [batch?, heads?, L, 1]
    if bias is not None:
        bias = jnp.reshape(bias, (1,) * (4 - bias.ndim) + bias.shape)

    if explicit:
        out, weights = _explicit_attention(query, key, value, keep, bias, row_valid, scale, dropout_rate,
                                           dropout_rng, needs_weights)
        return (out, weights) if return_weights else out
    out = _fused_attention(query, key, value, keep, bias, scale, kernel_causal, implementation)
    if row_valid is not None:
        # [batch?, heads?, L, 1] -> [batch?, L, heads?, 1], to match the output layout.
        out = jnp.where(jnp.swapaxes(row_valid, 1, 2), out, 0.0)
    return out


def _fold_leading(x, leading: tuple):
    """``[..., A, B]`` broadcastable to ``leading + (A, B)`` -> ``[batch, heads, A, B]``: the last
    leading dim plays the heads, the others are flattened into the batch. Singleton dims stay
    singletons (``[1, 1, A, B]`` for an ``[A, B]`` mask), so nothing is copied per batch and head."""
    x = x.reshape((1,) * (len(leading) + 2 - x.ndim) + x.shape)
    heads = x.shape[-3] if leading else 1
    if all(d == 1 for d in x.shape[:-3]):
        return x.reshape(1, heads, *x.shape[-2:])
    x = jnp.broadcast_to(x, leading[:-1] + x.shape[-3:])
    return x.reshape(-1, heads, *x.shape[-2:])


def scaled_dot_product_attention(query, key, value, mask=None, *, is_causal: bool = False,
                                 scale: float | None = None, dropout_rate: float = 0.0,
                                 dropout_rng=None, return_weights: bool = False,
                                 implementation: str | None = None):
    """Attention with ``torch.nn.functional.scaled_dot_product_attention``'s semantics and layout.

    ``softmax(query @ key^T * scale + mask) @ value`` over the last two axes.

    Args:
      query: ``[..., L, E]``.
      key: ``[..., S, E]``.
      value: ``[..., S, Ev]``; the leading dims of the three broadcast together.
      mask: broadcastable to ``[..., L, S]``. Unlike PyTorch, a mask may be combined with
        ``is_causal``.
      is_causal, scale, dropout_rate, dropout_rng: as ``dot_product_attention``'s.
      return_weights: also return the weights ``[..., L, S]``.
      implementation: as ``dot_product_attention``'s.

    Returns:
      ``[..., L, Ev]``, or ``(out, weights)``. A query row whose keys are all masked gives zeros
      and zero weights (as torch 2.13's SDPA does; ``nn.MultiheadAttention`` gives NaN).
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    _check_ranks("scaled_dot_product_attention", "have rank >= 2 ([..., length, dim])",
                 lambda n: n >= 2, query=query, key=key, value=value)
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"scaled_dot_product_attention: query and key feature sizes differ: query shape "
            f"{query.shape}, key shape {key.shape}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"scaled_dot_product_attention: key and value lengths differ: key shape {key.shape}, "
            f"value shape {value.shape}"
        )
    try:
        leading = tuple(np.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2]))
    except ValueError:
        raise ValueError(
            "scaled_dot_product_attention: leading dims do not broadcast: query shape "
            f"{query.shape}, key shape {key.shape}, value shape {value.shape}"
        ) from None
    length, key_length = query.shape[-2], key.shape[-2]
    if mask is not None:
        mask = jnp.asarray(mask)
        _check_mask_shape(mask, leading + (length, key_length), "scaled_dot_product_attention")

    def to_bthd(x):
        return jnp.swapaxes(_fold_leading(jnp.broadcast_to(x, leading + x.shape[-2:]), leading), 1, 2)

    mask = None if mask is None else _fold_leading(mask, leading)
    result = dot_product_attention(to_bthd(query), to_bthd(key), to_bthd(value), mask,
                                   is_causal=is_causal, scale=scale, dropout_rate=dropout_rate,
                                   dropout_rng=dropout_rng, return_weights=return_weights,
                                   implementation=implementation)
    out, weights = result if return_weights else (result, None)
    out = jnp.swapaxes(out, 1, 2).reshape(leading + (length, value.shape[-1]))
    if return_weights:
        return out, weights.reshape(leading + (length, key_length))
    return out


# --------------------------------------------------------------------------------------------
# Multi-head attention module
# --------------------------------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Linen) with PyTorch ``nn.MultiheadAttention``'s parameterisation.

    Projections ``query``, ``key``, ``value``, ``out`` are plain ``nn.Dense`` layers: query/key
    kernels ``[in, num_heads * head_dim]``, value kernel ``[in, num_heads * value_dim]``, out kernel
    ``[num_heads * value_dim, out_features]``. Projected feature ``head * head_dim + d`` belongs to
    head ``head`` (PyTorch's packing), so a torch Linear weight converts by a transpose. Key and
    value inputs may have their own feature sizes (PyTorch's ``kdim``/``vdim``).

    With ``decode=True`` (self-attention only) a ``cache`` collection holds ``cached_key``
    ``[batch, max_length, heads, head_dim]``, ``cached_value`` ``[batch, max_length, heads,
    value_dim]`` and ``cache_index`` (int32). ``init`` with a ``[batch, max_length, features]``
    input allocates it; each ``apply(..., chunk, mutable=["cache"])`` with ``T >= 1`` new tokens
    writes them at ``cache_index`` and lets them attend causally to every cached position up to
    their own, so a prompt can be pre-filled in one call and then extended one token at a time.
    Writing past ``max_length`` is not detected inside ``jit``; callers keep count.

    Attributes:
      num_heads: number of heads.
      head_dim: query/key size per head; default ``query features // num_heads``.
      value_dim: value size per head; default ``head_dim``.
      out_features: output size; default the query feature size.
      use_bias: biases on all four projections.
      dropout_rate: dropout on the attention weights (rng collection ``"dropout"``).
      decode: use and update the key/value cache.
      dtype, param_dtype: computation and parameter dtypes of the projections.
      kernel_init, bias_init: default Xavier-uniform and zeros (PyTorch's ``in_proj`` init).
    """

    num_heads: int
    head_dim: int | None = None
    value_dim: int | None = None
    out_features: int | None = None
    use_bias: bool = True
    dropout_rate: float = 0.0
    decode: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.zeros

    @nn.compact
    def __call__(
        self,
        inputs_q,
        inputs_k=None,
        inputs_v=None,
        *,
        mask=None,
        is_causal: bool = False,
        deterministic: bool = True,
        return_weights: bool = False,
    ):
        """Attend from ``inputs_q`` ``[batch, L, features]`` to ``inputs_k``/``inputs_v`` ``[batch, S, *]``.

        Args:
          inputs_q: queries ``[batch, L, q_features]``.
          inputs_k: keys ``[batch, S, k_features]``; default ``inputs_q`` (self-attention).
          inputs_v: values ``[batch, S, v_features]``; default ``inputs_k``.
          mask: boolean (True = attend) or float (added), broadcastable to ``[batch, heads, L, S]``
            (in decode mode ``S`` is the cache length).
          is_causal: top-left aligned causal mask (implied by the cache in decode mode).
          deterministic: disables dropout.
          return_weights: also return the per-head weights ``[batch, heads, L, S]``.

        Returns:
          ``[batch, L, out_features]``, or ``(out, weights)``.
        """
        if self.decode and inputs_k is not None:
            raise ValueError("MultiHeadAttention(decode=True) caches self-attention: pass inputs_k=None")
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        _check_ranks("MultiHeadAttention", "be [batch, length, features]", lambda n: n == 3,
                     inputs_q=inputs_q, inputs_k=inputs_k, inputs_v=inputs_v)
        if inputs_k.shape[:2] != inputs_v.shape[:2] or inputs_q.shape[0] != inputs_k.shape[0]:
            raise ValueError(
                "MultiHeadAttention: batch/length mismatch: inputs_q shape "
                f"{inputs_q.shape}, inputs_k shape {inputs_k.shape}, inputs_v shape {inputs_v.shape}"
            )
        features = inputs_q.shape[-1]
        if self.head_dim is None and features % self.num_heads:
            raise ValueError(
                f"MultiHeadAttention: num_heads={self.num_heads} does not divide the query feature "
                f"size {features} (inputs_q shape {inputs_q.shape}); set head_dim explicitly"
            )
        head_dim = self.head_dim or features // self.num_heads
        value_dim = self.value_dim or head_dim
        dense = functools.partial(
            nn.Dense,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
        )
        batch, length = inputs_q.shape[:2]
        query = dense(self.num_heads * head_dim, name="query")(inputs_q)
        key = dense(self.num_heads * head_dim, name="key")(inputs_k)
        value = dense(self.num_heads * value_dim, name="value")(inputs_v)
        query = query.reshape(batch, length, self.num_heads, head_dim)
        key = key.reshape(batch, inputs_k.shape[1], self.num_heads, head_dim)
        value = value.reshape(batch, inputs_v.shape[1], self.num_heads, value_dim)

        if self.decode:
            key, value, mask, is_causal = self._update_cache(key, value, mask, is_causal)

        dropout_rate = 0.0 if deterministic else self.dropout_rate
        dropout_rng = self.make_rng("dropout") if dropout_rate > 0.0 else None
        result = dot_product_attention(
            query,
            key,
            value,
            mask,
            is_causal=is_causal,
            dropout_rate=dropout_rate,
            dropout_rng=dropout_rng,
            return_weights=return_weights,
        )
        attended, weights = result if return_weights else (result, None)
        out_features = self.out_features or features
        out = dense(out_features, name="out")(attended.reshape(batch, length, -1))
        return (out, weights) if return_weights else out

    def _update_cache(self, key, value, mask, is_causal):
        """Write ``key``/``value`` ``[batch, T, heads, dim]`` into the cache; attend to the cache."""
        initialized = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
        cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
        if not initialized:
            return key, value, mask, is_causal  # init: allocate only, attend within the inputs
        batch, max_length = cached_key.value.shape[:2]
        chunk = key.shape[1]
        if key.shape[0] != batch or chunk > max_length:
            raise ValueError(
                f"MultiHeadAttention(decode=True): chunk of keys {key.shape} does not fit the cache "
                f"{cached_key.value.shape} (batch must match, length <= max_length)"
            )
        index = cache_index.value
        cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, key, (0, index, 0, 0))
        cached_value.value = jax.lax.dynamic_update_slice(cached_value.value, value, (0, index, 0, 0))
        cache_index.value = index + chunk
        query_positions = index + jnp.arange(chunk)
        visible = jnp.arange(max_length)[None, :] <= query_positions[:, None]  # [T, max_length]
        if mask is not None:
            _check_mask_shape(mask, (batch, self.num_heads, chunk, max_length), "MultiHeadAttention")
        return cached_key.value, cached_value.value, combine_masks(mask, visible), False
