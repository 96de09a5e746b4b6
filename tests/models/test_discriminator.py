"""attnjax.models.discriminator (PatchGAN, ActNorm) against taming-transformers 0.0.1 (PyTorch),
with weights converted by attnjax.convert.taming."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import (
    assert_close,
    assert_relative,
    nchw,
    nhwc,
    randomise_norms,
    relative_to_max,
)
from taming.modules.discriminator.model import NLayerDiscriminator as TorchDiscriminator
from taming.modules.discriminator.model import weights_init

from attnjax.convert import taming as taming_convert
from attnjax.models import discriminator


def test_nlayer_discriminator_matches_taming_in_eval_mode():
    torch.manual_seed(0)
    reference = TorchDiscriminator(input_nc=3, ndf=16, n_layers=2).apply(weights_init).eval()
    randomise_norms(reference, torch.Generator().manual_seed(2))
    images = np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32)
    with torch.no_grad():
        expected = reference(nchw(images))
    model, variables = taming_convert.nlayer_discriminator_from_taming(reference.state_dict())
    assert (model.ndf, model.n_layers, model.norm) == (16, 2, "batch")
    assert_relative(
        model.apply(variables, jnp.asarray(images)), nhwc(expected), what="PatchGAN logits"
    )


def test_actnorm_discriminator_matches_taming():
    torch.manual_seed(0)
    reference = TorchDiscriminator(input_nc=1, ndf=8, n_layers=2, use_actnorm=True).apply(
        weights_init
    )
    images = np.random.default_rng(0).uniform(-1, 1, (3, 16, 16, 1)).astype(np.float32)
    with torch.no_grad():
        reference(nchw(images))  # ActNorm initialises itself on the first training batch
        expected = reference.eval()(nchw(images[:2]))
    model, variables = taming_convert.nlayer_discriminator_from_taming(reference.state_dict())
    assert model.norm == "actnorm"
    assert_relative(
        model.apply(variables, jnp.asarray(images[:2])), nhwc(expected), what="ActNorm PatchGAN"
    )


def test_actnorm_init_matches_taming():
    """Our ActNorm's data-dependent init on a batch gives taming's loc and scale for it."""
    from taming.modules.util import ActNorm as TorchActNorm

    x = np.random.default_rng(0).normal(1.0, 2.0, (4, 5, 5, 6)).astype(np.float32)
    reference = TorchActNorm(6)
    with torch.no_grad():
        expected = reference(nchw(x))
    variables = discriminator.ActNorm().init(jax.random.PRNGKey(0), jnp.asarray(x))
    assert_close(
        variables["params"]["loc"], reference.loc.detach().numpy().reshape(-1), what="ActNorm loc"
    )
    assert_close(
        variables["params"]["scale"],
        reference.scale.detach().numpy().reshape(-1),
        what="ActNorm scale",
    )
    assert_relative(
        discriminator.ActNorm().apply(variables, jnp.asarray(x)),
        nhwc(expected),
        what="ActNorm output",
    )


@pytest.mark.parametrize("use_actnorm", [False, True], ids=["batchnorm", "actnorm"])
def test_discriminator_conv_biases_follow_taming(use_actnorm):
    """taming drops a conv's bias only before a BatchNorm; with ActNorm every conv keeps one."""
    reference = TorchDiscriminator(input_nc=1, ndf=8, n_layers=3, use_actnorm=use_actnorm)
    taming = {
        i: layer.bias is not None
        for i, layer in enumerate(reference.main)
        if isinstance(layer, torch.nn.Conv2d)
    }
    model = discriminator.NLayerDiscriminator(
        ndf=8, n_layers=3, norm="actnorm" if use_actnorm else "batch"
    )
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.ones((2, 32, 32, 1)))["params"]
    ours = {
        int(name[len("main_") :]): "bias" in leaves
        for name, leaves in params.items()
        if "kernel" in leaves
    }
    assert ours == taming
    assert all(taming.values()) == use_actnorm


@pytest.mark.parametrize("norm", ["batch", "actnorm"])
def test_bfloat16_discriminator_keeps_float32_parameters_and_logits(norm):
    images = np.random.default_rng(0).uniform(-1, 1, (4, 16, 16, 3)).astype(np.float32)
    full = discriminator.NLayerDiscriminator(ndf=8, n_layers=2, norm=norm)
    half = full.clone(dtype=jnp.bfloat16)
    variables = half.init(jax.random.key(0), jnp.asarray(images))
    assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}
    logits = half.apply(variables, jnp.asarray(images))
    expected = full.apply(variables, jnp.asarray(images))
    assert logits.dtype == jnp.float32
    assert relative_to_max(logits, expected) < 3e-2
