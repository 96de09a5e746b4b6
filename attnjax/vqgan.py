"""VQGAN (Esser et al., "Taming Transformers"): encoder, vector quantizer, decoder, PatchGAN.

Module boundaries, names and hyper-parameters follow taming-transformers
(``taming.modules.diffusionmodules.model``, ``vqvae.quantize``, ``discriminator.model``) so that
the two can be read side by side and its checkpoints convert with a table
(``attnjax.torch_interop.vqgan_from_taming``). Everything is channels-last:
images are ``[batch, height, width, channels]``.

A taming ``ddconfig`` maps onto the ``Encoder``/``Decoder`` fields one to one: ``ch``, ``out_ch``,
``ch_mult``, ``num_res_blocks``, ``attn_resolutions``, ``dropout``, ``in_channels``,
``resolution``, ``z_channels``, ``double_z``. Feature widths ``ch * ch_mult[i]`` must be
multiples of 32 (GroupNorm(32) everywhere, as in taming).

The quantizer goes beyond taming with options against codebook collapse (all off by default):
l2-normalised codes, a low-dimensional lookup space, EMA codebook updates and re-seeding of
dead codes. The last two need state between steps: it lives in the ``"vq_state"`` collection
(apply with ``mutable=["vq_state"]`` while training); ``reseed_dead_codes`` is a pure function
the train step calls after the optimiser update.
"""
from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def _normalize(name: str) -> nn.GroupNorm:
    """GroupNorm(32, eps=1e-6), taming's ``Normalize``; Flax groups NHWC channels as PyTorch
    groups NCHW ones. The two-pass variance follows PyTorch's numerics more closely than
    E[x^2] - E[x]^2."""
    return nn.GroupNorm(num_groups=32, epsilon=1e-6, use_fast_variance=False, name=name)


