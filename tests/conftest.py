"""Shared test setup: CPU-only JAX, and torchvision made importable next to the CPU torch."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

from attnjax import torch_interop

# timm and lpips import torchvision, whose PyPI build links CUDA libraries the CPU torch lacks.
torch_interop.ensure_torchvision_importable()


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory):
    """A TFDS data dir holding the embedded digits, prepared once for the whole session."""
    from attnjax import data

    path = str(tmp_path_factory.mktemp("tfds"))
    data.load_source("digits", "train", path)  # prepares both splits
    return path


@pytest.fixture
def np_rng():
    return np.random.default_rng(0)


def assert_close(actual, expected, rtol=1e-5, atol=1e-6, what="value"):
    """Relative-error check with a small absolute floor for entries near zero."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != expected {expected.shape}"
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)
