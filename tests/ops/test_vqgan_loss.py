"""attnjax.ops.vqgan_loss against taming's ``VQLPIPSWithDiscriminator`` in PyTorch.

The reference is taming's own class. Its constructor would download VGG16 (torchvision) and
the LPIPS linear weights (heibox); the ``taming_loss`` fixture patches exactly those two
downloads: the VGG16 trunk is built with random weights (``pretrained=False``) and the linear
layers are loaded from the copy the ``lpips`` package ships (the same file taming fetches).
"""

import functools
import os
import types

import jax
import jax.numpy as jnp
import lpips as lpips_package
import numpy as np
import pytest
import taming.modules.losses.lpips as taming_lpips
import torch
import torchvision
from helpers import assert_close
from taming.modules.losses.vqperceptual import VQLPIPSWithDiscriminator

from attnjax.convert.lpips import lpips_from_torch
from attnjax.convert.taming import nlayer_discriminator_from_taming
from attnjax.ops import vqgan_loss

DISC_START = 5


@pytest.fixture(scope="module")
def patched_lpips():
    """taming's LPIPS with a random VGG16 trunk and the shipped linear weights (no network)."""
    shipped = os.path.join(os.path.dirname(lpips_package.__file__), "weights", "v0.1", "vgg.pth")
    original_models, original_load = taming_lpips.models, taming_lpips.LPIPS.load_from_pretrained

    def load_shipped(self, name="vgg_lpips"):
        self.load_state_dict(
            torch.load(shipped, map_location="cpu", weights_only=True), strict=False
        )

    # taming's vgg16 wrapper calls torchvision.models.vgg16(pretrained=True) through this name.
    taming_lpips.models = types.SimpleNamespace(
        vgg16=lambda pretrained: torchvision.models.vgg16(weights=None)
    )
    taming_lpips.LPIPS.load_from_pretrained = load_shipped
    yield
    taming_lpips.models, taming_lpips.LPIPS.load_from_pretrained = original_models, original_load


@functools.lru_cache(maxsize=None)
def _build(kind):
    torch.manual_seed(0)
    loss = VQLPIPSWithDiscriminator(
        disc_start=DISC_START,
        codebook_weight=0.7,
        disc_num_layers=2,
        disc_in_channels=3,
        disc_ndf=16,
        disc_weight=0.8,
        perceptual_weight=1.3,
        disc_loss=kind,
    )
    rng = np.random.default_rng(0)
    inputs = rng.uniform(-1, 1, (2, 16, 16, 3)).astype(np.float32)
    features = rng.normal(size=(2, 16, 16, 32)).astype(np.float32)
    last = torch.nn.Conv2d(32, 3, 3, padding=1)
    return kind, loss, last, inputs, features, _ours(*_converted(loss))


@functools.lru_cache(maxsize=None)
def _converted(loss):
    """taming's discriminator and LPIPS as ours -> ``(modules, variables)``, once per loss."""
    disc, disc_vars = nlayer_discriminator_from_taming(loss.discriminator.state_dict())
    perceptual, lpips_vars = lpips_from_torch(loss.perceptual_loss.state_dict())
    return (disc, perceptual), (disc_vars, lpips_vars)


def _ours(modules, variables):
    """vqgan_loss's keyword arguments: the settings above and the converted networks applied with
    ``variables`` (constants, or arguments of a jitted function)."""
    (disc, perceptual), (disc_vars, lpips_vars) = modules, variables
    return dict(
        discriminator=lambda x: disc.apply(disc_vars, x, train=True, mutable=["batch_stats"])[0],
        perceptual=lambda a, b: perceptual.apply(lpips_vars, a, b),
        perceptual_weight=1.3,
        codebook_weight=0.7,
        disc_start=DISC_START,
        disc_weight=0.8,
    )


def _nchw(x):
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x).transpose(0, 3, 1, 2)))


