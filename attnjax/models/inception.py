"""The Inception v3 of FID and IS: pytorch-fid's ``fid_inception_v3``, the network of the
TensorFlow graph (``inception-2015-12-05``) that every published FID is measured with.

torchvision's ``Inception3`` (1008 classes, no auxiliary head) with the TF graph's blocks:

    Conv2d_1a_3x3 .. Conv2d_2b_3x3, max pool      -> "64"    [b, 147, 147, 64]  -> mean
    Conv2d_3b_1x1, Conv2d_4a_3x3, max pool        -> "192"   [b, 71, 71, 192]   -> mean
    Mixed_5b..5d (FIDInceptionA), Mixed_6a (B),
    Mixed_6b..6e (FIDInceptionC)                  -> "768"   [b, 17, 17, 768]   -> mean
    Mixed_7a (D), Mixed_7b (E, average pool),
    Mixed_7c (E, max pool), global average pool   -> "2048"  [b, 2048]
    fc                                            -> "logits" [b, 1008], "logits_unbiased"

The FID blocks average-pool without counting the zero padding (TensorFlow's pooling) and
Mixed_7c max-pools where torchvision averages. Every convolution is ``BasicConv2d``: a conv
without bias, BatchNorm with eps 0.001 (running statistics), ReLU. The intermediate depths
are averaged over space, as pytorch-fid does before its statistics; "logits_unbiased" is the
fc without its bias, what the Inception Score of the original code (and torch-fidelity) uses.

Inputs are ``[b, H, W, 3]`` in [0, 1]; they are resized to 299 x 299 as
``F.interpolate(mode="bilinear", align_corners=False)`` does and scaled to [-1, 1]. Parameter
names are pytorch-fid's module names (``Mixed_6b/branch7x7_2/conv``), so the converter
(``attnjax.convert.inception``) is a key table. The weights file is converted once and read
here without torch (``load_variables``).
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attnjax.models import weights_file

Array = jax.Array

SIZE = 299
NUM_CLASSES = 1008
# pytorch-fid's four feature depths, in the order the network reaches them.
DEPTHS = ("64", "192", "768", "2048")
OUTPUTS = (*DEPTHS, "logits_unbiased", "logits")


def bilinear_matrix(in_size: int, out_size: int) -> np.ndarray:
    """``[out_size, in_size]`` float32 weights of torch's bilinear resampling along one axis
    (``align_corners=False``, no antialiasing): row ``i`` reads the source position
    ``(i + 0.5) * in / out - 0.5`` clamped at 0, from its two nearest pixels."""
    scale = np.float32(in_size) / np.float32(out_size)
    source = scale * (np.arange(out_size, dtype=np.float32) + np.float32(0.5)) - np.float32(0.5)
    source = np.maximum(source, np.float32(0.0))
    low = source.astype(np.int64)  # a floor: source >= 0
    high = np.minimum(low + 1, in_size - 1)
    frac = source - low.astype(np.float32)
    matrix = np.zeros((out_size, in_size), np.float32)
    rows = np.arange(out_size)
    np.add.at(matrix, (rows, low), np.float32(1.0) - frac)
    np.add.at(matrix, (rows, high), frac)
    return matrix


def resize_bilinear(images: Array, size: tuple[int, int]) -> Array:
    """``[b, H, W, C]`` -> ``[b, size[0], size[1], C]`` as ``F.interpolate(mode="bilinear",
    align_corners=False)``; two small matrix products, one per axis."""
    rows = jnp.asarray(bilinear_matrix(images.shape[1], size[0]))
    cols = jnp.asarray(bilinear_matrix(images.shape[2], size[1]))
    images = jnp.einsum("oh,bhwc->bowc", rows, images)
    return jnp.einsum("pw,bowc->bopc", cols, images)


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(value)


class BasicConv2d(nn.Module):
    """torchvision's ``BasicConv2d``: conv (no bias) -> BatchNorm (eps 0.001) -> ReLU."""

    features: int
    kernel_size: int | tuple[int, int]
    stride: int = 1
    padding: int | tuple[int, int] = 0

    @nn.compact
    def __call__(self, x: Array) -> Array:
        pad_h, pad_w = _pair(self.padding)
        x = nn.Conv(
            self.features,
            _pair(self.kernel_size),
            strides=_pair(self.stride),
            padding=((pad_h, pad_h), (pad_w, pad_w)),
            use_bias=False,
            name="conv",
        )(x)
        x = nn.BatchNorm(use_running_average=True, epsilon=1e-3, name="bn")(x)
        return nn.relu(x)


def _average_pool_without_padding(x: Array) -> Array:
    # TensorFlow's average pool divides by the pixels inside the image only, so border pixels
    # are not pulled towards zero (count_include_pad=False in pytorch-fid).
    return nn.avg_pool(x, (3, 3), strides=(1, 1), padding=((1, 1), (1, 1)), count_include_pad=False)


def _max_pool_same(x: Array) -> Array:
    return nn.max_pool(x, (3, 3), strides=(1, 1), padding=((1, 1), (1, 1)))