def _conv(features: int, kernel: int, name: str, stride: int = 1, padding: Any = "SAME") -> nn.Conv:
    pad = ((kernel // 2, kernel // 2),) * 2 if padding == "SAME" else padding
    return nn.Conv(features, (kernel, kernel), strides=(stride, stride), padding=pad, name=name)


class ResnetBlock(nn.Module):
    """GroupNorm -> swish -> conv3x3, twice, plus a (1x1 or 3x3 conv) shortcut: ``[b, h, w, c]``."""

    out_channels: int
    dropout: float = 0.0
    conv_shortcut: bool = False

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        h = _conv(self.out_channels, 3, "conv1")(nn.swish(_normalize("norm1")(x)))
        h = nn.swish(_normalize("norm2")(h))
        h = nn.Dropout(self.dropout, deterministic=not train)(h)
        h = _conv(self.out_channels, 3, "conv2")(h)
        if x.shape[-1] != self.out_channels:
            if self.conv_shortcut:
                x = _conv(self.out_channels, 3, "conv_shortcut")(x)
            else:
                x = _conv(self.out_channels, 1, "nin_shortcut")(x)
        return x + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all positions, with 1x1 convs as projections: ``[b, h, w, c]``."""

    @nn.compact
    def __call__(self, x: Array) -> Array:
        b, height, width, c = x.shape
        h = _normalize("norm")(x)
        q, k, v = (_conv(c, 1, name)(h).reshape(b, height * width, c) for name in ("q", "k", "v"))
        weights = jax.nn.softmax(jnp.einsum("bqc,bkc->bqk", q, k) * c**-0.5, axis=-1)
        h = jnp.einsum("bqk,bkc->bqc", weights, v).reshape(b, height, width, c)
        return x + _conv(c, 1, "proj_out")(h)


class Downsample(nn.Module):
    """Stride-2 conv3x3 with taming's asymmetric zero padding (0 before, 1 after): halves h, w."""

    @nn.compact
    def __call__(self, x: Array) -> Array:
        return _conv(x.shape[-1], 3, "conv", stride=2, padding=((0, 1), (0, 1)))(x)


class Upsample(nn.Module):
    """Nearest-neighbour x2 followed by conv3x3: doubles h, w."""

    @nn.compact
    def __call__(self, x: Array) -> Array:
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        return _conv(x.shape[-1], 3, "conv")(x)


def _check_ddconfig(module: nn.Module) -> None:
    widths = [module.ch * m for m in module.ch_mult]
    if any(w % 32 for w in widths):
        raise ValueError(
            f"{type(module).__name__}: every width ch * ch_mult[i] must be a multiple of 32 "
            f"(GroupNorm(32)), got ch={module.ch}, ch_mult={tuple(module.ch_mult)} -> {widths}"
        )
    factor = 2 ** (len(module.ch_mult) - 1)
    if module.resolution % factor:
        raise ValueError(
            f"{type(module).__name__}: resolution={module.resolution} must be divisible by "
            f"2**(len(ch_mult) - 1) = {factor}"
        )


class Encoder(nn.Module):
    """Image ``[b, H, W, in_channels]`` -> latents ``[b, H/f, W/f, z_channels (x2 if double_z)]``,
    with ``f = 2 ** (len(ch_mult) - 1)``. Attention follows each ResNet block at the levels whose
    nominal resolution (``resolution`` halved per level) is in ``attn_resolutions``."""

    ch: int
    ch_mult: Sequence[int]
    num_res_blocks: int
    attn_resolutions: Sequence[int]
    in_channels: int
    resolution: int
    z_channels: int
    double_z: bool = True
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        _check_ddconfig(self)
        if x.ndim != 4 or x.shape[-1] != self.in_channels:
            raise ValueError(
                f"Encoder: x must be [batch, height, width, {self.in_channels}] "
                f"(in_channels={self.in_channels}), got shape {x.shape}"
            )
        h = _conv(self.ch, 3, "conv_in")(x)
        res = self.resolution
        for level, mult in enumerate(self.ch_mult):
            for i in range(self.num_res_blocks):
                h = ResnetBlock(self.ch * mult, self.dropout, name=f"down_{level}_block_{i}")(h, train)
                if res in self.attn_resolutions:
                    h = AttnBlock(name=f"down_{level}_attn_{i}")(h)
            if level != len(self.ch_mult) - 1:
                h = Downsample(name=f"down_{level}_downsample")(h)
                res //= 2
        width = h.shape[-1]
        h = ResnetBlock(width, self.dropout, name="mid_block_1")(h, train)
        h = AttnBlock(name="mid_attn_1")(h)
        h = ResnetBlock(width, self.dropout, name="mid_block_2")(h, train)
        h = nn.swish(_normalize("norm_out")(h))
        return _conv(2 * self.z_channels if self.double_z else self.z_channels, 3, "conv_out")(h)


class Decoder(nn.Module):
    """Latents ``[b, h, w, z_channels]`` -> image ``[b, h*f, w*f, out_ch]``, mirroring ``Encoder``
    with ``num_res_blocks + 1`` blocks per level. The features entering ``conv_out`` are sown as
    ``intermediates/pre_conv_out``: the VQGAN loss takes its adaptive weight at that last layer."""

    ch: int
    ch_mult: Sequence[int]
    num_res_blocks: int
    attn_resolutions: Sequence[int]
    out_ch: int
    resolution: int
    z_channels: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, z: Array, train: bool = False) -> Array:
        _check_ddconfig(self)
        if z.ndim != 4 or z.shape[-1] != self.z_channels:
            raise ValueError(
                f"Decoder: z must be [batch, height, width, {self.z_channels}] "
                f"(z_channels={self.z_channels}), got shape {z.shape}"
            )
        levels = len(self.ch_mult)
        width = self.ch * self.ch_mult[-1]
        res = self.resolution // 2 ** (levels - 1)
        h = _conv(width, 3, "conv_in")(z)
        h = ResnetBlock(width, self.dropout, name="mid_block_1")(h, train)
        h = AttnBlock(name="mid_attn_1")(h)
        h = ResnetBlock(width, self.dropout, name="mid_block_2")(h, train)
        for level in reversed(range(levels)):
            for i in range(self.num_res_blocks + 1):
                h = ResnetBlock(self.ch * self.ch_mult[level], self.dropout, name=f"up_{level}_block_{i}")(h, train)
                if res in self.attn_resolutions:
                    h = AttnBlock(name=f"up_{level}_attn_{i}")(h)
            if level != 0:
                h = Upsample(name=f"up_{level}_upsample")(h)
                res *= 2
        h = nn.swish(_normalize("norm_out")(h))
        self.sow("intermediates", "pre_conv_out", h)
        return _conv(self.out_ch, 3, "conv_out")(h)


def _l2_normalize(x: Array, eps: float = 1e-12) -> Array:
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), eps))


