"""The Vision Transformer's encoder block and its MLP, as Linen modules (``attnjax.models.vit``
stacks them).

One block maps the residual stream ``[batch, tokens, width]`` to the same shape, in one of two
layouts:

    sequential (pre-LN, Dosovitskiy et al. 2021)   x + attn(norm1(x)), then x + mlp(norm2(x))
    parallel (ViT-22B, Dehghani et al. 2023)       x + attn(norm1(x)) + mlp(norm1(x))

Both keep timm's parameter names (``norm1``, ``attn/{query, key, value, out}``, ``norm2``,
``mlp/{fc1, fc2}``); the parallel block has no ``norm2``. timm's ``ParallelScalingBlock`` fuses
q/k/v with ``fc1`` (and optionally ``out`` with ``fc2``) into one matrix; here each projection
stays its own ``nn.Dense``, so each kernel keeps its own tensor-parallel layout (``PARAM_AXES``)
and the converter splits timm's fused matrices.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnjax.models.multihead import MultiHeadAttention
from attnjax.ops.activations import gelu
from attnjax.ops.dense import rows_dot_general


def layer_norm(module: nn.Module, name: str) -> nn.LayerNorm:
    """A LayerNorm with ``module``'s ``layer_norm_eps``, ``layer_norm_bias`` and dtypes (the
    blocks and ``ViT`` share them)."""
    return nn.LayerNorm(
        epsilon=module.layer_norm_eps,
        use_bias=module.layer_norm_bias,
        dtype=module.dtype,
        param_dtype=module.param_dtype,
        name=name,
    )


class ViTMlp(nn.Module):
    """timm's ``Mlp``: ``fc1 (mlp_dim) -> GELU (exact, erf) -> dropout -> fc2 -> dropout``,
    ``[..., width]`` -> same shape."""

    mlp_dim: int
    dropout_rate: float = 0.0
    deterministic: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        dense = functools.partial(
            nn.Dense,
            dot_general=rows_dot_general,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=nn.initializers.xavier_uniform(),
            bias_init=nn.initializers.normal(stddev=1e-6),
        )
        width = x.shape[-1]
        x = dense(self.mlp_dim, name="fc1")(x)
        x = gelu(x)  # torch nn.GELU's default, exact; tanh differs by ~1e-3
        x = nn.Dropout(self.dropout_rate)(x, deterministic=self.deterministic)
        x = dense(width, name="fc2")(x)
        return nn.Dropout(self.dropout_rate)(x, deterministic=self.deterministic)


class EncoderBlock(nn.Module):
    """A transformer block, sequential (pre-LN) or, with ``parallel``, ViT-22B's parallel one.

    ``__call__(x [batch, tokens, width], drop_path_rate)`` -> ``(x, weights)``, where weights are
    the attention weights ``[batch, heads, tokens, tokens]`` when ``return_weights`` else None.
    ``drop_path_rate`` (stochastic depth; a per-layer value, traced under ``nn.scan``) drops a
    sample's whole residual branch with that probability and rescales the kept ones; the parallel
    block has one branch, the sum of attention and MLP (timm's rule).

    Attributes (besides sizes, dropouts, dtypes): ``parallel`` (one LayerNorm, attention and MLP
    side by side), ``qk_norm`` and ``qkv_bias`` (``MultiHeadAttention``'s), ``layer_norm_eps`` and
    ``layer_norm_bias`` (of every LayerNorm in the block, the query/key ones included).
    """

    num_heads: int
    mlp_dim: int
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    stochastic_depth: bool = False
    parallel: bool = False
    qk_norm: bool = False
    qkv_bias: bool = True
    layer_norm_eps: float = 1e-6
    layer_norm_bias: bool = True
    deterministic: bool = True
    return_weights: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def _drop_path(self, branch, rate):
        if self.deterministic or not self.stochastic_depth:
            return branch
        keep = 1.0 - rate
        shape = (branch.shape[0],) + (1,) * (branch.ndim - 1)
        kept = jax.random.bernoulli(self.make_rng("dropout"), keep, shape)
        return jnp.where(kept, branch / keep.astype(branch.dtype), 0.0).astype(branch.dtype)

    def _attention(self, y):
        """``[batch, tokens, width]`` -> (attention output after dropout, weights or None)."""
        y = MultiHeadAttention(
            num_heads=self.num_heads,
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            qk_norm_eps=self.layer_norm_eps,
            qk_norm_bias=self.layer_norm_bias,
            dropout_rate=self.attention_dropout_rate,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="attn",
        )(y, deterministic=self.deterministic, return_weights=self.return_weights)
        y, weights = y if self.return_weights else (y, None)
        return nn.Dropout(self.dropout_rate)(y, deterministic=self.deterministic), weights

    def _mlp(self, y):
        return ViTMlp(
            self.mlp_dim,
            self.dropout_rate,
            self.deterministic,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="mlp",
        )(y)

    @nn.compact
    def __call__(self, x, drop_path_rate=0.0):
        drop_path_rate = jnp.asarray(drop_path_rate, jnp.float32)
        y = layer_norm(self, "norm1")(x)
        attended, weights = self._attention(y)
        if self.parallel:
            x = x + self._drop_path(attended + self._mlp(y), drop_path_rate)
        else:
            x = x + self._drop_path(attended, drop_path_rate)
            x = x + self._drop_path(self._mlp(layer_norm(self, "norm2")(x)), drop_path_rate)
        # The residual stream stays split by the batch (attnjax.parallel.sharding's activation
        # rules).
        return nn.with_logical_constraint(x, ("batch", "length", "embed")), weights
