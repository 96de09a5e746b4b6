"""Transformer prior over VQGAN code indices: taming's minGPT in Flax, and its token helpers.

The model is minGPT as taming-transformers uses it (``taming.modules.transformer.mingpt.GPT``):
token embedding + learned position embedding ``[1, block_size, n_embd]``, embedding dropout,
``n_layer`` pre-LN blocks (causal self-attention, then an MLP ``n_embd -> 4 n_embd -> n_embd``
with exact GELU), a final LayerNorm and a bias-free head onto the vocabulary. LayerNorms use
PyTorch's ``eps=1e-5``. Parameter names follow taming's so ``convert.taming.gpt_from_taming`` is
a table: ``tok_emb``, ``pos_emb``, ``blocks_N/{ln1, attn/{query,key,value,out}, ln2,
mlp/{fc1,fc2}}``, ``ln_f``, ``head``.

Sequences and vocabulary. An image is ``num_codes`` indices in raster order (row by row of the
VQGAN's token grid). One prefix token comes first, as taming's ``Net2NetTransformer`` prepends
``c_indices``:

* class-conditional: class ``c`` is token ``codebook_size + c``; vocab ``codebook_size +
  num_classes``. (taming's ``Labelator`` uses the raw class id, sharing ids with the codes; the
  offset keeps a class token and a code apart. A taming model trained that way is sampled here
  by passing its raw ids as ``prefix``.)
* unconditional: a start token ``codebook_size`` (taming's ``SOSProvider``); vocab
  ``codebook_size + 1``.
* classifier-free guidance (beyond taming): a class-conditional prior trained with the class
  sometimes replaced by a null token ``codebook_size + num_classes`` (vocab + 1) is also an
  unconditional one; sampling can then push the logits away from the unconditional ones,
  ``u + w (c - u)``, for samples that look more like their class.

The model reads ``[prefix, code_0 .. code_{n-2}]`` (``block_size = num_codes``) and position
``i`` predicts ``code_i``, exactly taming's ``logits[:, c_len - 1:]``. Sampling never emits a
prefix token: logits at ids ``>= codebook_size`` are masked out (``num_codes`` of the samplers).

The samplers live in ``attnjax.models.sampling``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnjax.models.multihead import PARAM_AXES as ATTENTION_AXES
from attnjax.models.multihead import MultiHeadAttention, feed_forward_axes
from attnjax.ops.activations import gelu
from attnjax.ops.dense import rows_dot_general

Array = jax.Array
_INIT = nn.initializers.normal(stddev=0.02)  # minGPT's init for Linear and Embedding weights
_LN_EPS = 1e-5  # torch.nn.LayerNorm's default
# The logit of a padding id: finite, so that guidance's difference of two logits stays 0 there
# (two -inf would give NaN), and far enough below any real logit that exp() of it is 0.
PADDED_LOGIT = -1e30
# Logical axis names of the parameters, by path (``attnjax.parallel.sharding`` lays them out on a
# mesh): the attention's, the MLP's hidden units, and the vocabulary of the embedding and head.
PARAM_AXES = (
    *ATTENTION_AXES,
    *feed_forward_axes("mlp/fc1", "mlp/fc2"),
    (r"(^|/)tok_emb/embedding$", ("vocab", "embed")),
    (r"(^|/)head/kernel$", ("embed", "vocab")),
)


class GPTMlp(nn.Module):
    """minGPT's MLP, ``[batch, length, n_embd] -> [batch, length, n_embd]``: fc1 (4 x n_embd),
    exact GELU, fc2, dropout."""

    resid_pdrop: float = 0.0
    dtype: Any = None  # computation dtype; parameters stay float32

    @nn.compact
    def __call__(self, x, *, deterministic: bool = True):
        width = x.shape[-1]
        dense = functools.partial(
            nn.Dense, kernel_init=_INIT, dtype=self.dtype, dot_general=rows_dot_general
        )
        x = dense(4 * width, name="fc1")(x)
        x = gelu(x)
        x = dense(width, name="fc2")(x)
        return nn.Dropout(self.resid_pdrop)(x, deterministic=deterministic)


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    n_head: int
    attn_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    decode: bool = False
    dtype: Any = None

    # ``deterministic`` may come positionally: ``nn.remat`` holds only positional arguments
    # static, and a traced flag could not switch dropout.
    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        y = nn.LayerNorm(epsilon=_LN_EPS, dtype=self.dtype, name="ln1")(x)
        y = MultiHeadAttention(
            num_heads=self.n_head,
            dropout_rate=self.attn_pdrop,
            decode=self.decode,
            kernel_init=_INIT,
            dtype=self.dtype,
            name="attn",
        )(y, is_causal=True, deterministic=deterministic)
        x = x + nn.Dropout(self.resid_pdrop)(y, deterministic=deterministic)
        y = nn.LayerNorm(epsilon=_LN_EPS, dtype=self.dtype, name="ln2")(x)
        mlp = GPTMlp(self.resid_pdrop, dtype=self.dtype, name="mlp")
        x = x + mlp(y, deterministic=deterministic)
        # The residual stream stays split by the batch (attnjax.parallel.sharding's activation
        # rules).
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class GPT(nn.Module):
    """minGPT: ``indices [batch, length] -> logits [batch, length, padded_vocab_size]``, causal.

    ``vocab_multiple`` > 1 pads the embedding's rows and the head's columns up to a multiple of
    it (Megatron's ``--make-vocab-size-divisible-by``), so that a ``model`` mesh axis splits the
    vocabulary evenly whatever the codebook and class count (a class-conditional prior with a
    null class has an odd vocabulary: 16384 + 1000 + 1). The padded ids are never fed in, and
    their logits are ``PADDED_LOGIT``: no probability, no gradient, never sampled; the logits
    keep the padded width, which slicing would unbalance over the vocabulary's shards.

    With ``decode=True`` the model keeps a ``cache`` collection (the attention caches and
    ``position``, the index of the next position embedding); ``init`` with a
    ``[batch, max_length]`` input allocates it, and each ``apply(..., chunk, mutable=["cache"])``
    continues the sequence by ``chunk.shape[1]`` tokens.
    """

    vocab_size: int
    block_size: int
    n_layer: int = 12
    n_head: int = 8
    n_embd: int = 256
    embd_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    attn_pdrop: float = 0.0
    decode: bool = False
    dtype: Any = None  # computation dtype (e.g. jnp.bfloat16); parameters stay float32
    remat: bool = False  # recompute each block in the backward pass: memory for compute
    vocab_multiple: int = 1

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @nn.compact
    def __call__(self, indices, *, deterministic: bool = True):
        if indices.ndim != 2:
            raise ValueError(f"GPT: indices must be [batch, length], got shape {indices.shape}")
        length = indices.shape[1]
        if length > self.block_size:
            raise ValueError(
                f"GPT: sequence length {length} exceeds block_size={self.block_size} "
                f"(indices shape {indices.shape})"
            )
        if self.vocab_multiple < 1:
            raise ValueError(f"GPT: vocab_multiple must be >= 1, got {self.vocab_multiple}")
        tokens = nn.Embed(
            self.padded_vocab_size,
            self.n_embd,
            embedding_init=_INIT,
            dtype=self.dtype,
            name="tok_emb",
        )(indices)
        pos_emb = self.param("pos_emb", nn.initializers.zeros, (1, self.block_size, self.n_embd))
        start = 0
        if self.decode:
            allocated = self.has_variable("cache", "position")
            position = self.variable("cache", "position", lambda: jnp.array(0, jnp.int32))
            if allocated:
                start = position.value
                position.value = start + length
        x = tokens + jax.lax.dynamic_slice_in_dim(pos_emb, start, length, axis=1).astype(
            tokens.dtype
        )
        x = nn.Dropout(self.embd_pdrop)(x, deterministic=deterministic)
        # Sampling keeps its caches and takes no gradient: nothing for remat to save there.
        block = nn.remat(Block, static_argnums=(2,)) if self.remat and not self.decode else Block
        for i in range(self.n_layer):
            x = block(
                self.n_head,
                self.attn_pdrop,
                self.resid_pdrop,
                self.decode,
                dtype=self.dtype,
                name=f"blocks_{i}",
            )(x, deterministic)
        x = nn.LayerNorm(epsilon=_LN_EPS, dtype=self.dtype, name="ln_f")(x)
        head = nn.Dense(
            self.padded_vocab_size,
            use_bias=False,
            kernel_init=_INIT,
            dtype=self.dtype,
            dot_general=rows_dot_general,
            name="head",
        )
        logits = head(x).astype(jnp.float32)  # the loss and the sampler's filters in float32
        if self.padded_vocab_size > self.vocab_size:
            real = jnp.arange(self.padded_vocab_size) < self.vocab_size
            logits = jnp.where(real, logits, PADDED_LOGIT)
        return logits


# --------------------------------------------------------------------------------------------
# Sequences: prefix tokens and the training objective
# --------------------------------------------------------------------------------------------


def vocab_size(codebook_size: int, num_classes: int, null_class: bool = False) -> int:
    """Vocabulary of the prior: the codes, one token per class, and the null/start token.

    The null token ``codebook_size + num_classes`` exists when ``null_class`` (class-conditional
    training that sometimes hides the class, for classifier-free guidance) or when the prior is
    unconditional (``num_classes == 0``: it is the start token).
    """
    return codebook_size + num_classes + int(null_class or num_classes == 0)


def null_tokens(codebook_size: int, num_classes: int, batch: int) -> Array:
    """The null prefix ``[batch, 1]``: the start token of an unconditional prior."""
    return jnp.full((batch, 1), codebook_size + num_classes, jnp.int32)


def prefix_tokens(labels, codebook_size: int, num_classes: int, batch: int | None = None) -> Array:
    """The prefix column ``[batch, 1]``: ``codebook_size + label``, or the start token.

    Args:
      labels: class ids ``[batch]`` (class-conditional, ``num_classes > 0``) or None.
      codebook_size: number of VQGAN codes.
      num_classes: 0 for an unconditional prior.
      batch: the batch size when ``labels`` is None.
    """
    if num_classes > 0:
        if labels is None:
            raise ValueError(f"prefix_tokens: num_classes={num_classes} needs labels, got None")
        labels = jnp.asarray(labels, jnp.int32)
        if labels.ndim != 1:
            raise ValueError(f"prefix_tokens: labels must be [batch], got shape {labels.shape}")
        return (codebook_size + labels)[:, None]
    if batch is None:
        if labels is None:
            raise ValueError(
                "prefix_tokens: an unconditional prefix needs batch (or labels for its size)"
            )
        batch = len(labels)
    return null_tokens(codebook_size, 0, batch)


def sequence_logits(model: GPT, params, codes, prefix, *, deterministic=True, rngs=None) -> Array:
    """Logits for every code: ``codes [batch, n]``, ``prefix [batch, p]`` -> ``[batch, n, vocab]``.

    The model reads ``[prefix, codes[:, :-1]]``; output position ``p - 1 + i`` predicts code ``i``.
    """
    inputs = jnp.concatenate([prefix, codes[:, :-1]], axis=1)
    logits = model.apply({"params": params}, inputs, deterministic=deterministic, rngs=rngs)
    return logits[:, prefix.shape[1] - 1 :]


def cross_entropy(logits, codes) -> Array:
    """Mean negative log-likelihood in nats per token: ``[batch, n, vocab]``, ``[batch, n]`` ->
    scalar."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, codes[..., None].astype(jnp.int32), axis=-1)
    return -jnp.mean(picked)


def bits_per_token(nll_nats):
    return nll_nats / math.log(2.0)
