"""SSIM against scikit-image's ``structural_similarity`` with Gaussian weights."""

import jax
import numpy as np
import pytest
from skimage.metrics import structural_similarity

from attnjax.metrics.ssim import ssim


@pytest.mark.parametrize("shape, data_range", [((3, 24, 20, 3), 1.0), ((2, 11, 16, 1), 255.0)])
def test_ssim_equals_scikit_images(np_rng, shape, data_range):
    references = np_rng.random(shape) * data_range
    images = np.clip(references + 0.2 * data_range * np_rng.standard_normal(shape), 0, None)
    expected = [
        structural_similarity(
            a, b, gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
            data_range=data_range, channel_axis=-1,
        )
        for a, b in zip(images, references)
    ]  # fmt: skip
    ours = jax.jit(ssim, static_argnums=2)(
        images.astype(np.float32), references.astype(np.float32), data_range
    )
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5)
    identical = ssim(references.astype(np.float32), references.astype(np.float32), data_range)
    np.testing.assert_allclose(identical, 1.0, atol=1e-5)


def test_images_smaller_than_the_window_or_mismatched_are_refused():
    with pytest.raises(ValueError, match="11-tap window"):
        ssim(np.zeros((1, 10, 12, 1)), np.zeros((1, 10, 12, 1)), 1.0)
    with pytest.raises(ValueError, match=r"\[b, H, W, C\]"):
        ssim(np.zeros((1, 12, 12, 1)), np.zeros((1, 12, 12, 3)), 1.0)
