"""Tokenizers beyond taming's lookup: FSQ, LFQ, SimVQ and the rotation trick.

Every quantizer here has ``vector_quantizer.VectorQuantizer``'s interface, so ``VQGAN``, its loss,
the codes cache, the prior (vocabulary = ``n_embed``) and sampling run on any of them:

    ``__call__(z [b, h, w, embed_dim], train)`` -> ``(quantized [b, h, w, embed_dim],
    indices int32 [b, h, w], aux)``, ``aux``: ``loss``, ``latents [b*h*w, dim]``, ``perplexity``,
    ``codebook_usage``; ``lookup(indices [...]) -> [..., embed_dim]``;
    ``codebook() -> [n_embed, dim]``.

Kinds (``make_quantizer(kind=...)``):
  ``"vq"``: ``vector_quantizer.VectorQuantizer`` (all its options), optionally with the rotation
    trick.
  ``"fsq"``: finite scalar quantisation (Mentzer et al. 2023). ``z`` is projected to
    ``len(levels)`` dimensions, each bounded by a shifted tanh and rounded to ``levels[i]``
    values with a straight-through gradient; the codebook is the product grid
    (``n_embed = prod(levels)``), the index its mixed-radix number, and there is no loss.
  ``"lfq"``: lookup-free quantisation (MAGVIT-v2, Yu et al. 2023). ``z`` is projected to
    ``d = log2(n_embed)`` dimensions; the code is the sign of each (+-1), the index its binary
    number (first dimension most significant). Loss: ``beta`` x commitment plus
    ``entropy_weight`` x (mean per-position entropy - ``diversity`` x entropy of the batch-mean
    code distribution), the distribution being ``softmax(-||z - c||^2 / temperature)`` over
    all codes ``c``. The batch mean is taken over the global batch (``axis_name`` under pmap).
  ``"simvq"``: SimVQ (Zhu et al. 2024). Codes ``C W``: ``C [n_embed, embed_dim]`` frozen at its
    random init (``vq_state/frozen_codebook``), ``W`` one learned linear map; nearest-code
    lookup and the VQ loss ``||sg(z) - q||^2 + beta ||z - sg(q)||^2``, which trains ``W``.

Rotation trick (Fifty et al. 2024; ``rotation_trick=True`` for ``"vq"`` and ``"simvq"``): instead
of the straight-through copy ``z + sg(q - z)``, the output is ``sg(lambda R) z`` with ``R`` the
rotation taking ``z/||z||`` to ``q/||q||`` and ``lambda = ||q|| / ||z||``: the same value ``q``,
but the gradient reaching ``z`` is ``lambda R^T g``, which keeps the angle between the gradient
and the code.
"""

from __future__ import annotations

import math
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attnjax.models import vector_quantizer
from attnjax.models.vector_quantizer import l2_norm

Array = jax.Array

KINDS = ("vq", "fsq", "lfq", "simvq")
# Levels per codebook size: the FSQ paper's recommendations, plus 2^7 for the 128-code digits,
# where (4, 4, 4, 2) uses 97% of the grid on the held-out digits at 800 steps, (2, 8, 8) 95% and
# (8, 4, 4) 88% (the outer levels of a long axis stay rare).
FSQ_LEVELS = {
    128: (4, 4, 4, 2),
    240: (8, 6, 5),
    1000: (8, 5, 5, 5),
    4375: (7, 5, 5, 5, 5),
    15360: (8, 8, 8, 6, 5),
    64000: (8, 8, 8, 5, 5, 5),
}
_VQ_OPTIONS = ("legacy", "l2_normalize", "lookup_dim", "ema_decay", "ema_epsilon", "usage_decay")
_FSQ_OPTIONS = ("fsq_levels",)
_LFQ_OPTIONS = ("lfq_entropy_weight", "lfq_diversity", "lfq_temperature", "lfq_commitment_weight")


def rotate_to_codes(z: Array, codes: Array) -> Array:
    """``z, codes [..., dim]`` -> ``codes`` in value, with gradient ``lambda R^T g`` into ``z``.

    ``R = I - 2 r r^T + 2 q e^T`` (``e = z/||z||``, ``q = codes/||codes||``,
    ``r = (e + q)/||e + q||``) is applied as vector products, never materialised; ``R`` and
    ``lambda`` are constants of the backward pass."""
    z_const, codes_const = jax.lax.stop_gradient(z), jax.lax.stop_gradient(codes)
    z_norm, codes_norm = l2_norm(z_const), l2_norm(codes_const)
    e, q = z_const / z_norm, codes_const / codes_norm
    r = (e + q) / l2_norm(e + q)
    dot = lambda a, b: jnp.sum(a * b, axis=-1, keepdims=True)
    rotated = z - 2.0 * r * dot(r, z) + 2.0 * q * dot(e, z)
    return (codes_norm / z_norm) * rotated


