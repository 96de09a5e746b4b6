"""Samplers for the ``GPT`` prior: token by token, batched, one jit-compiled program each.

Both are determined by the PRNG key (step ``i`` draws with ``fold_in(rng, i)``) and give the same
tokens for the same key:

* ``sample``: key/value cache (``decode=True``). The prefix fills the cache in one call, then a
  ``lax.scan`` feeds one token per step, so each new token costs attention over the cache only.
* ``sample_recompute``: the reference; a ``lax.fori_loop`` that runs the full causal pass over
  the whole (fixed-size) sequence buffer for every token.

Logits are ``[batch, vocab]`` per step; sequences are ``[batch, length]`` int32. Classifier-free
guidance runs the model on ``2 batch`` rows (the conditional prefixes, then the unconditional
ones) and draws from ``u + w (c - u)``; see ``attnjax.models.gpt`` for the vocabulary and prefixes.

On a mesh (tensor parallelism): place the parameters by the prior's partition rules and sample
under the mesh and Flax logical axis rules that name the key/value caches' axes
(``attnjax.models.multihead.CACHE_AXES``); each device then keeps its heads' slice of every
cache, and the tokens are one device's. ``attnjax.inference.generate``'s ``place_params`` and
``on_mesh`` do both::

    with generate.on_mesh(mesh):
        tokens = sample(model, generate.place_params(params, mesh), prefix, rng, steps)

The rules in force are a static argument of the compiled samplers, so sampling under other rules
(or none) compiles anew rather than reuse a program laid out for the first.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnjax.models.gpt import GPT


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


class SamplingSettings(NamedTuple):
    """How a token is picked from the model's logits (a static, hashable jit argument)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    num_codes: int | None = None
    guidance: float | None = None

    def check(self, vocab: int) -> "SamplingSettings":
        if self.temperature < 0:
            raise ValueError(
                f"sample: temperature must be >= 0 (0 = greedy), got {self.temperature}"
            )
        if self.top_k is not None and not 1 <= self.top_k <= vocab:
            raise ValueError(
                f"sample: top_k must be in [1, {vocab}] (the vocab size), got {self.top_k}"
            )
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sample: top_p must be in (0, 1], got {self.top_p}")
        if self.num_codes is not None and not 1 <= self.num_codes <= vocab:
            raise ValueError(
                f"sample: num_codes must be in [1, {vocab}] (the vocab size), got {self.num_codes}"
            )
        return self._replace(
            temperature=float(self.temperature),
            top_p=None if self.top_p is None else float(self.top_p),
            guidance=None if self.guidance is None else float(self.guidance),
        )


def _guide(logits, settings: SamplingSettings):
    """``[2 batch, vocab]`` (conditional rows, then unconditional) -> guided ``[batch, vocab]``.

    Classifier-free guidance: ``u + w (c - u)``; ``w = 1`` is the conditional model itself.
    Without guidance the logits pass through.
    """
    if settings.guidance is None:
        return logits
    conditional, unconditional = jnp.split(logits, 2, axis=0)
    return unconditional + settings.guidance * (conditional - unconditional)


def _pick(logits, rng, settings: SamplingSettings):
    """One token per row of ``logits [batch, vocab]``: greedy when ``temperature == 0``."""
    if settings.temperature == 0:
        filtered = filter_logits(logits, num_codes=settings.num_codes)
        return jnp.argmax(filtered, axis=-1).astype(jnp.int32)
    filtered = filter_logits(
        logits / settings.temperature,
        num_codes=settings.num_codes,
        top_k=settings.top_k,
        top_p=settings.top_p,
    )
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


def _axis_rules() -> tuple:
    """Flax's logical axis rules in force, hashable: jit's cache keys do not see them."""
    return tuple(
        (name, tuple(axes) if isinstance(axes, list) else axes)
        for name, axes in nn.get_logical_axis_rules()
    )


def _apply(model: GPT, variables, tokens, axis_rules: tuple, **kwargs):
    with nn.logical_axis_rules(axis_rules):
        return model.apply(variables, tokens, **kwargs)


def _both_halves(token, settings: SamplingSettings):
    """The picked ``[batch]`` tokens for every row the model runs (both halves under guidance)."""
    return token if settings.guidance is None else jnp.concatenate([token, token])


