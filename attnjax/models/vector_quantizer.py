"""The VQGAN's vector quantizer (taming's ``VectorQuantizer``) and the codebook bookkeeping every
quantizer shares: code statistics and the re-seeding of dead codes.

Options against codebook collapse (off by default) keep their state between steps in the
``"vq_state"`` collection.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def _clamped_square_norm(x: Array, eps: float) -> Array:
    return jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), eps)


def l2_norm(x: Array, eps: float = 1e-12) -> Array:
    """``[..., dim]`` -> ``[..., 1]``: the L2 norm over the last axis, at least ``sqrt(eps)``."""
    return jnp.sqrt(_clamped_square_norm(x, eps))


def l2_normalize(x: Array, eps: float = 1e-12) -> Array:
    """``x`` scaled to unit L2 norm over the last axis (zero stays zero). A product with
    ``rsqrt``, not a division by ``l2_norm``: the two round differently, and trained codebooks
    follow the rounding."""
    return x * jax.lax.rsqrt(_clamped_square_norm(x, eps))


def codebook_statistics(
    indices: Array, n_embed: int, weights: Array | None = None
) -> dict[str, Array]:
    """How the codes of ``indices [batch, ...]`` are spread over the ``n_embed`` codes.

    Returns ``perplexity``, ``exp(H(p))`` of the code histogram ``p`` (``n_embed`` when every code
    is used equally, 1 when one code takes all), and ``codebook_usage``, the fraction of codes used
    at least once. ``weights [batch]`` (e.g. 0 for padding examples) weighs each example's codes.
    """
    flat_weights = None
    if weights is not None:
        weights = jnp.asarray(weights, jnp.float32)
        if weights.shape != indices.shape[:1]:
            raise ValueError(
                f"codebook_statistics: weights must be [batch] = {indices.shape[:1]} "
                f"for indices of shape {indices.shape}, got shape {weights.shape}"
            )
        flat_weights = jnp.repeat(weights, indices.size // max(indices.shape[0], 1))
    counts = jnp.bincount(indices.reshape(-1), flat_weights, length=n_embed).astype(jnp.float32)
    probs = counts / jnp.maximum(counts.sum(), 1e-10)
    return {
        "perplexity": jnp.exp(-jnp.sum(probs * jnp.log(probs + 1e-10))),
        "codebook_usage": jnp.mean(counts > 0),
    }


class VectorQuantizer(nn.Module):
    """Nearest-code quantisation with a straight-through gradient.

    ``z [b, h, w, embed_dim]`` -> ``(quantized [b, h, w, embed_dim], indices [b, h, w] int32, aux)``
    with ``aux``: ``loss`` (scalar), ``perplexity``, ``codebook_usage`` (fraction of codes used in
    this batch) and ``latents [b*h*w, lookup_dim]`` (the encodings in the lookup space, what
    ``reseed_dead_codes`` draws from).

    Loss: ``||sg(z) - e||^2 + beta ||z - sg(e)||^2`` (codebook + commitment). ``legacy=True`` puts
    ``beta`` on the codebook term instead, as taming 0.0.1's ``VectorQuantizer`` does.

    Options (off by default, i.e. taming's behaviour):
      l2_normalize: look up and return unit-norm codes (cosine similarity), as in ViT-VQGAN.
      lookup_dim: look up in a ``lookup_dim``-dimensional space reached by a Dense projection and
        left by another (ViT-VQGAN's factorised codes); the codebook is ``[n_embed, lookup_dim]``.
      ema_decay: update the codebook by exponential moving averages of the assigned encodings
        (VQ-VAE's appendix) instead of by gradient; the codebook then lives in ``vq_state`` and the
        loss keeps only ``beta`` x the commitment term.
      usage_decay: track a moving average ``vq_state/usage`` of each code's share of the
        assignments, scaled so that 1 is a uniform share; ``reseed_dead_codes`` reads it.

    ``ema_decay`` and ``usage_decay`` keep state in ``vq_state``: apply with
    ``mutable=["vq_state"]`` and ``train=True`` to update it.
    """

    n_embed: int
    embed_dim: int
    beta: float = 0.25
    legacy: bool = False
    l2_normalize: bool = False
    lookup_dim: int | None = None
    ema_decay: float | None = None
    ema_epsilon: float = 1e-5
    usage_decay: float | None = None

    def setup(self):
        dim = self.lookup_dim or self.embed_dim
        init = nn.initializers.uniform(2.0 / self.n_embed)

        def uniform_codes(rng):
            return init(rng, (self.n_embed, dim)) - 1.0 / self.n_embed

        if self.ema_decay is None:
            self.embedding = self.param("embedding", uniform_codes)
        else:
            codes = self.variable(
                "vq_state", "embedding", lambda: uniform_codes(self.make_rng("params"))
            )
            self.ema_codes = codes
            self.ema_cluster_size = self.variable(
                "vq_state", "cluster_size", jnp.ones, (self.n_embed,)
            )
            self.ema_embed_sum = self.variable("vq_state", "embed_sum", lambda: codes.value)
        if self.usage_decay is not None:
            self.usage = self.variable("vq_state", "usage", jnp.zeros, (self.n_embed,))
        if self.lookup_dim is not None:
            self.in_proj = nn.Dense(self.lookup_dim, name="in_proj")
            self.out_proj = nn.Dense(self.embed_dim, name="out_proj")

    def codebook(self) -> Array:
        """The codes as looked up: ``[n_embed, lookup_dim]`` (unit norm with ``l2_normalize``)."""
        codes = self.embedding if self.ema_decay is None else self.ema_codes.value
        return l2_normalize(codes) if self.l2_normalize else codes

    def lookup(self, indices: Array) -> Array:
        """Indices ``[...]`` -> quantized latents ``[..., embed_dim]``."""
        if jnp.issubdtype(jnp.asarray(indices).dtype, jnp.floating):
            raise ValueError(
                f"VectorQuantizer.lookup: indices must be integers, got {indices.dtype}"
            )
        codes = jnp.take(self.codebook(), indices, axis=0)
        return self.out_proj(codes) if self.lookup_dim is not None else codes

    def __call__(self, z: Array, train: bool = False) -> tuple[Array, Array, dict[str, Array]]:
        if z.shape[-1] != self.embed_dim:
            raise ValueError(
                f"VectorQuantizer: z must end in embed_dim={self.embed_dim} channels, "
                f"got shape {z.shape}"
            )
        if self.lookup_dim is not None:
            z = self.in_proj(z)
        if self.l2_normalize:
            z = l2_normalize(z)
        flat = z.reshape(-1, z.shape[-1])
        codes = self.codebook()
        # Same expansion and order of operations as taming, so that argmin ties resolve alike.
        distances = (
            jnp.sum(flat**2, axis=1, keepdims=True) + jnp.sum(codes**2, axis=1) - 2 * flat @ codes.T
        )
        indices = jnp.argmin(distances, axis=1)
        z_q = jnp.take(codes, indices, axis=0).reshape(z.shape)

        commitment = jnp.mean((jax.lax.stop_gradient(z_q) - z) ** 2)
        codebook_term = jnp.mean((z_q - jax.lax.stop_gradient(z)) ** 2)
        if self.ema_decay is not None:
            loss = self.beta * commitment
        elif self.legacy:
            loss = commitment + self.beta * codebook_term
        else:
            loss = codebook_term + self.beta * commitment

        if train and self.is_mutable_collection("vq_state") and not self.is_initializing():
            self._update_state(flat, indices)

        z_q = z + jax.lax.stop_gradient(z_q - z)
        if self.lookup_dim is not None:
            z_q = self.out_proj(z_q)
        indices = indices.astype(jnp.int32).reshape(z.shape[:-1])
        aux = {"loss": loss, "latents": jax.lax.stop_gradient(flat)}
        aux.update(codebook_statistics(indices, self.n_embed))
        return z_q, indices, aux

    def _update_state(self, flat: Array, indices: Array) -> None:
        one_hot = jax.nn.one_hot(indices, self.n_embed, dtype=flat.dtype)
        counts = one_hot.sum(axis=0)
        if self.usage_decay is not None:
            share = counts * (self.n_embed / flat.shape[0])
            self.usage.value = self.usage_decay * self.usage.value + (1 - self.usage_decay) * share
        if self.ema_decay is not None:
            decay = self.ema_decay
            size = decay * self.ema_cluster_size.value + (1 - decay) * counts
            embed_sum = decay * self.ema_embed_sum.value + (
                1 - decay
            ) * one_hot.T @ jax.lax.stop_gradient(flat)
            # Laplace smoothing keeps codes that received nothing from dividing by zero.
            total = size.sum()
            smoothed = (size + self.ema_epsilon) / (total + self.n_embed * self.ema_epsilon) * total
            self.ema_cluster_size.value = size
            self.ema_embed_sum.value = embed_sum
            self.ema_codes.value = embed_sum / smoothed[:, None]


def reseed_dead_codes(params, vq_state, latents: Array, rng: Array, threshold: float):
    """Replace codes whose usage fell below ``threshold`` by encodings drawn from ``latents``.

    Args:
      params, vq_state: a ``VQGAN``'s ``params`` and ``vq_state`` collections (the quantizer is
        ``quantize``), with ``usage_decay`` set.
      latents: ``[n, lookup_dim]`` encodings of the current batch (``aux["latents"]``).
      rng: a PRNG key choosing which encodings seed the dead codes.
      threshold: a code is dead when its usage (1 = a uniform share) is below this.
    Returns:
      ``(params, vq_state, num_reseeded)``; reseeded codes start again at usage 1.
    """
    state = dict(vq_state["quantize"])
    if "usage" not in state:
        raise ValueError("reseed_dead_codes: the quantizer tracks no usage; set usage_decay")
    dead = state["usage"] < threshold
    picks = latents[jax.random.randint(rng, dead.shape, 0, latents.shape[0])]

    def reseed(codes):
        return jnp.where(dead[:, None], picks.astype(codes.dtype), codes)

    if "embedding" in state:
        # A reseeded EMA code restarts as one assignment of its seed encoding.
        state.update(
            embedding=reseed(state["embedding"]),
            embed_sum=reseed(state["embed_sum"]),
            cluster_size=jnp.where(dead, 1.0, state["cluster_size"]),
        )
    else:
        params = {
            **params,
            "quantize": {
                **params["quantize"],
                "embedding": reseed(params["quantize"]["embedding"]),
            },
        }
    state["usage"] = jnp.where(dead, 1.0, state["usage"])
    return params, {**vq_state, "quantize": state}, dead.sum()