def codebook_statistics(indices: Array, n_embed: int) -> dict[str, Array]:
    """Perplexity ``exp(H(p))`` of the code histogram and the fraction of codes used at least once."""
    counts = jnp.bincount(indices.reshape(-1), length=n_embed).astype(jnp.float32)
    probs = counts / jnp.maximum(counts.sum(), 1.0)
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
            codes = self.variable("vq_state", "embedding", lambda: uniform_codes(self.make_rng("params")))
            self.ema_codes = codes
            self.ema_cluster_size = self.variable("vq_state", "cluster_size", jnp.ones, (self.n_embed,))
            self.ema_embed_sum = self.variable("vq_state", "embed_sum", lambda: codes.value)
        if self.usage_decay is not None:
            self.usage = self.variable("vq_state", "usage", jnp.zeros, (self.n_embed,))
        if self.lookup_dim is not None:
            self.in_proj = nn.Dense(self.lookup_dim, name="in_proj")
            self.out_proj = nn.Dense(self.embed_dim, name="out_proj")

    def codebook(self) -> Array:
        """The codes as looked up: ``[n_embed, lookup_dim]`` (unit norm with ``l2_normalize``)."""
        codes = self.embedding if self.ema_decay is None else self.ema_codes.value
        return _l2_normalize(codes) if self.l2_normalize else codes

    def lookup(self, indices: Array) -> Array:
        """Indices ``[...]`` -> quantized latents ``[..., embed_dim]``."""
        if jnp.issubdtype(jnp.asarray(indices).dtype, jnp.floating):
            raise ValueError(f"VectorQuantizer.lookup: indices must be integers, got {indices.dtype}")
        codes = jnp.take(self.codebook(), indices, axis=0)
        return self.out_proj(codes) if self.lookup_dim is not None else codes

    def __call__(self, z: Array, train: bool = False) -> tuple[Array, Array, dict[str, Array]]:
        if z.shape[-1] != self.embed_dim:
            raise ValueError(
                f"VectorQuantizer: z must end in embed_dim={self.embed_dim} channels, got shape {z.shape}"
            )
        if self.lookup_dim is not None:
            z = self.in_proj(z)
        if self.l2_normalize:
            z = _l2_normalize(z)
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
            embed_sum = decay * self.ema_embed_sum.value + (1 - decay) * one_hot.T @ jax.lax.stop_gradient(flat)
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

    params = dict(params)
    if "embedding" in state:
        # A reseeded EMA code restarts as one assignment of its seed encoding.
        state["embedding"] = reseed(state["embedding"])
        state["embed_sum"] = reseed(state["embed_sum"])
        state["cluster_size"] = jnp.where(dead, 1.0, state["cluster_size"])
    else:
        quantize = dict(params["quantize"])
        quantize["embedding"] = reseed(quantize["embedding"])
        params["quantize"] = quantize
    state["usage"] = jnp.where(dead, 1.0, state["usage"])
    vq_state = dict(vq_state)
    vq_state["quantize"] = state
    return params, vq_state, dead.sum()


class VQGAN(nn.Module):
    """Encoder -> 1x1 conv -> VectorQuantizer -> 1x1 conv -> Decoder (taming's ``VQModel``).

    Images ``[b, H, W, in_channels]`` (taming feeds pixels in [-1, 1]); token grid
    ``[b, H/f, W/f]`` with ``f = 2 ** (len(ch_mult) - 1)``. ``quantizer`` holds extra
    ``VectorQuantizer`` options (``legacy``, ``l2_normalize``, ``lookup_dim``, ``ema_decay``,
    ``usage_decay``); taming's VQModel is ``beta=0.25`` and ``legacy=True``.
    """

    ch: int
    ch_mult: Sequence[int]
    num_res_blocks: int
    attn_resolutions: Sequence[int]
    in_channels: int
    out_ch: int
    resolution: int
    z_channels: int
    n_embed: int
    embed_dim: int
    double_z: bool = False
    dropout: float = 0.0
    beta: float = 0.25
    quantizer: Any = None
    quantizer_factory: Any = None  # (n_embed, embed_dim, beta, **quantizer) -> module; default VectorQuantizer

    def setup(self):
        shared = dict(
            ch=self.ch,
            ch_mult=tuple(self.ch_mult),
            num_res_blocks=self.num_res_blocks,
            attn_resolutions=tuple(self.attn_resolutions),
            resolution=self.resolution,
            z_channels=self.z_channels,
            dropout=self.dropout,
        )
        self.encoder = Encoder(in_channels=self.in_channels, double_z=self.double_z, **shared)
        self.decoder = Decoder(out_ch=self.out_ch, **shared)
        self.quant_conv = nn.Conv(self.embed_dim, (1, 1))
        factory = self.quantizer_factory or VectorQuantizer
        self.quantize = factory(self.n_embed, self.embed_dim, self.beta, **dict(self.quantizer or {}))
        self.post_quant_conv = nn.Conv(self.z_channels, (1, 1))

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    def encode(self, x: Array, train: bool = False) -> tuple[Array, Array, dict[str, Array]]:
        """``x [b, H, W, in_channels]`` -> ``(quantized [b, h, w, embed_dim], indices [b, h, w], aux)``."""
        f = self.downsample_factor
        if x.ndim != 4 or x.shape[1] % f or x.shape[2] % f:
            raise ValueError(
                f"VQGAN.encode: x must be [batch, height, width, channels] with height and width "
                f"divisible by {f} (2 ** (len(ch_mult) - 1)), got shape {x.shape}"
            )
        return self.quantize(self.quant_conv(self.encoder(x, train)), train)

    def decode(self, quantized: Array, train: bool = False) -> Array:
        """``[b, h, w, embed_dim]`` -> image ``[b, h*f, w*f, out_ch]``."""
        return self.decoder(self.post_quant_conv(quantized), train)

    def decode_indices(self, indices: Array) -> Array:
        """Token grid ``[b, h, w]`` (int) -> image ``[b, h*f, w*f, out_ch]``."""
        if jnp.asarray(indices).ndim != 3:
            raise ValueError(f"VQGAN.decode_indices: indices must be [batch, h, w], got shape {indices.shape}")
        return self.decode(self.quantize.lookup(indices))

    def __call__(self, x: Array, train: bool = False) -> tuple[Array, dict[str, Array]]:
        """``x [b, H, W, C]`` -> ``(reconstruction [b, H, W, out_ch], aux)``; ``aux`` is the
        quantizer's (``loss``, ``perplexity``, ``codebook_usage``, ``latents``) plus ``indices``."""
        quantized, indices, aux = self.encode(x, train)
        return self.decode(quantized, train), dict(aux, indices=indices)