@functools.partial(jax.jit, static_argnames=("model", "steps", "settings", "axis_rules"))
def _sample_cached(model, params, prefix, rng, steps, settings, axis_rules):
    decoder = model.clone(decode=True)
    rows, prefix_length = prefix.shape
    shapes = jax.eval_shape(
        decoder.init, jax.random.key(0), jnp.zeros((rows, prefix_length + steps - 1), jnp.int32)
    )
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])

    def forward(cache, tokens):
        logits, updated = _apply(
            decoder, {"params": params, "cache": cache}, tokens, axis_rules, mutable=["cache"]
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


@functools.partial(jax.jit, static_argnames=("model", "steps", "settings", "axis_rules"))
def _sample_recompute(model, params, prefix, rng, steps, settings, axis_rules):
    rows, prefix_length = prefix.shape
    batch = rows if settings.guidance is None else rows // 2
    # Positions past the current one hold zeros; the causal mask keeps them out of its logits.
    buffer = jnp.zeros((rows, prefix_length + steps), jnp.int32).at[:, :prefix_length].set(prefix)
    logits_seen = jnp.zeros((batch, steps, model.padded_vocab_size), jnp.float32)

    def step(i, carry):
        buffer, logits_seen = carry
        all_logits = _apply(model, {"params": params}, buffer[:, :-1], axis_rules)
        logits = jax.lax.dynamic_index_in_dim(all_logits, prefix_length - 1 + i, 1, keepdims=False)
        logits = _guide(logits.astype(jnp.float32), settings)
        token = _both_halves(_pick(logits, jax.random.fold_in(rng, i), settings), settings)
        buffer = jax.lax.dynamic_update_slice(buffer, token[:, None], (0, prefix_length + i))
        logits_seen = jax.lax.dynamic_update_slice(logits_seen, logits[:, None], (0, i, 0))
        return buffer, logits_seen

    buffer, logits_seen = jax.lax.fori_loop(0, steps, step, (buffer, logits_seen))
    return buffer[:batch, prefix_length:], logits_seen


def _prepare(model, prefix, steps, settings: SamplingSettings, null_prefix):
    """Checked settings and the prefix rows the model runs (``[2 batch, p]`` under guidance)."""
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
                f"sample: null_prefix shape {null_prefix.shape} must equal "
                f"prefix shape {prefix.shape}"
            )
        prefix = jnp.concatenate([prefix, null_prefix], axis=0)
    return prefix, settings


def _sample(sampler, model, params, prefix, rng, steps, settings: SamplingSettings, null_prefix):
    prefix, settings = _prepare(model, prefix, steps, settings, null_prefix)
    return sampler(model, params, prefix, rng, steps, settings, _axis_rules())


def sample(
    model: GPT,
    params,
    prefix,
    rng,
    steps: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    num_codes: int | None = None,
    guidance: float | None = None,
    null_prefix=None,
    return_logits: bool = False,
):
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
    settings = SamplingSettings(temperature, top_k, top_p, num_codes, guidance)
    tokens, logits = _sample(
        _sample_cached, model, params, prefix, rng, steps, settings, null_prefix
    )
    return (tokens, logits) if return_logits else tokens


def sample_recompute(
    model: GPT,
    params,
    prefix,
    rng,
    steps: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    num_codes: int | None = None,
    guidance: float | None = None,
    null_prefix=None,
    return_logits: bool = False,
):
    """``sample`` without a cache: the full causal pass over the whole sequence for every token.

    Same arguments, same keys, same results; the reference for ``sample`` and its benchmark.
    """
    settings = SamplingSettings(temperature, top_k, top_p, num_codes, guidance)
    tokens, logits = _sample(
        _sample_recompute, model, params, prefix, rng, steps, settings, null_prefix
    )
    return (tokens, logits) if return_logits else tokens


# --------------------------------------------------------------------------------------------
# taming's sampling modes: a sliding window over a larger grid, and completion of a partial grid
# --------------------------------------------------------------------------------------------


