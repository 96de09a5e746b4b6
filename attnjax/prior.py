"""Transformer prior over VQGAN code indices: taming's minGPT in Flax, and its samplers.

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
prefix token: logits at ids ``>= codebook_size`` are masked out.

Samplers (both one jit-compiled program, batched, determined by the PRNG key: step ``i`` draws
with ``fold_in(rng, i)``):

* ``sample``: key/value cache (``decode=True``). The prefix fills the cache in one call, then a
  ``lax.scan`` feeds one token per step, so each new token costs attention over the cache only.
* ``sample_recompute``: the reference; a ``lax.fori_loop`` that runs the full causal pass over
  the whole (fixed-size) sequence buffer for every token.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attnjax.attention import MultiHeadAttention

Array = jax.Array
_INIT = nn.initializers.normal(stddev=0.02)  # minGPT's init for Linear and Embedding weights
_LN_EPS = 1e-5  # torch.nn.LayerNorm's default


class MlpBlock(nn.Module):
    """``[batch, length, n_embd] -> [batch, length, n_embd]``: fc1 (x4), exact GELU, fc2, dropout."""

    resid_pdrop: float = 0.0

    @nn.compact
    def __call__(self, x, *, deterministic: bool = True):
        width = x.shape[-1]
        x = nn.Dense(4 * width, kernel_init=_INIT, name="fc1")(x)
        x = nn.gelu(x, approximate=False)
        x = nn.Dense(width, kernel_init=_INIT, name="fc2")(x)
        return nn.Dropout(self.resid_pdrop)(x, deterministic=deterministic)


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    n_head: int
    attn_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    decode: bool = False

    @nn.compact
    def __call__(self, x, *, deterministic: bool = True):
        y = nn.LayerNorm(epsilon=_LN_EPS, name="ln1")(x)
        y = MultiHeadAttention(
            num_heads=self.n_head,
            dropout_rate=self.attn_pdrop,
            decode=self.decode,
            kernel_init=_INIT,
            name="attn",
        )(y, is_causal=True, deterministic=deterministic)
        x = x + nn.Dropout(self.resid_pdrop)(y, deterministic=deterministic)
        y = nn.LayerNorm(epsilon=_LN_EPS, name="ln2")(x)
        return x + MlpBlock(self.resid_pdrop, name="mlp")(y, deterministic=deterministic)


class GPT(nn.Module):
    """minGPT: ``indices [batch, length] -> logits [batch, length, vocab_size]``, causal.

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
        tokens = nn.Embed(self.vocab_size, self.n_embd, embedding_init=_INIT, name="tok_emb")(indices)
        pos_emb = self.param("pos_emb", nn.initializers.zeros, (1, self.block_size, self.n_embd))
        start = 0
        if self.decode:
            allocated = self.has_variable("cache", "position")
            position = self.variable("cache", "position", lambda: jnp.array(0, jnp.int32))
            if allocated:
                start = position.value
                position.value = start + length
        x = tokens + jax.lax.dynamic_slice_in_dim(pos_emb, start, length, axis=1)
        x = nn.Dropout(self.embd_pdrop)(x, deterministic=deterministic)
        for i in range(self.n_layer):
            x = Block(
                self.n_head, self.attn_pdrop, self.resid_pdrop, self.decode, name=f"blocks_{i}"
            )(x, deterministic=deterministic)
        x = nn.LayerNorm(epsilon=_LN_EPS, name="ln_f")(x)
        return nn.Dense(self.vocab_size, use_bias=False, kernel_init=_INIT, name="head")(x)


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
            raise ValueError("prefix_tokens: an unconditional prefix needs batch (or labels for its size)")
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
    """Mean negative log-likelihood in nats per token: ``[batch, n, vocab]``, ``[batch, n]`` -> scalar."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, codes[..., None].astype(jnp.int32), axis=-1)
    return -jnp.mean(picked)


def bits_per_token(nll_nats):
    return nll_nats / math.log(2.0)


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


def filter_logits(logits, *, num_codes: int | None = None, top_k: int | None = None, top_p=None):
    """Mask logits ``[batch, vocab]`` to ``-inf`` outside the allowed set.

    ``num_codes``: ids ``>= num_codes`` (prefix tokens) are never sampled. ``top_k``: keep logits
    ``>=`` the k-th largest (taming's ``top_k_logits``: ties at the threshold survive).
    ``top_p``: keep the smallest set of most likely tokens whose probability reaches ``top_p``
    (the token that crosses it included).
    """
    vocab = logits.shape[-1]
    if num_codes is not None and num_codes < vocab:
        logits = jnp.where(jnp.arange(vocab) < num_codes, logits, -jnp.inf)
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < top_p  # the most likely token always has mass_before = 0
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


class Settings(NamedTuple):
    """How a token is picked from the model's logits (a static, hashable jit argument)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    num_codes: int | None = None
    guidance: float | None = None

    def check(self, vocab: int) -> "Settings":
        if self.temperature < 0:
            raise ValueError(f"sample: temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and not 1 <= self.top_k <= vocab:
            raise ValueError(f"sample: top_k must be in [1, {vocab}] (the vocab size), got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sample: top_p must be in (0, 1], got {self.top_p}")
        if self.num_codes is not None and not 1 <= self.num_codes <= vocab:
            raise ValueError(
                f"sample: num_codes must be in [1, {vocab}] (the vocab size), got {self.num_codes}")
        return self._replace(
            temperature=float(self.temperature),
            top_p=None if self.top_p is None else float(self.top_p),
            guidance=None if self.guidance is None else float(self.guidance),
        )


def _guide(logits, settings: Settings):
    """``[2 batch, vocab]`` (conditional rows, then unconditional) -> guided ``[batch, vocab]``.

    Classifier-free guidance: ``u + w (c - u)``; ``w = 1`` is the conditional model itself.
    Without guidance the logits pass through.
    """
    if settings.guidance is None:
        return logits
    conditional, unconditional = jnp.split(logits, 2, axis=0)
    return unconditional + settings.guidance * (conditional - unconditional)


def _pick(logits, rng, settings: Settings):
    """One token per row of ``logits [batch, vocab]``: greedy when ``temperature == 0``."""
    if settings.temperature == 0:
        filtered = filter_logits(logits, num_codes=settings.num_codes)
        return jnp.argmax(filtered, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits / settings.temperature, num_codes=settings.num_codes,
                             top_k=settings.top_k, top_p=settings.top_p)
    return jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)


def _check_lengths(model: GPT, prefix, steps):
    if prefix.ndim != 2 or prefix.shape[1] < 1:
        raise ValueError(f"sample: prefix must be [batch, p] with p >= 1, got shape {prefix.shape}")
    if steps < 1:
        raise ValueError(f"sample: steps must be >= 1, got {steps}")
    if prefix.shape[1] + steps - 1 > model.block_size:
        raise ValueError(
            f"sample: prefix length {prefix.shape[1]} + steps {steps} - 1 exceeds the model's "
            f"block_size={model.block_size}"
        )


def _both_halves(token, settings: Settings):
    """The picked ``[batch]`` tokens for every row the model runs (both halves under guidance)."""
    return token if settings.guidance is None else jnp.concatenate([token, token])


@functools.partial(jax.jit, static_argnames=("model", "steps", "settings"))
def _sample_cached(model, params, prefix, rng, steps, settings):
    decoder = model.clone(decode=True)
    rows, prefix_length = prefix.shape
    shapes = jax.eval_shape(
        decoder.init, jax.random.key(0), jnp.zeros((rows, prefix_length + steps - 1), jnp.int32)
    )
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])

    def forward(cache, tokens):
        logits, updated = decoder.apply(
            {"params": params, "cache": cache}, tokens, mutable=["cache"]
        )
        return updated["cache"], _guide(logits[:, -1].astype(jnp.float32), settings)

    cache, logits = forward(cache, prefix)

    def step(carry, i):
        cache, logits = carry
        token = _pick(logits, jax.random.fold_in(rng, i), settings)
        cache, next_logits = forward(cache, _both_halves(token, settings)[:, None])
        return (cache, next_logits), (token, logits)

    (_, last_logits), (tokens, logits_seen) = jax.lax.scan(
        step, (cache, logits), jnp.arange(steps - 1)
    )
    last = _pick(last_logits, jax.random.fold_in(rng, steps - 1), settings)
    tokens = jnp.concatenate([tokens, last[None]], axis=0).T  # [batch, steps]
    logits_seen = jnp.concatenate([logits_seen, last_logits[None]], axis=0)
    return tokens, jnp.swapaxes(logits_seen, 0, 1)


