"""Shared test setup: CPU-only JAX, and torchvision made importable next to the CPU torch."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole suite and every subprocess it starts (they
# inherit the environment): most of the suite's time is XLA compiling the same tiny programs.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import numpy as np
import pytest

from attnjax.convert.common import make_torchvision_importable

# timm and lpips import torchvision, whose PyPI build links CUDA libraries the CPU torch lacks.
make_torchvision_importable()


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


@pytest.fixture(scope="session")
def lpips_reference():
    """The ``lpips`` package's VGG LPIPS with a random trunk (no download) and its shipped
    linear layers."""
    import lpips as torch_lpips
    import torch

    torch.manual_seed(0)
    return torch_lpips.LPIPS(net="vgg", pnet_rand=True, verbose=False).eval()