def create_vqgan(ddconfig, n_embed: int, embed_dim: int, **kwargs) -> VQGAN:
    """A ``VQGAN`` from a taming ``ddconfig`` mapping (unknown taming keys are rejected)."""
    known = {"ch", "ch_mult", "num_res_blocks", "attn_resolutions", "in_channels", "out_ch",
             "resolution", "z_channels", "double_z", "dropout"}
    extra = set(ddconfig) - known
    if extra:
        raise ValueError(f"create_vqgan: unknown ddconfig keys {sorted(extra)}; expected a subset of {sorted(known)}")
    return VQGAN(n_embed=n_embed, embed_dim=embed_dim, **dict(ddconfig), **kwargs)


class ActNorm(nn.Module):
    """Per-channel affine ``scale * (x + loc)`` whose init makes the first batch zero-mean,
    unit-std (taming's ``ActNorm``): call ``init`` with a real batch. ``[b, h, w, c]``."""

    @nn.compact
    def __call__(self, x: Array) -> Array:
        flat = x.reshape(-1, x.shape[-1])
        loc = self.param("loc", lambda rng: -flat.mean(axis=0))
        # taming divides by the unbiased std (torch.std) plus 1e-6.
        scale = self.param("scale", lambda rng: 1.0 / (jnp.std(flat, axis=0, ddof=1) + 1e-6))
        return scale * (x + loc)


class NLayerDiscriminator(nn.Module):
    """PatchGAN discriminator (pix2pix; taming's ``NLayerDiscriminator``): image ``[b, H, W, c]``
    -> logits ``[b, H', W', 1]``, one per overlapping patch.

    Layer names are the indices of taming's ``nn.Sequential`` (``main_0``, ``main_2``, ...).
    ``norm`` is ``"batch"`` (taming's default), ``"actnorm"`` or ``"none"``; with a norm the convs
    before it have no bias. Batch statistics live in ``batch_stats`` (mutable when ``train``).
    """

    ndf: int = 64
    n_layers: int = 3
    norm: str = "batch"

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        if self.norm not in ("batch", "actnorm", "none"):
            raise ValueError(f"NLayerDiscriminator: norm must be 'batch', 'actnorm' or 'none', got {self.norm!r}")
        kernel_init = nn.initializers.normal(0.02)  # taming's weights_init
        index = 0

        def conv(h, features, stride, bias):
            nonlocal index
            layer = nn.Conv(features, (4, 4), strides=(stride, stride), padding=((1, 1), (1, 1)),
                            use_bias=bias, kernel_init=kernel_init, name=f"main_{index}")
            index += 1
            return layer(h)

        def norm(h):
            nonlocal index
            name = f"main_{index}"
            index += 1
            if self.norm == "batch":
                scale_init = lambda rng, shape, dtype=jnp.float32: 1.0 + 0.02 * jax.random.normal(rng, shape, dtype)
                return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                                    scale_init=scale_init, name=name)(h)
            if self.norm == "actnorm":
                return ActNorm(name=name)(h)
            return h

        def act(h):
            nonlocal index
            index += 1
            return nn.leaky_relu(h, 0.2)

        use_bias = self.norm != "batch"
        h = act(conv(x, self.ndf, 2, True))
        mult = 1
        for n in range(1, self.n_layers):
            mult = min(2**n, 8)
            h = act(norm(conv(h, self.ndf * mult, 2, use_bias)))
        mult = min(2**self.n_layers, 8)
        h = act(norm(conv(h, self.ndf * mult, 1, use_bias)))
        return conv(h, 1, 1, True)
