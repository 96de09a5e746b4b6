"""LPIPS (Zhang et al., "The Unreasonable Effectiveness of Deep Features as a Perceptual Metric").

The VGG16 variant that taming-transformers' perceptual loss uses (``lpips`` v0.1): images in
[-1, 1] are shifted and scaled per channel, passed through VGG16's convolutional trunk, and at
the five taps (relu1_2, relu2_2, relu3_3, relu4_3, relu5_3) the channel-normalised features of
the two images are subtracted, squared, weighted per channel by a learned 1x1 conv (``lin0`` ..
``lin4``), averaged over space and summed over taps.

Weights: VGG16 from torchvision (the user downloads ``vgg16-397923af.pth``) and the linear
layers shipped inside the ``lpips`` package (``lpips/weights/v0.1/vgg.pth``), converted once
(``python -m attnjax.convert.lpips VGG.pth LIN.pth OUT.npz``) into a numpy file that
``load_variables`` reads without torch.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from attnjax.models import weights_file
from attnjax.ops import convolution

Array = jax.Array

# torchvision ``vgg16().features``: (index in the Sequential, output channels) of each conv;
# max-pools precede indices 5, 10, 17 and 24, and the features after the convs at ``TAPS``
# (plus their ReLU) are compared.
VGG16_CONVS = (
    (0, 64),
    (2, 64),
    (5, 128),
    (7, 128),
    (10, 256),
    (12, 256),
    (14, 256),
    (17, 512),
    (19, 512),
    (21, 512),
    (24, 512),
    (26, 512),
    (28, 512),
)
POOL_BEFORE = (5, 10, 17, 24)
TAPS = (2, 7, 14, 21, 28)
CHANNELS = (64, 128, 256, 512, 512)

# lpips' ScalingLayer: ImageNet statistics mapped to the [-1, 1] input range.
SHIFT = (-0.030, -0.088, -0.188)
SCALE = (0.458, 0.448, 0.450)


class VGG16Features(nn.Module):
    """VGG16's conv trunk up to relu5_3: ``[b, H, W, 3]`` -> the five tapped ReLU outputs."""

    @nn.compact
    def __call__(self, x: Array) -> list[Array]:
        taps = []
        for index, channels in VGG16_CONVS:
            if index in POOL_BEFORE:
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
            x = nn.relu(
                nn.Conv(
                    channels,
                    (3, 3),
                    padding=((1, 1), (1, 1)),
                    name=f"features_{index}",
                    conv_general_dilated=convolution.conv_general_dilated,
                )(x)
            )
            if index in TAPS:
                taps.append(x)
        return taps


def _normalize_channels(x: Array, eps: float = 1e-10) -> Array:
    return x / (jnp.sqrt(jnp.sum(x**2, axis=-1, keepdims=True)) + eps)


class LPIPS(nn.Module):
    """Perceptual distance between two image batches ``[b, H, W, 3]`` in [-1, 1] -> ``[b]``.

    ``H`` and ``W`` must be at least 16 (VGG16 pools four times). The parameters are never
    trained here: treat them as constants (the VQGAN loss closes over them).
    """

    @nn.compact
    def __call__(self, input: Array, target: Array) -> Array:
        if input.shape != target.shape or input.ndim != 4 or input.shape[-1] != 3:
            raise ValueError(
                "LPIPS: input and target must both be [batch, height, width, 3], "
                f"got {input.shape} and {target.shape}"
            )
        if min(input.shape[1:3]) < 16:
            raise ValueError(
                f"LPIPS: images must be at least 16x16 (VGG16 pools 4 times), got {input.shape}"
            )
        shift, scale = jnp.asarray(SHIFT), jnp.asarray(SCALE)
        trunk = VGG16Features(name="net")
        both = trunk(jnp.concatenate([(input - shift) / scale, (target - shift) / scale]))
        distance = 0.0
        for k, features in enumerate(both):
            a, b = jnp.split(features, 2)
            diff = (_normalize_channels(a) - _normalize_channels(b)) ** 2
            weighted = nn.Conv(1, (1, 1), use_bias=False, name=f"lin{k}")(diff)
            distance = distance + jnp.mean(weighted, axis=(1, 2, 3))
        return distance


def save_variables(variables, path) -> str:
    """Write LPIPS variables to ``path`` (.npz), keys as ``/``-joined paths (``params/net/...``)."""
    return weights_file.save_variables(variables, path)


def load_variables(path) -> dict:
    """Read LPIPS variables written by ``save_variables``; checks every expected array and shape."""
    expected = jax.eval_shape(
        LPIPS().init, jax.random.key(0), jnp.zeros((1, 16, 16, 3)), jnp.zeros((1, 16, 16, 3))
    )
    return weights_file.load_variables(
        path, expected, what="LPIPS weights", command="python -m attnjax.convert.lpips"
    )