def window_origin(position: int, grid: int, window: int) -> int:
    """First row (or column) of the window that predicts ``position`` along one grid axis.

    ``clip(position - window // 2, 0, grid - window)``: the window is centred on the token and
    clamped at the borders. For taming's 16-token window this is its ``sample_conditional.py``
    rule (local index ``i`` for ``i <= 8``, ``16 - (grid - i)`` when ``grid - i < 8``, else 8).
    """
    return min(max(position - window // 2, 0), grid - window)


def window_schedule(grid_shape, window_shape, start: int = 0):
    """Per sampled token (raster positions ``start ..``), the int32 columns of a ``[steps, 5]``
    table: row, column, window row, window column, and whether the cache must be refilled (the
    window moved, or the token is not the next one of the window's raster order)."""
    (height, width), (window_height, window_width) = grid_shape, window_shape
    rows, previous = [], None
    for position in range(start, height * width):
        i, j = divmod(position, width)
        top, left = window_origin(i, height, window_height), window_origin(j, width, window_width)
        local = (i - top) * window_width + (j - left)
        refill = previous is None or previous != (top, left, local - 1)
        rows.append((i, j, top, left, int(refill)))
        previous = (top, left, local)
    return jnp.asarray(rows, jnp.int32).reshape(-1, 5)


@functools.partial(jax.jit, static_argnames=("model", "window_shape", "settings", "axis_rules"))
def _sample_window(model, params, prefix, codes, schedule, rng, window_shape, settings, axis_rules):
    decoder = model.clone(decode=True)
    rows, prefix_length = prefix.shape
    window_height, window_width = window_shape
    sequence_length = prefix_length + window_height * window_width - 1
    shapes = jax.eval_shape(
        decoder.init, jax.random.key(0), jnp.zeros((rows, sequence_length), jnp.int32)
    )
    empty_cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])

    def run(cache, tokens):
        logits, updated = _apply(
            decoder, {"params": params, "cache": cache}, tokens, axis_rules, mutable=["cache"]
        )
        return updated["cache"], logits.astype(jnp.float32)

    def refill(codes, cache, token, top, left, local):
        del cache, token
        window = jax.lax.dynamic_slice(codes, (0, top, left), (rows, window_height, window_width))
        sequence = jnp.concatenate([prefix, window.reshape(rows, -1)[:, :-1]], axis=1)
        cache, logits = run(empty_cache, sequence)
        # The cache now holds the whole window; rewinding its counters to the next input
        # position lets the next token overwrite what follows (the causal mask hides the rest).
        next_position = prefix_length + local
        cache = jax.tree.map(lambda x: jnp.full_like(x, next_position) if x.ndim == 0 else x, cache)
        return cache, jax.lax.dynamic_index_in_dim(
            logits, prefix_length - 1 + local, 1, keepdims=False
        )

    def extend(codes, cache, token, top, left, local):
        del codes, top, left, local
        cache, logits = run(cache, token[:, None])
        return cache, logits[:, 0]

    def step(carry, inputs):
        codes, cache, token = carry
        s, (i, j, top, left, refill_needed) = inputs
        local = (i - top) * window_width + (j - left)
        cache, logits = jax.lax.cond(
            refill_needed > 0, refill, extend, codes, cache, token, top, left, local
        )
        logits = _guide(logits, settings)
        token = _both_halves(_pick(logits, jax.random.fold_in(rng, s), settings), settings)
        codes = jax.lax.dynamic_update_slice(codes, token[:, None, None], (0, i, j))
        return (codes, cache, token), logits

    token = jnp.zeros((rows,), jnp.int32)
    steps = jnp.arange(schedule.shape[0])
    (codes, _, _), logits_seen = jax.lax.scan(
        step, (codes, empty_cache, token), (steps, tuple(schedule.T))
    )
    batch = rows if settings.guidance is None else rows // 2
    return codes[:batch], jnp.swapaxes(logits_seen, 0, 1)