def _statistics(indices: Array, n_embed: int, axis_name: str | None) -> dict[str, Array]:
    if axis_name is not None:
        indices = jax.lax.all_gather(indices, axis_name, tiled=True)
    return vector_quantizer.codebook_statistics(indices, n_embed)


def _check_input(name: str, z: Array, embed_dim: int) -> None:
    if z.ndim != 4 or z.shape[-1] != embed_dim:
        raise ValueError(
            f"{name}: z must be [batch, height, width, {embed_dim}] (embed_dim={embed_dim}), "
            f"got shape {z.shape}"
        )


def _check_indices(name: str, indices) -> None:
    if jnp.issubdtype(jnp.asarray(indices).dtype, jnp.floating):
        raise ValueError(
            f"{name}.lookup: indices must be integers, got {jnp.asarray(indices).dtype}"
        )


class RotationVectorQuantizer(vector_quantizer.VectorQuantizer):
    """``vector_quantizer.VectorQuantizer`` whose straight-through copy is replaced by the rotation
    trick, taken from the quantizer's input ``z`` to its (possibly unit-norm) code. Same parameters,
    state, loss and re-seeding."""

    def __call__(self, z: Array, train: bool = False) -> tuple[Array, Array, dict[str, Array]]:
        quantized, indices, aux = super().__call__(z, train)
        return rotate_to_codes(z, quantized), indices, aux