def _max_pool_reduce(x: Array) -> Array:
    return nn.max_pool(x, (3, 3), strides=(2, 2))


class FIDInceptionA(nn.Module):
    """Mixed_5b..5d: 1x1, 5x5, double 3x3 and pooled branches -> ``224 + pool_features``."""

    pool_features: int

    @nn.compact
    def __call__(self, x: Array) -> Array:
        branch1x1 = BasicConv2d(64, 1, name="branch1x1")(x)
        branch5x5 = BasicConv2d(48, 1, name="branch5x5_1")(x)
        branch5x5 = BasicConv2d(64, 5, padding=2, name="branch5x5_2")(branch5x5)
        branch3x3dbl = BasicConv2d(64, 1, name="branch3x3dbl_1")(x)
        branch3x3dbl = BasicConv2d(96, 3, padding=1, name="branch3x3dbl_2")(branch3x3dbl)
        branch3x3dbl = BasicConv2d(96, 3, padding=1, name="branch3x3dbl_3")(branch3x3dbl)
        pool = _average_pool_without_padding(x)
        pool = BasicConv2d(self.pool_features, 1, name="branch_pool")(pool)
        return jnp.concatenate([branch1x1, branch5x5, branch3x3dbl, pool], axis=-1)


class InceptionB(nn.Module):
    """Mixed_6a: halves the grid (35 -> 17) -> 768 channels."""

    @nn.compact
    def __call__(self, x: Array) -> Array:
        branch3x3 = BasicConv2d(384, 3, stride=2, name="branch3x3")(x)
        branch3x3dbl = BasicConv2d(64, 1, name="branch3x3dbl_1")(x)
        branch3x3dbl = BasicConv2d(96, 3, padding=1, name="branch3x3dbl_2")(branch3x3dbl)
        branch3x3dbl = BasicConv2d(96, 3, stride=2, name="branch3x3dbl_3")(branch3x3dbl)
        return jnp.concatenate([branch3x3, branch3x3dbl, _max_pool_reduce(x)], axis=-1)


class FIDInceptionC(nn.Module):
    """Mixed_6b..6e: factorised 7x7 branches of width ``channels_7x7`` -> 768 channels."""

    channels_7x7: int

    @nn.compact
    def __call__(self, x: Array) -> Array:
        c7 = self.channels_7x7
        branch1x1 = BasicConv2d(192, 1, name="branch1x1")(x)
        branch7x7 = BasicConv2d(c7, 1, name="branch7x7_1")(x)
        branch7x7 = BasicConv2d(c7, (1, 7), padding=(0, 3), name="branch7x7_2")(branch7x7)
        branch7x7 = BasicConv2d(192, (7, 1), padding=(3, 0), name="branch7x7_3")(branch7x7)
        dbl = BasicConv2d(c7, 1, name="branch7x7dbl_1")(x)
        dbl = BasicConv2d(c7, (7, 1), padding=(3, 0), name="branch7x7dbl_2")(dbl)
        dbl = BasicConv2d(c7, (1, 7), padding=(0, 3), name="branch7x7dbl_3")(dbl)
        dbl = BasicConv2d(c7, (7, 1), padding=(3, 0), name="branch7x7dbl_4")(dbl)
        dbl = BasicConv2d(192, (1, 7), padding=(0, 3), name="branch7x7dbl_5")(dbl)
        pool = _average_pool_without_padding(x)
        pool = BasicConv2d(192, 1, name="branch_pool")(pool)
        return jnp.concatenate([branch1x1, branch7x7, dbl, pool], axis=-1)


class InceptionD(nn.Module):
    """Mixed_7a: halves the grid (17 -> 8) -> 1280 channels."""

    @nn.compact
    def __call__(self, x: Array) -> Array:
        branch3x3 = BasicConv2d(192, 1, name="branch3x3_1")(x)
        branch3x3 = BasicConv2d(320, 3, stride=2, name="branch3x3_2")(branch3x3)
        branch7x7x3 = BasicConv2d(192, 1, name="branch7x7x3_1")(x)
        branch7x7x3 = BasicConv2d(192, (1, 7), padding=(0, 3), name="branch7x7x3_2")(branch7x7x3)
        branch7x7x3 = BasicConv2d(192, (7, 1), padding=(3, 0), name="branch7x7x3_3")(branch7x7x3)
        branch7x7x3 = BasicConv2d(192, 3, stride=2, name="branch7x7x3_4")(branch7x7x3)
        return jnp.concatenate([branch3x3, branch7x7x3, _max_pool_reduce(x)], axis=-1)


