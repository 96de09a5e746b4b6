"""Structural similarity (SSIM, Wang et al. 2004) as scikit-image computes it with
``structural_similarity(gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
data_range=R, channel_axis=-1)``.

Local means, variances and the covariance come from a Gaussian window (``sigma``, cut at
``truncate * sigma``: 11 taps for 1.5), applied per channel along each spatial axis with the
image mirrored at its border (``scipy.ndimage``'s ``"reflect"``: ``c b a | a b c``)::

    S = (2 mu_x mu_y + C1) (2 cov_xy + C2) / ((mu_x^2 + mu_y^2 + C1) (var_x + var_y + C2))

with ``C1 = (0.01 R)^2`` and ``C2 = (0.03 R)^2`` and population (not sample) moments; the
SSIM of an image is the mean of ``S`` over the pixels at least the window's radius from the
border, averaged over channels. A pure JAX function: jit it, vmap it, take its gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def gaussian_window(sigma: float, truncate: float) -> np.ndarray:
    """scipy.ndimage's 1-D Gaussian: radius ``int(truncate * sigma + 0.5)``, weights summing
    to 1."""
    radius = int(truncate * sigma + 0.5)
    x = np.arange(-radius, radius + 1, dtype=np.float64)
    weights = np.exp(-0.5 * x**2 / sigma**2)
    return weights / weights.sum()


def _filter(x: Array, window: np.ndarray, axis: int) -> Array:
    radius = len(window) // 2
    pads = [(0, 0)] * x.ndim
    pads[axis] = (radius, radius)
    padded = jnp.pad(x, pads, mode="symmetric")  # scipy's "reflect": the edge pixel repeated
    size = x.shape[axis]
    taps = [
        jax.lax.slice_in_dim(padded, k, k + size, axis=axis) * weight
        for k, weight in enumerate(window.astype(np.float32))
    ]
    return sum(taps[1:], taps[0])


def ssim(
    images: Array,
    references: Array,
    data_range: float,
    sigma: float = 1.5,
    truncate: float = 3.5,
    k1: float = 0.01,
    k2: float = 0.03,
) -> Array:
    """``images``, ``references`` ``[b, H, W, C]`` (floats, values spanning ``data_range``)
    -> ``[b]`` SSIM per image pair."""
    if images.shape != references.shape or images.ndim != 4:
        raise ValueError(
            f"ssim: images and references must both be [b, H, W, C], got {images.shape} and "
            f"{references.shape}"
        )
    window = gaussian_window(sigma, truncate)
    radius = len(window) // 2
    if min(images.shape[1:3]) < len(window):
        raise ValueError(
            f"ssim: images {images.shape} are smaller than the {len(window)}-tap window"
        )
    x, y = images.astype(jnp.float32), references.astype(jnp.float32)
    blur = lambda z: _filter(_filter(z, window, 1), window, 2)
    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x * mu_x
    var_y = blur(y * y) - mu_y * mu_y
    cov = blur(x * y) - mu_x * mu_y
    c1, c2 = (k1 * data_range) ** 2, (k2 * data_range) ** 2
    numerator = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
    denominator = (mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2)
    local = (numerator / denominator)[:, radius:-radius, radius:-radius]
    return local.mean(axis=(1, 2, 3))
