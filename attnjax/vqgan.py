"""VQGAN (Esser et al., "Taming Transformers"): encoder, vector quantizer, decoder, PatchGAN.

Module boundaries, names and hyper-parameters follow taming-transformers
(``taming.modules.diffusionmodules.model``, ``vqvae.quantize``, ``discriminator.model``) so that
the two can be read side by side and its checkpoints convert with a table
(``attnjax.convert.taming.vqgan_from_taming``). Everything is channels-last:
images are ``[batch, height, width, channels]``.

A taming ``ddconfig`` maps onto the ``Encoder``/``Decoder`` fields one to one: ``ch``, ``out_ch``,
``ch_mult``, ``num_res_blocks``, ``attn_resolutions``, ``dropout``, ``in_channels``,
``resolution``, ``z_channels``, ``double_z``. Feature widths ``ch * ch_mult[i]`` must be
multiples of 32 (GroupNorm(32) everywhere, as in taming).

The quantizer goes beyond taming with options against codebook collapse (off by default; see
``VectorQuantizer``). Their state between steps lives in the ``"vq_state"`` collection.
"""
from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnjax import convolution
from attnjax.attention import dot_product_attention

Array = jax.Array


def _normalize(name: str) -> nn.GroupNorm:
    """GroupNorm(32, eps=1e-6), taming's ``Normalize``; Flax groups NHWC channels as PyTorch
    groups NCHW ones. The two-pass variance follows PyTorch's numerics more closely than
    E[x^2] - E[x]^2."""
    return nn.GroupNorm(num_groups=32, epsilon=1e-6, use_fast_variance=False, name=name)


