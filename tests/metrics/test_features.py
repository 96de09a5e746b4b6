"""The feature extractor: every image once, in order, whatever the batch and padding."""

import jax.numpy as jnp
import numpy as np
import pytest

from attnjax.metrics.features import FeatureExtractor


def _apply(variables, images):
    return {"mean": images.mean(axis=(1, 2)) * variables["scale"], "max": images.max(axis=(1, 2))}


def test_every_image_once_in_order_with_the_last_batch_padded(np_rng):
    images = np_rng.random((7, 5, 4, 3), dtype=np.float32)
    extractor = FeatureExtractor(_apply, {"scale": jnp.float32(2.0)}, batch_size=3)
    batches = [images[0:3], images[3:6], images[6:7]]
    outputs = list(extractor(batches, total=7, progress=False))
    assert [len(o["mean"]) for o in outputs] == [3, 3, 1]
    mean = np.concatenate([o["mean"] for o in outputs])
    np.testing.assert_allclose(mean, 2 * images.mean(axis=(1, 2)), rtol=1e-6)
    np.testing.assert_array_equal(
        np.concatenate([o["max"] for o in outputs]), images.max(axis=(1, 2))
    )


def test_uint8_images_are_read_as_x_over_255_and_large_batches_refused(np_rng):
    pixels = np_rng.integers(0, 256, (2, 3, 3, 3), dtype=np.uint8)
    extractor = FeatureExtractor(_apply, {"scale": jnp.float32(1.0)}, batch_size=2)
    (out,) = extractor([pixels], progress=False)
    np.testing.assert_array_equal(out["max"], pixels.max(axis=(1, 2)).astype(np.float32) / 255)
    with pytest.raises(ValueError, match="0 < n <= 2"):
        list(extractor([np.zeros((3, 3, 3, 3), np.float32)], progress=False))
    with pytest.raises(ValueError, match="positive int"):
        FeatureExtractor(_apply, {}, batch_size=0)