class FSQ(nn.Module):
    """Finite scalar quantisation: ``z [b, h, w, embed_dim]`` -> grid codes, no codebook loss."""

    levels: Sequence[int]
    embed_dim: int
    axis_name: str | None = None

    @property
    def n_embed(self) -> int:
        return int(np.prod(self.levels))

    def setup(self):
        if len(self.levels) != self.embed_dim:
            self.in_proj = nn.Dense(len(self.levels), name="in_proj")
            self.out_proj = nn.Dense(self.embed_dim, name="out_proj")
        levels = np.asarray(self.levels)
        self._levels = levels
        self._half_width = levels // 2
        self._basis = np.cumprod(np.concatenate([[1], levels[:-1]])).astype(np.int32)

    def _project(self, x: Array, layer: str) -> Array:
        return getattr(self, layer)(x) if len(self.levels) != self.embed_dim else x

    def bound(self, z: Array) -> Array:
        """Each dimension into an interval that rounds to ``levels[i]`` integers (the paper's
        shifted tanh: even levels get the half-step offset; ``tan`` as in its listing)."""
        half_l = (self._levels - 1) * (1 - 1e-3) / 2
        offset = np.where(self._levels % 2 == 1, 0.0, 0.5)
        shift = np.tan(offset / half_l)
        return jnp.tanh(z + shift) * half_l - offset

    def codebook(self) -> Array:
        """The product grid ``[n_embed, len(levels)]`` in index order, values in [-1, 1]."""
        return self._codes_from_indices(jnp.arange(self.n_embed))

    def _codes_from_indices(self, indices: Array) -> Array:
        digits = (indices[..., None] // self._basis) % self._levels
        return ((digits - self._half_width) / self._half_width).astype(jnp.float32)

    def lookup(self, indices: Array) -> Array:
        _check_indices("FSQ", indices)
        return self._project(self._codes_from_indices(jnp.asarray(indices)), "out_proj")

    def __call__(self, z: Array, train: bool = False) -> tuple[Array, Array, dict[str, Array]]:
        _check_input("FSQ", z, self.embed_dim)
        bounded = self.bound(self._project(z, "in_proj"))
        rounded = bounded + jax.lax.stop_gradient(jnp.round(bounded) - bounded)
        codes = rounded / self._half_width
        digits = jnp.round(jax.lax.stop_gradient(rounded)).astype(jnp.int32) + self._half_width
        indices = jnp.sum(digits * self._basis, axis=-1).astype(jnp.int32)
        aux = {
            "loss": jnp.zeros((), z.dtype),
            "latents": jax.lax.stop_gradient(bounded).reshape(-1, len(self.levels)),
        }
        aux.update(_statistics(indices, self.n_embed, self.axis_name))
        return self._project(codes, "out_proj"), indices, aux


class LFQ(nn.Module):
    """Lookup-free quantisation: ``z [b, h, w, embed_dim]`` -> signs of ``log2(n_embed)`` dims."""

    n_embed: int
    embed_dim: int
    beta: float = 0.25
    entropy_weight: float = 0.1
    diversity: float = 1.0
    temperature: float = 0.01
    axis_name: str | None = None

    def setup(self):
        self.dim = int(round(math.log2(self.n_embed)))
        if 2**self.dim != self.n_embed:
            raise ValueError(
                f"LFQ: n_embed={self.n_embed} must be a power of two (2^d codes for d signs)"
            )
        if self.dim != self.embed_dim:
            self.in_proj = nn.Dense(self.dim, name="in_proj")
            self.out_proj = nn.Dense(self.embed_dim, name="out_proj")
        self._bits = 2 ** np.arange(self.dim - 1, -1, -1, dtype=np.int32)

    def _project(self, x: Array, layer: str) -> Array:
        return getattr(self, layer)(x) if self.dim != self.embed_dim else x

    def codebook(self) -> Array:
        """All ``[n_embed, d]`` sign codes (+-1) in index order."""
        return self._codes_from_indices(jnp.arange(self.n_embed))

    def _codes_from_indices(self, indices: Array) -> Array:
        return jnp.where((indices[..., None] // self._bits) % 2 == 1, 1.0, -1.0).astype(jnp.float32)

    def lookup(self, indices: Array) -> Array:
        _check_indices("LFQ", indices)
        return self._project(self._codes_from_indices(jnp.asarray(indices)), "out_proj")

    def entropy_terms(self, flat: Array) -> tuple[Array, Array]:
        """``flat [n, d]`` -> (mean per-position entropy, entropy of the mean distribution)."""
        codes = self.codebook()
        distances = (
            jnp.sum(flat**2, axis=1, keepdims=True) + jnp.sum(codes**2, axis=1) - 2 * flat @ codes.T
        )
        log_probs = jax.nn.log_softmax(-distances / self.temperature, axis=-1)
        probs = jnp.exp(log_probs)
        per_sample = -jnp.mean(jnp.sum(probs * log_probs, axis=-1))
        mean_probs = jnp.mean(probs, axis=0)
        if self.axis_name is not None:
            per_sample, mean_probs = jax.lax.pmean((per_sample, mean_probs), self.axis_name)
        batch = -jnp.sum(mean_probs * jnp.log(mean_probs + 1e-10))
        return per_sample, batch

    def __call__(self, z: Array, train: bool = False) -> tuple[Array, Array, dict[str, Array]]:
        _check_input("LFQ", z, self.embed_dim)
        projected = self._project(z, "in_proj")
        signs = jnp.where(projected > 0, 1.0, -1.0).astype(projected.dtype)
        indices = jnp.sum(jnp.where(projected > 0, self._bits, 0), axis=-1).astype(jnp.int32)
        flat = projected.reshape(-1, self.dim)
        commitment = jnp.mean((projected - jax.lax.stop_gradient(signs)) ** 2)
        per_sample, batch = self.entropy_terms(flat)
        loss = self.beta * commitment + self.entropy_weight * (per_sample - self.diversity * batch)
        quantized = projected + jax.lax.stop_gradient(signs - projected)
        aux = {
            "loss": loss,
            "latents": jax.lax.stop_gradient(flat),
            "per_sample_entropy": per_sample,
            "batch_entropy": batch,
        }
        aux.update(_statistics(indices, self.n_embed, self.axis_name))
        return self._project(quantized, "out_proj"), indices, aux


class SimVQ(nn.Module):
    """SimVQ: nearest code among ``C W`` (``C`` frozen random, ``W`` learned);
    ``[b, h, w, embed_dim]``."""

    n_embed: int
    embed_dim: int
    beta: float = 0.25
    rotation_trick: bool = False
    axis_name: str | None = None

    def setup(self):
        # Kept out of "params" so no optimiser (weight decay included) ever moves it.
        self.frozen_codebook = self.variable(
            "vq_state",
            "frozen_codebook",
            lambda: (
                jax.random.normal(self.make_rng("params"), (self.n_embed, self.embed_dim))
                * self.embed_dim**-0.5
            ),
        )
        self.proj = nn.Dense(self.embed_dim, use_bias=False, name="proj")

    def codebook(self) -> Array:
        """``C W``: ``[n_embed, embed_dim]``."""
        return self.proj(self.frozen_codebook.value)

    def lookup(self, indices: Array) -> Array:
        _check_indices("SimVQ", indices)
        return jnp.take(self.codebook(), jnp.asarray(indices), axis=0)

    def __call__(self, z: Array, train: bool = False) -> tuple[Array, Array, dict[str, Array]]:
        _check_input("SimVQ", z, self.embed_dim)
        flat = z.reshape(-1, self.embed_dim)
        codes = self.codebook()
        distances = (
            jnp.sum(flat**2, axis=1, keepdims=True) + jnp.sum(codes**2, axis=1) - 2 * flat @ codes.T
        )
        indices = jnp.argmin(distances, axis=1)
        z_q = jnp.take(codes, indices, axis=0).reshape(z.shape)
        loss = jnp.mean((z_q - jax.lax.stop_gradient(z)) ** 2) + self.beta * jnp.mean(
            (jax.lax.stop_gradient(z_q) - z) ** 2
        )
        if self.rotation_trick:
            quantized = rotate_to_codes(z, z_q)
        else:
            quantized = z + jax.lax.stop_gradient(z_q - z)
        indices = indices.astype(jnp.int32).reshape(z.shape[:-1])
        aux = {"loss": loss, "latents": jax.lax.stop_gradient(flat)}
        aux.update(_statistics(indices, self.n_embed, self.axis_name))
        return quantized, indices, aux


def make_quantizer(
    n_embed: int,
    embed_dim: int,
    beta: float = 0.25,
    kind: str = "vq",
    rotation_trick: bool = False,
    axis_name: str | None = None,
    **options,
) -> nn.Module:
    """The quantizer of ``kind`` with ``n_embed`` codes for ``embed_dim``-channel latents.

    ``options`` are the config's ``model.quantizer`` fields: each kind takes its own
    (vq: ``legacy``, ``l2_normalize``, ``lookup_dim``, ``ema_decay``, ``ema_epsilon``,
    ``usage_decay``; fsq: ``fsq_levels`` (default ``FSQ_LEVELS[n_embed]``); lfq:
    ``lfq_entropy_weight``, ``lfq_diversity``, ``lfq_temperature``, ``lfq_commitment_weight``
    (default ``beta``)) and ignores the other kinds',
    so a config switches kind with one override. Unknown options are an error.
    """
    known = set(_VQ_OPTIONS + _FSQ_OPTIONS + _LFQ_OPTIONS)
    unknown = set(options) - known
    if unknown:
        raise ValueError(
            f"make_quantizer: unknown quantizer options {sorted(unknown)}; "
            f"expected a subset of {sorted(known)}"
        )
    if kind not in KINDS:
        raise ValueError(
            f"config.model.quantizer.kind={kind!r} is not a quantizer; expected one of {KINDS}"
        )
    if rotation_trick and kind not in ("vq", "simvq"):
        raise ValueError(
            f"config.model.quantizer.rotation_trick applies to the codebook kinds "
            f"('vq', 'simvq'), not kind={kind!r}"
        )
    if kind == "vq":
        vq_options = {k: v for k, v in options.items() if k in _VQ_OPTIONS}
        if rotation_trick and vq_options.get("lookup_dim"):
            raise ValueError(
                f"rotation_trick needs lookup_dim=None (got {vq_options['lookup_dim']}): the "
                "rotation is taken between the quantizer's input and its code in one space"
            )
        cls = RotationVectorQuantizer if rotation_trick else vector_quantizer.VectorQuantizer
        return cls(n_embed, embed_dim, beta, **vq_options)
    if kind == "fsq":
        levels = tuple(options.get("fsq_levels") or FSQ_LEVELS.get(n_embed, ()))
        if not levels:
            raise ValueError(
                f"FSQ: no default levels for n_embed={n_embed}; set config.model.quantizer."
                f"fsq_levels (defaults exist for n_embed in {sorted(FSQ_LEVELS)})"
            )
        if int(np.prod(levels)) != n_embed or min(levels) < 2:
            raise ValueError(
                f"FSQ: fsq_levels={levels} (each >= 2) must multiply to n_embed={n_embed}, "
                f"got {int(np.prod(levels))}"
            )
        return FSQ(levels, embed_dim, axis_name=axis_name)
    if kind == "lfq":
        lfq = {
            k[len("lfq_") :]: v for k, v in options.items() if k in _LFQ_OPTIONS and v is not None
        }
        lfq_beta = lfq.pop("commitment_weight", beta)
        return LFQ(n_embed, embed_dim, lfq_beta, axis_name=axis_name, **lfq)
    return SimVQ(n_embed, embed_dim, beta, rotation_trick=rotation_trick, axis_name=axis_name)