def _conv(features: int, kernel: int, name: str, stride: int = 1, padding: Any = "SAME") -> nn.Conv:
    pad = ((kernel // 2, kernel // 2),) * 2 if padding == "SAME" else padding
    return nn.Conv(features, (kernel, kernel), strides=(stride, stride), padding=pad, name=name,
                   conv_general_dilated=convolution.conv_general_dilated)


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
    """Single-head self-attention over all positions, with 1x1 convs as projections: ``[b, h, w, c]``.

    The ``h * w`` positions are the sequence and ``c`` the head size: ``[b, h * w, 1, c]`` for
    ``dot_product_attention`` (scale ``1 / sqrt(c)``, as taming's ``c ** -0.5``)."""

    @nn.compact
    def __call__(self, x: Array) -> Array:
        b, height, width, c = x.shape
        h = _normalize("norm")(x)
        q, k, v = (_conv(c, 1, name)(h).reshape(b, height * width, 1, c) for name in ("q", "k", "v"))
        h = dot_product_attention(q, k, v).reshape(b, height, width, c)
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


class _DDConfig(nn.Module):
    """The taming ``ddconfig`` fields that ``Encoder``, ``Decoder`` and ``VQGAN`` share."""

    ch: int
    ch_mult: Sequence[int]
    num_res_blocks: int
    attn_resolutions: Sequence[int]
    resolution: int
    z_channels: int

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    def _check(self, x: Array, arg: str, channels_field: str, downsampled: bool) -> None:
        """The widths and resolution, and the input ``x`` (named ``arg``): ``[b, h, w, channels]``
        with ``channels = getattr(self, channels_field)``; ``h, w`` multiples of the downsampling
        factor when the module ``downsampled`` them."""
        where, channels, factor = type(self).__name__, getattr(self, channels_field), self.downsample_factor
        if x.ndim != 4 or x.shape[-1] != channels:
            raise ValueError(f"{where}: {arg} must be [batch, height, width, {channels}] "
                             f"({channels_field}={channels}), got shape {x.shape}")
        if downsampled and (x.shape[1] % factor or x.shape[2] % factor):
            raise ValueError(f"{where}: {arg} height and width must be divisible by {factor} "
                             f"(2 ** (len(ch_mult) - 1)), got shape {x.shape}")
        widths = [self.ch * m for m in self.ch_mult]
        if any(w % 32 for w in widths):
            raise ValueError(
                f"{where}: every width ch * ch_mult[i] must be a multiple of 32 "
                f"(GroupNorm(32)), got ch={self.ch}, ch_mult={tuple(self.ch_mult)} -> {widths}")
        if self.resolution % factor:
            raise ValueError(f"{where}: resolution={self.resolution} must be divisible by "
                             f"2**(len(ch_mult) - 1) = {factor}")


_DDCONFIG_FIELDS = ("ch", "ch_mult", "num_res_blocks", "attn_resolutions", "resolution", "z_channels")


def _middle(h: Array, dropout: float, train: bool) -> Array:
    """ResNet, attention, ResNet at the lowest resolution; named as taming's ``mid`` submodules
    inside the calling ``Encoder``/``Decoder``."""
    h = ResnetBlock(h.shape[-1], dropout, name="mid_block_1")(h, train)
    h = AttnBlock(name="mid_attn_1")(h)
    return ResnetBlock(h.shape[-1], dropout, name="mid_block_2")(h, train)


class Encoder(_DDConfig):
    """Image ``[b, H, W, in_channels]`` -> latents ``[b, H/f, W/f, z_channels (x2 if double_z)]``,
    with ``f = 2 ** (len(ch_mult) - 1)``. Attention follows each ResNet block at the levels whose
    nominal resolution (``resolution`` halved per level) is in ``attn_resolutions``."""

    in_channels: int
    double_z: bool = True
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        self._check(x, "x", "in_channels", downsampled=True)
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
        h = _middle(h, self.dropout, train)
        h = nn.swish(_normalize("norm_out")(h))
        return _conv(2 * self.z_channels if self.double_z else self.z_channels, 3, "conv_out")(h)


class Decoder(_DDConfig):
    """Latents ``[b, h, w, z_channels]`` -> image ``[b, h*f, w*f, out_ch]``, mirroring ``Encoder``
    with ``num_res_blocks + 1`` blocks per level. The features entering ``conv_out`` are sown as
    ``intermediates/pre_conv_out``: the VQGAN loss takes its adaptive weight at that last layer."""

    out_ch: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, z: Array, train: bool = False) -> Array:
        self._check(z, "z", "z_channels", downsampled=False)
        levels = len(self.ch_mult)
        width = self.ch * self.ch_mult[-1]
        res = self.resolution // 2 ** (levels - 1)
        h = _middle(_conv(width, 3, "conv_in")(z), self.dropout, train)
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


def codebook_statistics(indices: Array, n_embed: int, weights: Array | None = None) -> dict[str, Array]:
    """How the codes of ``indices [batch, ...]`` are spread over the ``n_embed`` codes.

    Returns ``perplexity``, ``exp(H(p))`` of the code histogram ``p`` (``n_embed`` when every code
    is used equally, 1 when one code takes all), and ``codebook_usage``, the fraction of codes used
    at least once. ``weights [batch]`` (e.g. 0 for padding examples) weighs each example's codes.
    """
    flat_weights = None
    if weights is not None:
        weights = jnp.asarray(weights, jnp.float32)
        if weights.shape != indices.shape[:1]:
            raise ValueError(f"codebook_statistics: weights must be [batch] = {indices.shape[:1]} "
                             f"for indices of shape {indices.shape}, got shape {weights.shape}")
        flat_weights = jnp.repeat(weights, indices.size // max(indices.shape[0], 1))
    counts = jnp.bincount(indices.reshape(-1), flat_weights, length=n_embed).astype(jnp.float32)
    probs = counts / jnp.maximum(counts.sum(), 1e-10)
    return {"perplexity": jnp.exp(-jnp.sum(probs * jnp.log(probs + 1e-10))), "codebook_usage": jnp.mean(counts > 0)}


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

    if "embedding" in state:
        # A reseeded EMA code restarts as one assignment of its seed encoding.
        state.update(embedding=reseed(state["embedding"]), embed_sum=reseed(state["embed_sum"]),
                     cluster_size=jnp.where(dead, 1.0, state["cluster_size"]))
    else:
        params = {**params, "quantize": {**params["quantize"],
                                         "embedding": reseed(params["quantize"]["embedding"])}}
    state["usage"] = jnp.where(dead, 1.0, state["usage"])
    return params, {**vq_state, "quantize": state}, dead.sum()


class VQGAN(_DDConfig):
    """Encoder -> 1x1 conv -> VectorQuantizer -> 1x1 conv -> Decoder (taming's ``VQModel``).

    Images ``[b, H, W, in_channels]`` (taming feeds pixels in [-1, 1]); token grid
    ``[b, H/f, W/f]`` with ``f = 2 ** (len(ch_mult) - 1)``. ``quantizer`` holds extra
    ``VectorQuantizer`` fields; taming's VQModel is ``beta=0.25`` and ``quantizer={"legacy": True}``.
    """

    in_channels: int
    out_ch: int
    n_embed: int
    embed_dim: int
    double_z: bool = False
    dropout: float = 0.0
    beta: float = 0.25
    quantizer: Any = None
    quantizer_factory: Any = None  # (n_embed, embed_dim, beta, **quantizer) -> module; default VectorQuantizer

    def setup(self):
        shared = {name: getattr(self, name) for name in _DDCONFIG_FIELDS}
        # Lists (from a config file) become tuples: module fields must be hashable.
        shared.update(ch_mult=tuple(self.ch_mult), attn_resolutions=tuple(self.attn_resolutions),
                      dropout=self.dropout)
        self.encoder = Encoder(in_channels=self.in_channels, double_z=self.double_z, **shared)
        self.decoder = Decoder(out_ch=self.out_ch, **shared)
        self.quant_conv = nn.Conv(self.embed_dim, (1, 1))
        factory = self.quantizer_factory or VectorQuantizer
        self.quantize = factory(self.n_embed, self.embed_dim, self.beta, **dict(self.quantizer or {}))
        self.post_quant_conv = nn.Conv(self.z_channels, (1, 1))

    def encode(self, x: Array, train: bool = False) -> tuple[Array, Array, dict[str, Array]]:
        """``x [b, H, W, in_channels]`` -> ``(quantized [b, h, w, embed_dim], indices [b, h, w], aux)``."""
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
    known = set(_DDCONFIG_FIELDS) | {"in_channels", "out_ch", "double_z", "dropout"}
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
    ``norm`` is ``"batch"`` (taming's default), ``"actnorm"`` (taming's ``use_actnorm=True``) or
    ``"none"``. As in taming, only BatchNorm drops the bias of the convs it follows (its shift
    makes one redundant); with ActNorm or no norm every conv has a bias. Batch statistics live in
    ``batch_stats`` (mutable when ``train``).
    """

    ndf: int = 64
    n_layers: int = 3
    norm: str = "batch"

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        if self.norm not in ("batch", "actnorm", "none"):
            raise ValueError(f"NLayerDiscriminator: norm must be 'batch', 'actnorm' or 'none', got {self.norm!r}")
        normed_bias = self.norm != "batch"
        # (features, stride, conv bias, followed by a norm): a stride-2 conv without a norm, then
        # the widths double (up to 8 ndf) per layer, the last of them at stride 1.
        layers = [(self.ndf, 2, True, False)]
        layers += [(self.ndf * min(2**n, 8), 2 if n < self.n_layers else 1, normed_bias, True)
                   for n in range(1, self.n_layers + 1)]
        index = 0  # position in taming's Sequential, where every norm and activation counts
        for features, stride, bias, normed in layers:
            x = self._conv(features, stride, bias, index)(x)
            index += 1
            if normed:
                x = self._norm(f"main_{index}", train)(x)
                index += 1
            x = nn.leaky_relu(x, 0.2)
            index += 1
        return self._conv(1, 1, True, index)(x)

    def _conv(self, features: int, stride: int, bias: bool, index: int) -> nn.Conv:
        return nn.Conv(features, (4, 4), strides=(stride, stride), padding=((1, 1), (1, 1)),
                       use_bias=bias, kernel_init=nn.initializers.normal(0.02),  # taming's weights_init
                       name=f"main_{index}", conv_general_dilated=convolution.conv_general_dilated)

    def _norm(self, name: str, train: bool):
        if self.norm == "batch":
            def scale_init(rng, shape, dtype=jnp.float32):  # taming's weights_init: N(1, 0.02)
                return 1.0 + 0.02 * jax.random.normal(rng, shape, dtype)

            return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                                scale_init=scale_init, name=name)
        if self.norm == "actnorm":
            return ActNorm(name=name)
        return lambda h: h