@functools.partial(jax.jit, static_argnames=("model", "steps", "settings"))
def _sample_recompute(model, params, prefix, rng, steps, settings):
    rows, prefix_length = prefix.shape
    batch = rows if settings.guidance is None else rows // 2
    # Positions past the current one hold zeros; the causal mask keeps them out of its logits.
    buffer = jnp.zeros((rows, prefix_length + steps), jnp.int32).at[:, :prefix_length].set(prefix)
    logits_seen = jnp.zeros((batch, steps, model.vocab_size), jnp.float32)

    def step(i, carry):
        buffer, logits_seen = carry
        all_logits = model.apply({"params": params}, buffer[:, :-1])
        logits = jax.lax.dynamic_index_in_dim(all_logits, prefix_length - 1 + i, 1, keepdims=False)
        logits = _guide(logits.astype(jnp.float32), settings)
        token = _both_halves(_pick(logits, jax.random.fold_in(rng, i), settings), settings)
        buffer = jax.lax.dynamic_update_slice(buffer, token[:, None], (0, prefix_length + i))
        logits_seen = jax.lax.dynamic_update_slice(logits_seen, logits[:, None], (0, i, 0))
        return buffer, logits_seen

    buffer, logits_seen = jax.lax.fori_loop(0, steps, step, (buffer, logits_seen))
    return buffer[:batch, prefix_length:], logits_seen


