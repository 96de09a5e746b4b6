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

import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnjax.models.group_norm import GroupNorm
from attnjax.models.vector_quantizer import VectorQuantizer
from attnjax.ops import convolution
from attnjax.ops.attention import dot_product_attention

Array = jax.Array


def _normalize(name: str, dtype=None) -> GroupNorm:
    """GroupNorm(32, eps=1e-6), taming's ``Normalize``: NHWC channels grouped as PyTorch groups
    NCHW ones, a two-pass variance as PyTorch's, statistics in float32 whatever ``dtype`` the
    output has."""
    return GroupNorm(num_groups=32, epsilon=1e-6, dtype=dtype, name=name)


def _conv(
    features: int, kernel: int, name: str, stride: int = 1, padding: Any = "SAME", dtype=None
) -> nn.Conv:
    pad = ((kernel // 2, kernel // 2),) * 2 if padding == "SAME" else padding
    return nn.Conv(
        features,
        (kernel, kernel),
        strides=(stride, stride),
        padding=pad,
        dtype=dtype,
        name=name,
        conv_general_dilated=convolution.conv_general_dilated,
    )


class ResnetBlock(nn.Module):
    """GroupNorm -> swish -> conv3x3, twice, plus a (1x1 or 3x3 conv) shortcut: ``[b, h, w, c]``."""

    out_channels: int
    dropout: float = 0.0
    conv_shortcut: bool = False
    dtype: Any = None  # the compute dtype (None: the input's); parameters stay float32

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        conv = functools.partial(_conv, dtype=self.dtype)
        h = conv(self.out_channels, 3, "conv1")(nn.swish(_normalize("norm1", self.dtype)(x)))
        h = nn.swish(_normalize("norm2", self.dtype)(h))
        h = nn.Dropout(self.dropout, deterministic=not train)(h)
        h = conv(self.out_channels, 3, "conv2")(h)
        if x.shape[-1] != self.out_channels:
            if self.conv_shortcut:
                x = conv(self.out_channels, 3, "conv_shortcut")(x)
            else:
                x = conv(self.out_channels, 1, "nin_shortcut")(x)
        return x + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all positions, with 1x1 convs as projections:
    ``[b, h, w, c]``.

    The ``h * w`` positions are the sequence and ``c`` the head size: ``[b, h * w, 1, c]`` for
    ``dot_product_attention`` (scale ``1 / sqrt(c)``, as taming's ``c ** -0.5``)."""

    dtype: Any = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        b, height, width, c = x.shape
        h = _normalize("norm", self.dtype)(x)
        q, k, v = (
            _conv(c, 1, name, dtype=self.dtype)(h).reshape(b, height * width, 1, c)
            for name in ("q", "k", "v")
        )
        h = dot_product_attention(q, k, v).reshape(b, height, width, c)
        return x + _conv(c, 1, "proj_out", dtype=self.dtype)(h)


class Downsample(nn.Module):
    """Stride-2 conv3x3 with taming's asymmetric zero padding (0 before, 1 after): halves h, w."""

    dtype: Any = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        pads = ((0, 1), (0, 1))
        return _conv(x.shape[-1], 3, "conv", stride=2, padding=pads, dtype=self.dtype)(x)


class Upsample(nn.Module):
    """Nearest-neighbour x2 followed by conv3x3: doubles h, w."""

    dtype: Any = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        return _conv(x.shape[-1], 3, "conv", dtype=self.dtype)(x)


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
        where, channels, factor = (
            type(self).__name__,
            getattr(self, channels_field),
            self.downsample_factor,
        )
        if x.ndim != 4 or x.shape[-1] != channels:
            raise ValueError(
                f"{where}: {arg} must be [batch, height, width, {channels}] "
                f"({channels_field}={channels}), got shape {x.shape}"
            )
        if downsampled and (x.shape[1] % factor or x.shape[2] % factor):
            raise ValueError(
                f"{where}: {arg} height and width must be divisible by {factor} "
                f"(2 ** (len(ch_mult) - 1)), got shape {x.shape}"
            )
        widths = [self.ch * m for m in self.ch_mult]
        if any(w % 32 for w in widths):
            raise ValueError(
                f"{where}: every width ch * ch_mult[i] must be a multiple of 32 "
                f"(GroupNorm(32)), got ch={self.ch}, ch_mult={tuple(self.ch_mult)} -> {widths}"
            )
        if self.resolution % factor:
            raise ValueError(
                f"{where}: resolution={self.resolution} must be divisible by "
                f"2**(len(ch_mult) - 1) = {factor}"
            )


_DDCONFIG_FIELDS = (
    "ch",
    "ch_mult",
    "num_res_blocks",
    "attn_resolutions",
    "resolution",
    "z_channels",
)


def _blocks(remat: bool) -> tuple[type[nn.Module], type[nn.Module]]:
    """``(ResnetBlock, AttnBlock)``, recomputed in the backward pass when ``remat``: their
    activations are not kept, only their inputs (``train``, argument 2, stays static)."""
    if not remat:
        return ResnetBlock, AttnBlock
    return nn.remat(ResnetBlock, static_argnums=(2,)), nn.remat(AttnBlock)


def _middle(h: Array, dropout: float, train: bool, dtype, blocks) -> Array:
    """ResNet, attention, ResNet at the lowest resolution; named as taming's ``mid`` submodules
    inside the calling ``Encoder``/``Decoder``; ``blocks``: ``_blocks``' pair."""
    resnet, attention = blocks
    h = resnet(h.shape[-1], dropout, dtype=dtype, name="mid_block_1")(h, train)
    h = attention(dtype=dtype, name="mid_attn_1")(h)
    return resnet(h.shape[-1], dropout, dtype=dtype, name="mid_block_2")(h, train)


class Encoder(_DDConfig):
    """Image ``[b, H, W, in_channels]`` -> latents ``[b, H/f, W/f, z_channels (x2 if double_z)]``,
    with ``f = 2 ** (len(ch_mult) - 1)``. Attention follows each ResNet block at the levels whose
    nominal resolution (``resolution`` halved per level) is in ``attn_resolutions``."""

    in_channels: int
    double_z: bool = True
    dropout: float = 0.0
    dtype: Any = None  # the compute dtype (None: the input's); parameters stay float32
    remat: bool = False  # recompute the ResNet and attention blocks in the backward pass

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        self._check(x, "x", "in_channels", downsampled=True)
        dtype = self.dtype
        resnet, attention = _blocks(self.remat)
        h = _conv(self.ch, 3, "conv_in", dtype=dtype)(x)
        res = self.resolution
        for level, mult in enumerate(self.ch_mult):
            for i in range(self.num_res_blocks):
                h = resnet(
                    self.ch * mult, self.dropout, dtype=dtype, name=f"down_{level}_block_{i}"
                )(h, train)
                if res in self.attn_resolutions:
                    h = attention(dtype=dtype, name=f"down_{level}_attn_{i}")(h)
            if level != len(self.ch_mult) - 1:
                h = Downsample(dtype=dtype, name=f"down_{level}_downsample")(h)
                res //= 2
        h = _middle(h, self.dropout, train, dtype, (resnet, attention))
        h = nn.swish(_normalize("norm_out", dtype)(h))
        z_channels = 2 * self.z_channels if self.double_z else self.z_channels
        return _conv(z_channels, 3, "conv_out", dtype=dtype)(h)


class Decoder(_DDConfig):
    """Latents ``[b, h, w, z_channels]`` -> image ``[b, h*f, w*f, out_ch]``, mirroring ``Encoder``
    with ``num_res_blocks + 1`` blocks per level. The features entering ``conv_out`` are sown as
    ``intermediates/pre_conv_out``: the VQGAN loss takes its adaptive weight at that last layer.
    With a ``dtype``, the image and those features come out in float32 (the losses' dtype)."""

    out_ch: int
    dropout: float = 0.0
    dtype: Any = None  # the compute dtype (None: the input's); parameters stay float32
    remat: bool = False  # recompute the ResNet and attention blocks in the backward pass

    @nn.compact
    def __call__(self, z: Array, train: bool = False) -> Array:
        self._check(z, "z", "z_channels", downsampled=False)
        dtype = self.dtype
        resnet, attention = _blocks(self.remat)
        levels = len(self.ch_mult)
        width = self.ch * self.ch_mult[-1]
        res = self.resolution // 2 ** (levels - 1)
        h = _conv(width, 3, "conv_in", dtype=dtype)(z)
        h = _middle(h, self.dropout, train, dtype, (resnet, attention))
        for level in reversed(range(levels)):
            for i in range(self.num_res_blocks + 1):
                h = resnet(
                    self.ch * self.ch_mult[level],
                    self.dropout,
                    dtype=dtype,
                    name=f"up_{level}_block_{i}",
                )(h, train)
                if res in self.attn_resolutions:
                    h = attention(dtype=dtype, name=f"up_{level}_attn_{i}")(h)
            if level != 0:
                h = Upsample(dtype=dtype, name=f"up_{level}_upsample")(h)
                res *= 2
        h = nn.swish(_normalize("norm_out", dtype)(h))
        if dtype is not None:
            h = h.astype(jnp.float32)
        self.sow("intermediates", "pre_conv_out", h)
        # The last layer in float32: its output is the image the losses compare, and its kernel
        # the one the adaptive GAN weight differentiates through.
        return _conv(self.out_ch, 3, "conv_out")(h)


class VQGAN(_DDConfig):
    """Encoder -> 1x1 conv -> VectorQuantizer -> 1x1 conv -> Decoder (taming's ``VQModel``).

    Images ``[b, H, W, in_channels]`` (taming feeds pixels in [-1, 1]); token grid
    ``[b, H/f, W/f]`` with ``f = 2 ** (len(ch_mult) - 1)``. ``quantizer`` holds extra
    ``VectorQuantizer`` fields; taming's VQModel is ``beta=0.25`` and
    ``quantizer={"legacy": True}``.
    """

    in_channels: int
    out_ch: int
    n_embed: int
    embed_dim: int
    double_z: bool = False
    dropout: float = 0.0
    beta: float = 0.25
    quantizer: Any = None
    quantizer_factory: Any = (
        None  # (n_embed, embed_dim, beta, **quantizer) -> module; default VectorQuantizer
    )
    # The compute dtype of the encoder and decoder (None: the input's); parameters stay float32,
    # and the quantizer (distances, codebook updates) and the image out run in float32.
    dtype: Any = None
    remat: bool = False  # recompute the encoder's and decoder's blocks in the backward pass

    def token_grid(self, height: int, width: int) -> tuple[int, int]:
        """The token grid ``(h, w)`` that ``encode`` gives ``height x width`` images, without
        tracing it."""
        factor = self.downsample_factor
        if height % factor or width % factor:
            raise ValueError(
                f"VQGAN: images must have height and width divisible by {factor} "
                f"(2 ** (len(ch_mult) - 1)), got {height} x {width}"
            )
        return height // factor, width // factor

    def setup(self):
        shared = {name: getattr(self, name) for name in _DDCONFIG_FIELDS}
        # Lists (from a config file) become tuples: module fields must be hashable.
        shared.update(
            ch_mult=tuple(self.ch_mult),
            attn_resolutions=tuple(self.attn_resolutions),
            dropout=self.dropout,
            dtype=self.dtype,
            remat=self.remat,
        )
        self.encoder = Encoder(in_channels=self.in_channels, double_z=self.double_z, **shared)
        self.decoder = Decoder(out_ch=self.out_ch, **shared)
        self.quant_conv = nn.Conv(self.embed_dim, (1, 1), dtype=jnp.float32)
        factory = self.quantizer_factory or VectorQuantizer
        self.quantize = factory(
            self.n_embed, self.embed_dim, self.beta, **dict(self.quantizer or {})
        )
        self.post_quant_conv = nn.Conv(self.z_channels, (1, 1), dtype=self.dtype)

    def encode(self, x: Array, train: bool = False) -> tuple[Array, Array, dict[str, Array]]:
        """``x [b, H, W, in_channels]`` -> ``(quantized [b, h, w, embed_dim], indices [b, h, w],
        aux)``."""
        return self.quantize(self.quant_conv(self.encoder(x, train)), train)

    def decode(self, quantized: Array, train: bool = False) -> Array:
        """``[b, h, w, embed_dim]`` -> image ``[b, h*f, w*f, out_ch]``."""
        return self.decoder(self.post_quant_conv(quantized), train)

    def decode_indices(self, indices: Array) -> Array:
        """Token grid ``[b, h, w]`` (int) -> image ``[b, h*f, w*f, out_ch]``."""
        if jnp.asarray(indices).ndim != 3:
            raise ValueError(
                f"VQGAN.decode_indices: indices must be [batch, h, w], got shape {indices.shape}"
            )
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
        raise ValueError(
            f"create_vqgan: unknown ddconfig keys {sorted(extra)}; "
            f"expected a subset of {sorted(known)}"
        )
    return VQGAN(n_embed=n_embed, embed_dim=embed_dim, **dict(ddconfig), **kwargs)