def sample_window(
    model: GPT,
    params,
    prefix,
    rng,
    grid_shape,
    window_shape,
    *,
    codes=None,
    start: int = 0,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    num_codes: int | None = None,
    guidance: float | None = None,
    null_prefix=None,
    return_logits: bool = False,
):
    """Sample a code grid ``grid_shape`` (>= the trained ``window_shape``) with a sliding window.

    taming-transformers' sliding-window sampling: token ``(i, j)`` (raster order) is predicted by
    the model reading ``[prefix, window[:-1]]``, where ``window`` is the ``window_shape`` block
    of the grid at origin ``(window_origin(i, H, h), window_origin(j, W, w))`` flattened in
    raster order, from that window's position of ``(i, j)``. Every code the causal model sees
    there is already sampled. taming recomputes the window for every token; here the key/value
    cache is refilled (one pass over the window) only when the window moves, and tokens that
    follow each other inside one window cost a single cached step. On the trained grid
    (``grid_shape == window_shape``) this is exactly ``sample``.

    Args:
      model, params, rng, temperature, top_k, top_p, num_codes, guidance, null_prefix: as in
        ``sample``; sampled token ``s`` (counting from ``start``) draws with ``fold_in(rng, s)``.
      prefix: ``[batch, p]`` (the class token); ``p + h w - 1 <= block_size``.
      grid_shape: ``(H, W)`` of the grid to sample.
      window_shape: ``(h, w)``, the grid the prior was trained on.
      codes: ``[batch, H, W]`` int codes whose first ``start`` positions (raster order) are kept;
        needed when ``start > 0`` (image completion).
      start: raster position of the first sampled token.
      return_logits: also return the logits each pick drew from ``[batch, H W - start, vocab]``.

    Returns:
      codes ``[batch, H, W]`` int32 (the kept ones and the sampled ones).
    """
    prefix = jnp.asarray(prefix, jnp.int32)
    (height, width), (window_height, window_width) = tuple(grid_shape), tuple(window_shape)
    if height < window_height or width < window_width or min(window_height, window_width) < 1:
        raise ValueError(
            f"sample_window: grid_shape {tuple(grid_shape)} must be at least the "
            f"window_shape {tuple(window_shape)} (the trained grid) along both axes"
        )
    if not 0 <= start < height * width:
        raise ValueError(
            f"sample_window: start must be in [0, {height * width}) (raster positions "
            f"of the {height}x{width} grid), got {start}"
        )
    if codes is None:
        if start:
            raise ValueError(f"sample_window: start={start} keeps codes, but codes is None")
        codes = jnp.zeros((prefix.shape[0], height, width), jnp.int32)
    codes = jnp.asarray(codes, jnp.int32)
    if codes.shape != (prefix.shape[0], height, width):
        raise ValueError(
            f"sample_window: codes must be [batch, H, W] = "
            f"{(prefix.shape[0], height, width)}, got shape {codes.shape}"
        )
    settings = SamplingSettings(temperature, top_k, top_p, num_codes, guidance)
    prefix, settings = _prepare(model, prefix, window_height * window_width, settings, null_prefix)
    if guidance is not None:
        codes = jnp.concatenate([codes, codes])
    schedule = window_schedule((height, width), (window_height, window_width), start)
    window = (window_height, window_width)
    sampled, logits = _sample_window(
        model, params, prefix, codes, schedule, rng, window, settings, _axis_rules()
    )
    return (sampled, logits) if return_logits else sampled


def complete(model: GPT, params, prefix, codes, rows: int, rng, *, window_shape=None, **sampling):
    """Image completion: keep the first ``rows`` rows of ``codes [batch, H, W]``, sample the rest.

    taming's "completion" of a real image from its top rows of codes, with any of ``sample``'s
    settings (class prefix, guidance with ``null_prefix``, temperature, top-k/top-p).
    ``window_shape`` (default: the grid itself) is the trained grid when ``codes`` is larger.

    Returns ``[batch, H, W]`` int32 codes whose first ``rows`` rows equal ``codes``'.
    """
    codes = jnp.asarray(codes, jnp.int32)
    if codes.ndim != 3:
        raise ValueError(f"complete: codes must be [batch, H, W], got shape {codes.shape}")
    height, width = codes.shape[1:]
    if not 0 < rows < height:
        raise ValueError(
            f"complete: rows must be in [1, {height - 1}] (the grid has {height} rows), got {rows}"
        )
    return sample_window(
        model,
        params,
        prefix,
        rng,
        (height, width),
        window_shape or (height, width),
        codes=codes,
        start=rows * width,
        **sampling,
    )