class FIDInceptionE(nn.Module):
    """Mixed_7b (``pool="avg"``, pytorch-fid's FIDInceptionE_1) and Mixed_7c (``pool="max"``,
    FIDInceptionE_2, the TF graph's max pool) -> 2048 channels."""

    pool: str

    @nn.compact
    def __call__(self, x: Array) -> Array:
        branch1x1 = BasicConv2d(320, 1, name="branch1x1")(x)
        branch3x3 = BasicConv2d(384, 1, name="branch3x3_1")(x)
        branch3x3 = jnp.concatenate(
            [
                BasicConv2d(384, (1, 3), padding=(0, 1), name="branch3x3_2a")(branch3x3),
                BasicConv2d(384, (3, 1), padding=(1, 0), name="branch3x3_2b")(branch3x3),
            ],
            axis=-1,
        )
        dbl = BasicConv2d(448, 1, name="branch3x3dbl_1")(x)
        dbl = BasicConv2d(384, 3, padding=1, name="branch3x3dbl_2")(dbl)
        dbl = jnp.concatenate(
            [
                BasicConv2d(384, (1, 3), padding=(0, 1), name="branch3x3dbl_3a")(dbl),
                BasicConv2d(384, (3, 1), padding=(1, 0), name="branch3x3dbl_3b")(dbl),
            ],
            axis=-1,
        )
        pool = _max_pool_same(x) if self.pool == "max" else _average_pool_without_padding(x)
        pool = BasicConv2d(192, 1, name="branch_pool")(pool)
        return jnp.concatenate([branch1x1, branch3x3, dbl, pool], axis=-1)


class Logits(nn.Module):
    """torchvision's ``fc`` (``Dense`` parameters) -> ``(x @ kernel + bias, x @ kernel)``."""

    @nn.compact
    def __call__(self, x: Array) -> tuple[Array, Array]:
        kernel = self.param(
            "kernel", nn.initializers.lecun_normal(), (x.shape[-1], NUM_CLASSES), jnp.float32
        )
        bias = self.param("bias", nn.initializers.zeros, (NUM_CLASSES,), jnp.float32)
        unbiased = x @ kernel
        return unbiased + bias, unbiased


class InceptionV3(nn.Module):
    """``[b, H, W, 3]`` in [0, 1] -> ``{name: [b, dim]}`` for each name in ``outputs``
    (``"64"``, ``"192"``, ``"768"``, ``"2048"``, ``"logits_unbiased"``, ``"logits"``).

    Only the blocks up to the last requested output run. ``resize_input`` and
    ``normalize_input`` are pytorch-fid's: resize to 299 x 299, scale [0, 1] -> [-1, 1].
    """

    outputs: Sequence[str] = ("2048",)
    resize_input: bool = True
    normalize_input: bool = True

    @nn.compact
    def __call__(self, images: Array) -> dict[str, Array]:
        unknown = sorted(set(self.outputs) - set(OUTPUTS))
        if unknown or not self.outputs:
            raise ValueError(f"InceptionV3: outputs must be among {OUTPUTS}, got {self.outputs}")
        if images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"InceptionV3: images must be [b, H, W, 3], got {images.shape}")
        last = max(OUTPUTS.index(name) for name in self.outputs)
        x = images.astype(jnp.float32)
        if self.resize_input:
            x = resize_bilinear(x, (SIZE, SIZE))
        if self.normalize_input:
            x = 2 * x - 1
        found = {}
        x = BasicConv2d(32, 3, stride=2, name="Conv2d_1a_3x3")(x)
        x = BasicConv2d(32, 3, name="Conv2d_2a_3x3")(x)
        x = BasicConv2d(64, 3, padding=1, name="Conv2d_2b_3x3")(x)
        x = found["64"] = _max_pool_reduce(x)
        if last >= 1:
            x = BasicConv2d(80, 1, name="Conv2d_3b_1x1")(x)
            x = BasicConv2d(192, 3, name="Conv2d_4a_3x3")(x)
            x = found["192"] = _max_pool_reduce(x)
        if last >= 2:
            x = FIDInceptionA(32, name="Mixed_5b")(x)
            x = FIDInceptionA(64, name="Mixed_5c")(x)
            x = FIDInceptionA(64, name="Mixed_5d")(x)
            x = InceptionB(name="Mixed_6a")(x)
            for name, channels in (("6b", 128), ("6c", 160), ("6d", 160), ("6e", 192)):
                x = FIDInceptionC(channels, name=f"Mixed_{name}")(x)
            found["768"] = x
        if last >= 3:
            x = InceptionD(name="Mixed_7a")(x)
            x = FIDInceptionE("avg", name="Mixed_7b")(x)
            x = found["2048"] = FIDInceptionE("max", name="Mixed_7c")(x)
        if last >= 4:
            found["logits"], found["logits_unbiased"] = Logits(name="fc")(x.mean(axis=(1, 2)))
        return {
            name: found[name].mean(axis=(1, 2)) if name in DEPTHS else found[name]
            for name in self.outputs
        }


def save_variables(variables, path) -> str:
    """Writes Inception variables to ``path`` (.npz), keys as ``/``-joined paths."""
    return weights_file.save_variables(variables, path)


def load_variables(path) -> dict:
    """Reads the variables ``save_variables`` wrote; every array and shape is checked, and a bad
    file raises a ValueError in one line naming it."""
    expected = jax.eval_shape(
        InceptionV3(outputs=OUTPUTS).init, jax.random.key(0), jnp.zeros((1, SIZE, SIZE, 3))
    )
    return weights_file.load_variables(
        path, expected, what="Inception weights", command="python -m attnjax.convert.inception"
    )
