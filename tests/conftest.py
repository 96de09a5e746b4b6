"""Shared test setup: CPU-only JAX, and torchvision made importable next to the CPU torch."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

from attnjax.convert.common import make_torchvision_importable  # noqa: E402

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


def assert_close(actual, expected, rtol=1e-5, atol=1e-6, what="value"):
    """Relative-error check with a small absolute floor for entries near zero."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != expected {expected.shape}"
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


@pytest.fixture(scope="session")
def lpips_reference():
    """The ``lpips`` package's VGG LPIPS with a random trunk (no download) and its shipped linear layers."""
    import lpips as torch_lpips
    import torch

    torch.manual_seed(0)
    return torch_lpips.LPIPS(net="vgg", pnet_rand=True, verbose=False).eval()


def lpips_distance(reference, a, b):
    """``reference`` on NHWC numpy images -> ``[batch]`` distances."""
    import torch

    nchw = lambda x: torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
    with torch.no_grad():
        return reference(nchw(a), nchw(b)).numpy().reshape(-1)


def write_pickle_that_runs_code(path):
    """A ``.pth`` whose unpickling would call ``print`` (as a real attack would call ``os.system``)."""
    import torch

    class RunsCode:
        def __reduce__(self):
            return (print, ("arbitrary code ran",))

    with open(path, "wb") as f:
        torch.save({"state_dict": RunsCode()}, f)
    return path