@functools.lru_cache(maxsize=None)
def _generator_value_and_grad():
    """One compilation for both steps: the step is an argument, not a constant. So are the
    networks' variables: as constants, VGG16's made a 111 MB program to compile and cache."""
    _, loss, last, inputs, features, _ = _build("hinge")
    bias = jnp.asarray(last.bias.detach().numpy())
    modules, variables = _converted(loss)

    def objective(kernel, step, variables):
        rec = (
            jax.lax.conv_general_dilated(
                jnp.asarray(features),
                kernel,
                (1, 1),
                ((1, 1), (1, 1)),
                dimension_numbers=("NHWC", "HWIO", "NHWC"),
            )
            + bias
        )
        return vqgan_loss.generator_loss(
            jnp.asarray(inputs),
            rec,
            jnp.float32(0.37),
            step=step,
            last_layer=(jnp.asarray(features), kernel),
            **_ours(modules, variables),
        )

    value_and_grad = jax.jit(jax.value_and_grad(objective, has_aux=True))
    return lambda kernel, step: value_and_grad(kernel, step, variables)


@pytest.mark.parametrize("step", [DISC_START - 1, DISC_START])
def test_generator_loss_matches_taming(patched_lpips, step):
    """The generator loss does not depend on the d-loss kind: hinge only."""
    kind, loss, last, inputs, features, ours = _build("hinge")
    last.zero_grad()
    reconstructions = last(_nchw(features))
    codebook_loss = torch.tensor(0.37)
    total, log = loss(
        codebook_loss, _nchw(inputs), reconstructions, 0, step, last_layer=last.weight
    )
    total.backward()

    kernel = jnp.asarray(last.weight.detach().numpy().transpose(2, 3, 1, 0))
    (value, ours_log), grad = _generator_value_and_grad()(kernel, jnp.int32(step))
    assert_close(ours_log["d_weight"], log["train/d_weight"].item(), what="adaptive weight")
    assert float(ours_log["disc_factor"]) == float(log["train/disc_factor"])
    assert_close(ours_log["nll_loss"], log["train/nll_loss"].item(), what="nll loss")
    assert_close(ours_log["g_loss"], log["train/g_loss"].item(), what="generator adversarial loss")
    assert_close(value, total.item(), what=f"total generator loss at step {step}")
    expected_grad = last.weight.grad.numpy().transpose(2, 3, 1, 0)
    assert_close(
        grad, expected_grad, atol=1e-5 * np.abs(expected_grad).max(), what="grad wrt last layer"
    )


@pytest.mark.parametrize("kind", ["hinge", "vanilla"])
@pytest.mark.parametrize("step", [DISC_START - 1, DISC_START])
def test_discriminator_loss_matches_taming(patched_lpips, kind, step):
    kind, loss, last, inputs, features, ours = _build(kind)
    with torch.no_grad():
        reconstructions = last(_nchw(features))
        d_loss, log = loss(torch.tensor(0.0), _nchw(inputs), reconstructions, 1, step)
    rec = np.asarray(reconstructions.numpy().transpose(0, 2, 3, 1))
    # taming scores the real and the fake batch in separate calls (separate batch statistics).
    value, ours_log = vqgan_loss.discriminator_loss(
        ours["discriminator"](jnp.asarray(inputs)),
        ours["discriminator"](jnp.asarray(rec)),
        step=step,
        disc_start=DISC_START,
        kind=kind,
    )
    assert_close(ours_log["logits_real"], log["train/logits_real"].item(), what="mean real logit")
    assert_close(ours_log["logits_fake"], log["train/logits_fake"].item(), what="mean fake logit")
    assert_close(value, d_loss.item(), what=f"{kind} discriminator loss at step {step}")
    assert (float(value) == 0.0) == (step < DISC_START)


def test_unknown_discriminator_loss_raises():
    with pytest.raises(ValueError, match="kind must be one of"):
        vqgan_loss.discriminator_loss(jnp.zeros(2), jnp.zeros(2), step=0, kind="wasserstein")