def _sample(sampler, model, params, prefix, rng, steps, settings: Settings, null_prefix):
    prefix = jnp.asarray(prefix, jnp.int32)
    _check_lengths(model, prefix, steps)
    settings = settings.check(model.vocab_size)
    if (settings.guidance is None) != (null_prefix is None):
        raise ValueError(
            "sample: guidance and null_prefix go together (classifier-free guidance needs the "
            f"unconditional prefix), got guidance={settings.guidance}, null_prefix "
            f"{'None' if null_prefix is None else 'given'}"
        )
    if null_prefix is not None:
        null_prefix = jnp.asarray(null_prefix, jnp.int32)
        if null_prefix.shape != prefix.shape:
            raise ValueError(
                f"sample: null_prefix shape {null_prefix.shape} must equal prefix shape {prefix.shape}")
        prefix = jnp.concatenate([prefix, null_prefix], axis=0)
    return sampler(model, params, prefix, rng, steps, settings)


def sample(model: GPT, params, prefix, rng, steps: int, *, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, num_codes: int | None = None,
           guidance: float | None = None, null_prefix=None, return_logits: bool = False):
    """Sample ``steps`` tokens after ``prefix [batch, p]`` with the key/value cache.

    Args:
      model: a ``GPT`` (``decode`` False; the sampler makes its decoding twin).
      params: its parameters.
      prefix: ``[batch, p]`` int tokens to continue (e.g. ``prefix_tokens(labels, ...)``).
      rng: PRNG key; step ``i`` uses ``fold_in(rng, i)``; rows of the batch draw independently.
      steps: tokens to generate; ``p + steps - 1 <= block_size``.
      temperature: logits are divided by it; 0 picks the most likely token (top-k/p ignored).
      top_k, top_p: see ``filter_logits``.
      num_codes: ids ``>= num_codes`` are never sampled (the prefix tokens).
      guidance, null_prefix: classifier-free guidance: the model also runs on ``null_prefix``
        ``[batch, p]`` (the unconditional prefix it was trained with) and tokens are drawn from
        ``u + guidance * (c - u)`` of the unconditional and conditional logits.
      return_logits: also return the logits each pick drew from (guided, before temperature).

    Returns:
      tokens ``[batch, steps]`` int32, and with ``return_logits`` the logits
      ``[batch, steps, vocab]`` float32.
    """
    settings = Settings(temperature, top_k, top_p, num_codes, guidance)
    tokens, logits = _sample(_sample_cached, model, params, prefix, rng, steps, settings, null_prefix)
    return (tokens, logits) if return_logits else tokens


