"""The VQGAN's PatchGAN discriminator (pix2pix; taming's ``NLayerDiscriminator``) and the
``ActNorm`` it may use instead of BatchNorm. Images are ``[batch, height, width, channels]``."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnjax.ops import convolution

Array = jax.Array


class ActNorm(nn.Module):
    """Per-channel affine ``scale * (x + loc)`` whose init makes the first batch zero-mean,
    unit-std (taming's ``ActNorm``): call ``init`` with a real batch. ``[b, h, w, c]``."""

    @nn.compact
    def __call__(self, x: Array) -> Array:
        # The initialising statistics, and so the parameters, in float32 whatever x's dtype.
        flat = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        loc = self.param("loc", lambda rng: -flat.mean(axis=0))
        # taming divides by the unbiased std (torch.std) plus 1e-6.
        scale = self.param("scale", lambda rng: 1.0 / (jnp.std(flat, axis=0, ddof=1) + 1e-6))
        return scale.astype(x.dtype) * (x + loc.astype(x.dtype))


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
    # The compute dtype (None: the input's); parameters, BatchNorm statistics and the logits out
    # stay float32.
    dtype: Any = None

    @nn.compact
    def __call__(self, x: Array, train: bool = False) -> Array:
        if self.norm not in ("batch", "actnorm", "none"):
            raise ValueError(
                f"NLayerDiscriminator: norm must be 'batch', 'actnorm' or 'none', got {self.norm!r}"
            )
        normed_bias = self.norm != "batch"
        # (features, stride, conv bias, followed by a norm): a stride-2 conv without a norm, then
        # the widths double (up to 8 ndf) per layer, the last of them at stride 1.
        layers = [(self.ndf, 2, True, False)]
        layers += [
            (self.ndf * min(2**n, 8), 2 if n < self.n_layers else 1, normed_bias, True)
            for n in range(1, self.n_layers + 1)
        ]
        index = 0  # position in taming's Sequential, where every norm and activation counts
        for features, stride, bias, normed in layers:
            x = self._conv(features, stride, bias, index)(x)
            index += 1
            if normed:
                x = self._norm(f"main_{index}", train)(x)
                index += 1
            x = nn.leaky_relu(x, 0.2)
            index += 1
        return self._conv(1, 1, True, index)(x).astype(jnp.float32)

    def _conv(self, features: int, stride: int, bias: bool, index: int) -> nn.Conv:
        return nn.Conv(
            features,
            (4, 4),
            strides=(stride, stride),
            padding=((1, 1), (1, 1)),
            use_bias=bias,
            kernel_init=nn.initializers.normal(0.02),  # taming's weights_init
            dtype=self.dtype,
            name=f"main_{index}",
            conv_general_dilated=convolution.conv_general_dilated,
        )

    def _norm(self, name: str, train: bool):
        if self.norm == "batch":

            def scale_init(rng, shape, dtype=jnp.float32):  # taming's weights_init: N(1, 0.02)
                return 1.0 + 0.02 * jax.random.normal(rng, shape, dtype)

            return nn.BatchNorm(
                use_running_average=not train,
                momentum=0.9,
                epsilon=1e-5,
                scale_init=scale_init,
                dtype=self.dtype,
                name=name,
            )
        if self.norm == "actnorm":
            return ActNorm(name=name)
        return lambda h: h
