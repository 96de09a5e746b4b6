"""Multi-head attention as a Linen module, parameterised as PyTorch's ``nn.MultiheadAttention``
(four ``nn.Dense`` projections around ``attnjax.ops.attention.dot_product_attention``), with an
optional key/value cache for autoregressive decoding."""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnjax.ops.attention import check_ranks, dot_product_attention
from attnjax.ops.dense import rows_dot_general
from attnjax.ops.masks import check_mask_shape, combine_masks

Array = jax.Array

# Logical axis names of the parameters, by path (``attnjax.parallel.sharding`` lays them out on a
# mesh): the projections into the heads by columns, the one out of them by rows.
PARAM_AXES = (
    (r"(^|/)(query|key|value)/kernel$", ("embed", "heads")),
    (r"(^|/)(query|key|value)/bias$", ("heads",)),
    (r"(^|/)out/kernel$", ("heads", "embed")),
    (r"(^|/)out/bias$", ("embed",)),
    # One head_dim-sized LayerNorm shared by every head: no head axis to split.
    (r"(^|/)(q_norm|k_norm)/(scale|bias)$", (None,)),
)


def feed_forward_axes(first: str, second: str) -> tuple:
    """``PARAM_AXES`` rows for the two ``nn.Dense`` layers of a block's feed-forward (paths
    ``first`` and ``second``, e.g. ``"mlp/fc1"``): the hidden units split the first by columns
    and the second by rows, as the heads split the attention's projections."""
    return (
        (rf"(^|/){first}/kernel$", ("embed", "mlp")),
        (rf"(^|/){first}/bias$", ("mlp",)),
        (rf"(^|/){second}/kernel$", ("mlp", "embed")),
        (rf"(^|/){second}/bias$", ("embed",)),
    )


# Logical axis names of the key/value cache ``[batch, max_length, heads, dim]``: a mesh's rules
# that name all three keep each device's heads of it (and its rows of the batch) where its
# projections compute them. Rules that leave one unnamed (training's) constrain nothing.
CACHE_AXES = ("batch", "length", "heads", None)


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Linen) with PyTorch ``nn.MultiheadAttention``'s parameterisation.

    Projections ``query``, ``key``, ``value``, ``out`` are plain ``nn.Dense`` layers: query/key
    kernels ``[in, num_heads * head_dim]``, value kernel ``[in, num_heads * value_dim]``, out kernel
    ``[num_heads * value_dim, out_features]``. Projected feature ``head * head_dim + d`` belongs to
    head ``head`` (PyTorch's packing), so a torch Linear weight converts by a transpose. Key and
    value inputs may have their own feature sizes (PyTorch's ``kdim``/``vdim``).

    With ``decode=True`` (self-attention only) a ``cache`` collection holds ``cached_key``
    ``[batch, max_length, heads, head_dim]``, ``cached_value`` ``[batch, max_length, heads,
    value_dim]`` (both named ``CACHE_AXES``) and ``cache_index`` (int32). ``init`` with a
    ``[batch, max_length, features]`` input allocates it; each ``apply(..., chunk,
    mutable=["cache"])`` with ``T >= 1`` new tokens writes them at ``cache_index`` and lets them
    attend causally to every cached position up to their own, so a prompt can be pre-filled in
    one call and then extended one token at a time. Writing past ``max_length`` is not detected
    inside ``jit``; callers keep count.

    Attributes:
      num_heads: number of heads.
      head_dim: query/key size per head; default ``query features // num_heads``.
      value_dim: value size per head; default ``head_dim``.
      out_features: output size; default the query feature size.
      use_bias: biases on all four projections.
      qkv_bias: with ``use_bias``, biases on ``query``/``key``/``value`` too; False keeps only
        ``out``'s (ViT-22B).
      qk_norm: a LayerNorm over each head's ``head_dim`` query and key features (``q_norm``,
        ``k_norm``, parameters shared by the heads) before the dot product, as timm's ``qk_norm``:
        it holds back the attention-logit growth that made large ViTs diverge (ViT-22B,
        Dehghani et al. 2023).
      qk_norm_eps, qk_norm_bias: those LayerNorms' epsilon and whether they have a bias.
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
    qkv_bias: bool = True
    qk_norm: bool = False
    qk_norm_eps: float = 1e-6
    qk_norm_bias: bool = True
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
        """Attend from ``inputs_q`` ``[batch, L, features]`` to ``inputs_k``/``inputs_v``
        ``[batch, S, *]``.

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
            raise ValueError(
                "MultiHeadAttention(decode=True) caches self-attention: pass inputs_k=None"
            )
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        check_ranks(
            "MultiHeadAttention",
            "be [batch, length, features]",
            lambda n: n == 3,
            inputs_q=inputs_q,
            inputs_k=inputs_k,
            inputs_v=inputs_v,
        )
        if inputs_k.shape[:2] != inputs_v.shape[:2] or inputs_q.shape[0] != inputs_k.shape[0]:
            raise ValueError(
                "MultiHeadAttention: batch/length mismatch: inputs_q shape "
                f"{inputs_q.shape}, inputs_k shape {inputs_k.shape}, "
                f"inputs_v shape {inputs_v.shape}"
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
            dot_general=rows_dot_general,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
        )
        batch, length = inputs_q.shape[:2]
        projection = functools.partial(dense, use_bias=self.use_bias and self.qkv_bias)
        query = projection(self.num_heads * head_dim, name="query")(inputs_q)
        key = projection(self.num_heads * head_dim, name="key")(inputs_k)
        value = projection(self.num_heads * value_dim, name="value")(inputs_v)
        query = query.reshape(batch, length, self.num_heads, head_dim)
        key = key.reshape(batch, inputs_k.shape[1], self.num_heads, head_dim)
        value = value.reshape(batch, inputs_v.shape[1], self.num_heads, value_dim)
        if self.qk_norm:
            norm = functools.partial(
                nn.LayerNorm,
                epsilon=self.qk_norm_eps,
                use_bias=self.qk_norm_bias,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
            )
            query, key = norm(name="q_norm")(query), norm(name="k_norm")(key)

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
        """Write ``key``/``value`` ``[batch, T, heads, dim]`` into the cache; attend to the
        cache."""
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
                f"MultiHeadAttention(decode=True): chunk of keys {key.shape} does not fit the "
                f"cache {cached_key.value.shape} (batch must match, length <= max_length)"
            )
        index = cache_index.value
        for cached, new in ((cached_key, key), (cached_value, value)):
            cached.value = nn.with_logical_constraint(
                jax.lax.dynamic_update_slice(cached.value, new, (0, index, 0, 0)),
                CACHE_AXES,
                fallback=nn.spmd.RulesFallback.NO_CONSTRAINT,
            )
        cache_index.value = index + chunk
        query_positions = index + jnp.arange(chunk)
        visible = jnp.arange(max_length)[None, :] <= query_positions[:, None]  # [T, max_length]
        if mask is not None:
            check_mask_shape(mask, (batch, self.num_heads, chunk, max_length), "MultiHeadAttention")
        return cached_key.value, cached_value.value, combine_masks(mask, visible), False