def sample_recompute(model: GPT, params, prefix, rng, steps: int, *, temperature: float = 1.0,
                     top_k: int | None = None, top_p: float | None = None,
                     num_codes: int | None = None, guidance: float | None = None,
                     null_prefix=None, return_logits: bool = False):
    """``sample`` without a cache: the full causal pass over the whole sequence for every token.

    Same arguments, same keys, same results; the reference for ``sample`` and its benchmark.
    """
    settings = Settings(temperature, top_k, top_p, num_codes, guidance)
    tokens, logits = _sample(_sample_recompute, model, params, prefix, rng, steps, settings,
                             null_prefix)
    return (tokens, logits) if return_logits else tokens


# --------------------------------------------------------------------------------------------
# Images: sampled codes through the VQGAN decoder
# --------------------------------------------------------------------------------------------


def image_grid(images, nrow: int) -> np.ndarray:
    """``[n, H, W, C]`` floats in [0, 1] -> one uint8 image ``[rows * (H+1) + 1, nrow * (W+1) + 1, C]``.

    Images fill rows left to right; a one-pixel white border separates them.
    """
    images = np.clip(np.asarray(images, np.float32), 0.0, 1.0)
    n, height, width, channels = images.shape
    rows = -(-n // nrow)
    grid = np.ones((rows * (height + 1) + 1, nrow * (width + 1) + 1, channels), np.float32)
    for i, image in enumerate(images):
        r, c = divmod(i, nrow)
        grid[1 + r * (height + 1):(r + 1) * (height + 1), 1 + c * (width + 1):(c + 1) * (width + 1)] = image
    return np.round(grid * 255.0).astype(np.uint8)


def save_image_grid(images, path: str, nrow: int, scale: int = 1) -> str:
    """Writes ``image_grid(images, nrow)`` as a PNG, each pixel ``scale`` x ``scale``; returns the path."""
    from PIL import Image

    grid = image_grid(images, nrow)
    if scale > 1:
        grid = grid.repeat(scale, axis=0).repeat(scale, axis=1)
    Image.fromarray(grid[..., 0] if grid.shape[-1] == 1 else grid).save(path)
    return path


def sample_images(model: GPT, params, vqgan, vqgan_variables, labels, rng, *, grid_shape,
                  codebook_size: int, num_classes: int, num_samples: int | None = None,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  guidance: float | None = None, mean=0.5, std=0.5, path: str | None = None,
                  nrow: int | None = None, scale: int = 1):
    """Sample code grids and decode them with the VQGAN: ``(codes [b, h, w], images [b, H, W, C])``.

    Args:
      model, params: the prior.
      vqgan, vqgan_variables: a VQGAN module with ``decode_indices([b, h, w]) -> [b, H, W, C]``
        and its variables.
      labels: ``[b]`` class ids for a class-conditional prior; None for an unconditional one
        (then ``num_samples`` gives the batch).
      rng: PRNG key of the sampler.
      grid_shape: the token grid ``(h, w)``; ``h * w`` tokens are sampled in raster order.
      codebook_size, num_classes: the prior's vocabulary (see ``prefix_tokens``).
      temperature, top_k, top_p, guidance: the sampler's (guidance needs a prior trained with
        a null class; see ``vocab_size``).
      mean, std: the VQGAN's pixel normalisation; images are returned as ``x * std + mean``
        (in [0, 1] for a well trained model).
      path: if given, the images are saved there as a PNG grid of ``nrow`` columns.
    """
    height, width = grid_shape
    batch = num_samples if labels is None else len(labels)
    prefix = prefix_tokens(labels, codebook_size, num_classes, batch)
    null_prefix = None if guidance is None else null_tokens(codebook_size, num_classes, batch)
    codes = sample(model, params, prefix, rng, height * width, temperature=temperature,
                   top_k=top_k, top_p=top_p, num_codes=codebook_size, guidance=guidance,
                   null_prefix=null_prefix)
    codes = codes.reshape(batch, height, width)
    decoded = jax.jit(functools.partial(vqgan.apply, method=type(vqgan).decode_indices))(
        vqgan_variables, codes)
    images = np.asarray(decoded) * np.asarray(std, np.float32) + np.asarray(mean, np.float32)
    if path is not None:
        save_image_grid(images, path, nrow or batch, scale)
    return codes, images
