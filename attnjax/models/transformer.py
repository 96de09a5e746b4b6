"""PyTorch's ``nn.Transformer`` family in Flax Linen, with torch's hyper-parameter names.

``TransformerEncoderLayer``, ``TransformerEncoder``, ``TransformerDecoderLayer``,
``TransformerDecoder`` and ``Transformer`` compute what their torch namesakes compute:

* post-norm (torch's default): ``x = norm1(x + self_attn(x)); x = norm2(x + ff(x))``;
* pre-norm (``norm_first=True``): ``x = x + self_attn(norm1(x)); x = x + ff(norm2(x))``;
* ``ff(x) = linear2(dropout(activation(linear1(x))))``, activation ``"relu"`` or exact ``"gelu"``;
* the decoder layer adds cross-attention to ``memory`` (``multihead_attn``, ``norm2``) between
  the two, and its feed-forward uses ``norm3``.

Submodule names are torch's (``self_attn``, ``multihead_attn``, ``linear1``, ``linear2``,
``norm1``.. ``norm3``, ``layers_N``, ``norm``), so a converted state dict reads as a table.

Shapes: ``src`` ``[batch, S, d_model]``, ``tgt`` ``[batch, T, d_model]``, ``memory``
``[batch, S, d_model]``; with ``batch_first=False`` (torch's default layout) they are
``[S, batch, d_model]`` etc. and the outputs follow the inputs. Masks use attnjax's convention,
whatever the layout: boolean True = may attend (float masks are added to the scores),
broadcastable to ``[batch, heads, L, S]``; ``convert.torch_nn.transformer_masks_from_torch``
translates torch's masks. Dropout (rng collection ``"dropout"``) runs when ``deterministic=False``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from attnjax.models.multihead import PARAM_AXES as ATTENTION_AXES
from attnjax.models.multihead import MultiHeadAttention, feed_forward_axes
from attnjax.ops.activations import gelu
from attnjax.ops.dense import rows_dot_general

# Logical axis names of the parameters, by path (``attnjax.parallel.sharding`` lays them out on a
# mesh): the attentions', and the feed-forward's hidden units.
PARAM_AXES = ATTENTION_AXES + feed_forward_axes("linear1", "linear2")

_ACTIVATIONS = {"relu": nn.relu, "gelu": gelu}
_LAYER_FIELDS = (
    "d_model",
    "nhead",
    "dim_feedforward",
    "dropout",
    "activation",
    "layer_norm_eps",
    "norm_first",
    "bias",
    "dtype",
    "param_dtype",
)


class _TransformerSettings(nn.Module):
    """Hyper-parameters every module of the family shares (torch's names and defaults)."""

    d_model: int = 512
    nhead: int = 8
    dim_feedforward: int = 2048
    dropout: float = 0.1
    activation: str = "relu"
    layer_norm_eps: float = 1e-5
    norm_first: bool = False
    bias: bool = True
    batch_first: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def _layer_settings(self) -> dict:
        return {name: getattr(self, name) for name in _LAYER_FIELDS}

    def _check(self, where: str, **inputs) -> None:
        if self.activation not in _ACTIVATIONS:
            raise ValueError(
                f"{where}: activation={self.activation!r}; expected one of {sorted(_ACTIVATIONS)}"
            )
        if self.d_model % self.nhead:
            raise ValueError(f"{where}: nhead={self.nhead} does not divide d_model={self.d_model}")
        for name, array in inputs.items():
            if jnp.ndim(array) != 3 or jnp.shape(array)[-1] != self.d_model:
                layout = (
                    "[batch, length, d_model]" if self.batch_first else "[length, batch, d_model]"
                )
                raise ValueError(
                    f"{where}: {name} must be {layout} with d_model={self.d_model}, "
                    f"got shape {jnp.shape(array)}"
                )

    def _to_batch_first(self, array):
        return array if self.batch_first else jnp.swapaxes(array, 0, 1)

    _from_batch_first = _to_batch_first

    @staticmethod
    def _constrained(x):
        """A layer's batch-first output: split by the batch (attnjax.parallel.sharding's activation
        rules)."""
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))

    def _layer_norm(self, name: str):
        return nn.LayerNorm(
            epsilon=self.layer_norm_eps,
            use_bias=self.bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    def _attention(self, name: str):
        return MultiHeadAttention(
            num_heads=self.nhead,
            use_bias=self.bias,
            dropout_rate=self.dropout,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    def _feed_forward(self, x, deterministic: bool):
        """``linear2(dropout(activation(linear1(x))))`` then the residual branch's dropout."""
        dense = dict(
            use_bias=self.bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            dot_general=rows_dot_general,
        )
        x = nn.Dense(self.dim_feedforward, name="linear1", **dense)(x)
        x = nn.Dropout(self.dropout)(_ACTIVATIONS[self.activation](x), deterministic)
        x = nn.Dense(self.d_model, name="linear2", **dense)(x)
        return nn.Dropout(self.dropout)(x, deterministic)


class TransformerEncoderLayer(_TransformerSettings):
    """torch ``nn.TransformerEncoderLayer``: self-attention and feed-forward, post- or pre-norm."""

    @nn.compact
    def __call__(self, src, mask=None, is_causal: bool = False, deterministic: bool = True):
        """``src`` ``[batch, S, d_model]`` -> ``[batch, S, d_model]`` (``[S, batch, .]`` if not
        batch_first)."""
        self._check("TransformerEncoderLayer", src=src)
        x = self._to_batch_first(src)
        norm1, norm2 = self._layer_norm("norm1"), self._layer_norm("norm2")
        self_attn = self._attention("self_attn")

        def self_attention(y):
            y = self_attn(y, mask=mask, is_causal=is_causal, deterministic=deterministic)
            return nn.Dropout(self.dropout)(y, deterministic)

        if self.norm_first:
            x = x + self_attention(norm1(x))
            x = x + self._feed_forward(norm2(x), deterministic)
        else:
            x = norm1(x + self_attention(x))
            x = norm2(x + self._feed_forward(x, deterministic))
        return self._from_batch_first(self._constrained(x))


class TransformerDecoderLayer(_TransformerSettings):
    """torch ``nn.TransformerDecoderLayer``: self-attention, cross-attention to ``memory``,
    feed-forward."""

    @nn.compact
    def __call__(
        self,
        tgt,
        memory,
        tgt_mask=None,
        memory_mask=None,
        tgt_is_causal: bool = False,
        deterministic: bool = True,
    ):
        """``tgt`` ``[batch, T, d_model]``, ``memory`` ``[batch, S, d_model]`` ->
        ``[batch, T, d_model]``.

        ``tgt_mask`` broadcasts to ``[batch, heads, T, T]``, ``memory_mask`` to
        ``[batch, heads, T, S]``.
        """
        self._check("TransformerDecoderLayer", tgt=tgt, memory=memory)
        x, memory = self._to_batch_first(tgt), self._to_batch_first(memory)
        norm1, norm2, norm3 = (self._layer_norm(f"norm{i}") for i in (1, 2, 3))
        self_attn, cross_attn = self._attention("self_attn"), self._attention("multihead_attn")

        def self_attention(y):
            y = self_attn(y, mask=tgt_mask, is_causal=tgt_is_causal, deterministic=deterministic)
            return nn.Dropout(self.dropout)(y, deterministic)

        def cross_attention(y):
            y = cross_attn(y, memory, mask=memory_mask, deterministic=deterministic)
            return nn.Dropout(self.dropout)(y, deterministic)

        if self.norm_first:
            x = x + self_attention(norm1(x))
            x = x + cross_attention(norm2(x))
            x = x + self._feed_forward(norm3(x), deterministic)
        else:
            x = norm1(x + self_attention(x))
            x = norm2(x + cross_attention(x))
            x = norm3(x + self._feed_forward(x, deterministic))
        return self._from_batch_first(self._constrained(x))


class TransformerEncoder(_TransformerSettings):
    """torch ``nn.TransformerEncoder``: ``num_layers`` encoder layers ``layers_N``, then an optional
    final LayerNorm ``norm`` (``final_norm=True``; torch's ``norm=`` argument)."""

    num_layers: int = 6
    final_norm: bool = False

    @nn.compact
    def __call__(self, src, mask=None, is_causal: bool = False, deterministic: bool = True):
        """``src`` ``[batch, S, d_model]`` -> ``[batch, S, d_model]`` (``[S, batch, .]`` if not
        batch_first)."""
        self._check("TransformerEncoder", src=src)
        x = self._to_batch_first(src)
        for i in range(self.num_layers):
            layer = TransformerEncoderLayer(**self._layer_settings(), name=f"layers_{i}")
            x = layer(x, mask, is_causal, deterministic)
        if self.final_norm:
            x = self._layer_norm("norm")(x)
        return self._from_batch_first(x)


class TransformerDecoder(_TransformerSettings):
    """torch ``nn.TransformerDecoder``: ``num_layers`` decoder layers ``layers_N``, then an optional
    final LayerNorm ``norm`` (``final_norm=True``)."""

    num_layers: int = 6
    final_norm: bool = False

    @nn.compact
    def __call__(
        self,
        tgt,
        memory,
        tgt_mask=None,
        memory_mask=None,
        tgt_is_causal: bool = False,
        deterministic: bool = True,
    ):
        """``tgt`` ``[batch, T, d_model]``, ``memory`` ``[batch, S, d_model]`` ->
        ``[batch, T, d_model]``."""
        self._check("TransformerDecoder", tgt=tgt, memory=memory)
        x, memory = self._to_batch_first(tgt), self._to_batch_first(memory)
        for i in range(self.num_layers):
            layer = TransformerDecoderLayer(**self._layer_settings(), name=f"layers_{i}")
            x = layer(x, memory, tgt_mask, memory_mask, tgt_is_causal, deterministic)
        if self.final_norm:
            x = self._layer_norm("norm")(x)
        return self._from_batch_first(x)


class Transformer(_TransformerSettings):
    """torch ``nn.Transformer``: an ``encoder`` and a ``decoder``, each ending in a LayerNorm."""

    num_encoder_layers: int = 6
    num_decoder_layers: int = 6

    @nn.compact
    def __call__(
        self,
        src,
        tgt,
        src_mask=None,
        tgt_mask=None,
        memory_mask=None,
        src_is_causal: bool = False,
        tgt_is_causal: bool = False,
        deterministic: bool = True,
    ):
        """``src`` ``[batch, S, d_model]``, ``tgt`` ``[batch, T, d_model]`` ->
        ``[batch, T, d_model]``.

        ``src_mask`` broadcasts to ``[batch, heads, S, S]``, ``tgt_mask`` to
        ``[batch, heads, T, T]``, ``memory_mask`` to ``[batch, heads, T, S]`` (padded source tokens
        go in both ``src_mask`` and ``memory_mask``).
        """
        self._check("Transformer", src=src, tgt=tgt)
        src, tgt = self._to_batch_first(src), self._to_batch_first(tgt)
        settings = self._layer_settings()
        memory = TransformerEncoder(
            **settings, num_layers=self.num_encoder_layers, final_norm=True, name="encoder"
        )(src, src_mask, src_is_causal, deterministic)
        out = TransformerDecoder(
            **settings, num_layers=self.num_decoder_layers, final_norm=True, name="decoder"
        )(tgt, memory, tgt_mask, memory_mask, tgt_is_causal, deterministic)
        return self._from_batch_first(out)


__all__ = (
    "TransformerEncoderLayer",
    "TransformerEncoder",
    "TransformerDecoderLayer",
    "TransformerDecoder",
    "Transformer",
)
