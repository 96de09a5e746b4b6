"""attnjax.lpips against the ``lpips`` package (0.1.4): a random VGG16 trunk (no download) and
the linear-layer weights the package ships, converted by attnjax.torch_interop."""
import jax.numpy as jnp
import lpips as torch_lpips
import numpy as np
import pytest
import torch
import torchvision
from conftest import assert_close

from attnjax import torch_interop


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return torch_lpips.LPIPS(net="vgg", pnet_rand=True, verbose=False).eval()


def _nchw(x):
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


def test_lpips_matches_the_lpips_package(reference):
    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (3, 32, 32, 3)).astype(np.float32)
    b = np.clip(a + rng.normal(0, 0.3, a.shape), -1, 1).astype(np.float32)
    with torch.no_grad():
        expected = reference(_nchw(a), _nchw(b)).numpy().reshape(-1)
    model, variables = torch_interop.lpips_from_torch(reference.state_dict())
    ours = model.apply(variables, jnp.asarray(a), jnp.asarray(b))
    assert_close(ours, expected, what="LPIPS distance")
    assert_close(model.apply(variables, jnp.asarray(a), jnp.asarray(a)), np.zeros(3), what="LPIPS(x, x)")


def test_converter_reads_torchvision_vgg16_and_shipped_linear_weights(reference):
    """The documented path: torchvision's vgg16 state dict + lpips/weights/v0.1/vgg.pth."""
    import os

    vgg = torchvision.models.vgg16()  # random weights: the same structure as the download
    trunk = {f"net.slice{k}.{i}": m for k in range(1, 6) for i, m in getattr(reference.net, f"slice{k}").named_children()}
    with torch.no_grad():
        for i, layer in enumerate(vgg.features):
            if isinstance(layer, torch.nn.Conv2d):
                source = next(m for name, m in trunk.items() if name.endswith(f".{i}"))
                layer.weight.copy_(source.weight)
                layer.bias.copy_(source.bias)
    shipped = os.path.join(os.path.dirname(torch_lpips.__file__), "weights", "v0.1", "vgg.pth")
    model, variables = torch_interop.lpips_from_torch(vgg.state_dict(), shipped)
    rng = np.random.default_rng(1)
    a, b = (rng.uniform(-1, 1, (2, 16, 16, 3)).astype(np.float32) for _ in range(2))
    with torch.no_grad():
        expected = reference(_nchw(a), _nchw(b)).numpy().reshape(-1)
    assert_close(model.apply(variables, jnp.asarray(a), jnp.asarray(b)), expected, what="LPIPS via torchvision keys")


def test_bad_inputs_raise(reference):
    model, variables = torch_interop.lpips_from_torch(reference.state_dict())
    with pytest.raises(ValueError, match="at least 16x16"):
        model.apply(variables, jnp.zeros((1, 8, 8, 3)), jnp.zeros((1, 8, 8, 3)))
    with pytest.raises(ValueError, match="height, width, 3"):
        model.apply(variables, jnp.zeros((1, 16, 16, 1)), jnp.zeros((1, 16, 16, 1)))
    with pytest.raises(KeyError, match="13 VGG16 convs"):
        torch_interop.lpips_from_torch({"features.0.weight": np.zeros((64, 3, 3, 3))})
