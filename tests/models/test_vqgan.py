"""attnjax.models.vqgan against taming-transformers 0.0.1 (PyTorch), with weights converted from
randomly initialised taming modules by attnjax.convert.taming."""

import functools

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
from taming.modules.diffusionmodules.model import Decoder as TorchDecoder
from taming.modules.diffusionmodules.model import Encoder as TorchEncoder
from taming.modules.vqvae.quantize import VectorQuantizer as TorchVectorQuantizer

from attnjax.convert import taming as taming_convert
from attnjax.models import vqgan

# One config with attention below the top level, one with several ch_mult levels and no
# attention outside the middle block; GroupNorm(32) needs widths that are multiples of 32.
DDCONFIGS = {
    "attention": dict(
        ch=32,
        ch_mult=(1, 2),
        num_res_blocks=1,
        attn_resolutions=(8,),
        in_channels=3,
        out_ch=3,
        resolution=16,
        z_channels=16,
        double_z=False,
        dropout=0.0,
    ),
    "levels": dict(
        ch=32,
        ch_mult=(1, 1, 2),
        num_res_blocks=2,
        attn_resolutions=(),
        in_channels=1,
        out_ch=1,
        resolution=16,
        z_channels=8,
        double_z=False,
        dropout=0.0,
    ),
}
N_EMBED, EMBED_DIM = 32, 8


class TorchVQModel(torch.nn.Module):
    """taming's VQModel minus pytorch-lightning: the same submodules, names and forward."""

    def __init__(self, ddconfig):
        super().__init__()
        self.encoder = TorchEncoder(**ddconfig)
        self.decoder = TorchDecoder(**ddconfig)
        self.quantize = TorchVectorQuantizer(N_EMBED, EMBED_DIM, beta=0.25)
        self.quant_conv = torch.nn.Conv2d(ddconfig["z_channels"], EMBED_DIM, 1)
        self.post_quant_conv = torch.nn.Conv2d(EMBED_DIM, ddconfig["z_channels"], 1)

    def forward(self, x):
        quant, qloss, (_, _, indices) = self.quantize(self.quant_conv(self.encoder(x)))
        return self.decoder(self.post_quant_conv(quant)), qloss, indices, quant


@functools.lru_cache(maxsize=None)
def _converted(name):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    ddconfig = DDCONFIGS[name]
    reference = TorchVQModel(ddconfig).eval()
    randomise_norms(reference, generator)
    with torch.no_grad():  # codes on the scale of the encodings, so that many codes get picked
        reference.quantize.embedding.weight.normal_(0.0, 0.3, generator=generator)
    model, variables = taming_convert.vqgan_from_taming(
        reference.state_dict(), ddconfig, N_EMBED, EMBED_DIM
    )
    images = (
        np.random.default_rng(0)
        .uniform(-1, 1, (2, 16, 16, ddconfig["in_channels"]))
        .astype(np.float32)
    )
    return reference, model, variables, images


@pytest.fixture(params=sorted(DDCONFIGS))
def converted(request):
    return _converted(request.param)


def test_encoder_and_decoder_match_taming(converted):
    reference, model, variables, images = converted
    with torch.no_grad():
        latents = reference.encoder(nchw(images))
        decoded = reference.decoder(latents)
    ours = model.apply(variables, jnp.asarray(images), method=lambda m, x: m.encoder(x))
    assert_relative(ours, nhwc(latents), what="encoder output")
    ours = model.apply(variables, jnp.asarray(nhwc(latents)), method=lambda m, z: m.decoder(z))
    assert_relative(ours, nhwc(decoded), what="decoder output")


def test_full_encode_quantize_decode_matches_taming(converted):
    reference, model, variables, images = converted
    with torch.no_grad():
        expected, qloss, indices, quant = reference(nchw(images))
    reconstruction, aux = model.apply(variables, jnp.asarray(images))
    np.testing.assert_array_equal(
        np.asarray(aux["indices"]).reshape(-1), indices.numpy().reshape(-1)
    )
    assert len(np.unique(indices.numpy())) > 3, "test is weak: the encodings hit too few codes"
    quantized, _, _ = model.apply(variables, jnp.asarray(images), method=model.encode)
    assert_relative(quantized, nhwc(quant), what="quantized latents")
    assert_close(aux["loss"], qloss.item(), what="quantizer loss")
    assert_relative(reconstruction, nhwc(expected), what="reconstruction")
    from_indices = model.apply(variables, aux["indices"], method=model.decode_indices)
    assert_relative(from_indices, nhwc(expected), what="decode_indices")


@pytest.mark.parametrize("remat", [False, True])
def test_gradients_match_taming(remat):
    """The straight-through estimator and legacy loss: gradients of one scalar agree, with the
    blocks' activations kept or recomputed in the backward pass."""
    reference, model, variables, images = _converted("attention")
    model = model.clone(remat=remat)
    weights = np.random.default_rng(1).normal(
        size=images.shape[:3] + (reference.decoder.conv_out.out_channels,)
    )
    weights = weights.astype(np.float32)
    reference.zero_grad()
    expected, qloss, _, _ = reference(nchw(images))
    (torch.sum(expected * nchw(weights)) + qloss).backward()

    def objective(params):
        reconstruction, aux = model.apply({"params": params}, jnp.asarray(images))
        return jnp.sum(reconstruction * weights) + aux["loss"]

    # One trace for both the gradient and the count of recomputed blocks (a trace of this
    # model's gradient is seconds of the test).
    traced = jax.jit(jax.grad(objective)).trace(variables["params"])
    jaxpr = str(traced.jaxpr)
    grads = traced.lower().compile()(variables["params"])
    # Encoder: 2 ResNet blocks with 1 attention at the 8x8 level, the middle 2 + 1; decoder: 4
    # and 2 there, the middle 2 + 1.
    assert jaxpr.count("remat2[") == (15 if remat else 0)
    torch_grads = dict(reference.named_parameters())
    for torch_name, ours in [
        ("encoder.conv_in.weight", grads["encoder"]["conv_in"]["kernel"]),
        ("encoder.norm_out.weight", grads["encoder"]["norm_out"]["scale"]),
        ("decoder.conv_out.weight", grads["decoder"]["conv_out"]["kernel"]),
        ("quantize.embedding.weight", grads["quantize"]["embedding"]),
    ]:
        expected_grad = torch_grads[torch_name].grad.numpy()
        if expected_grad.ndim == 4:
            expected_grad = expected_grad.transpose(2, 3, 1, 0)
        assert_relative(ours, expected_grad, tol=1e-5, what=f"grad of {torch_name}")


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        vqgan.Encoder(
            ch=16,
            ch_mult=(1,),
            num_res_blocks=1,
            attn_resolutions=(),
            in_channels=3,
            resolution=8,
            z_channels=4,
        ).init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 3)))
    model = vqgan.create_vqgan(DDCONFIGS["levels"], N_EMBED, EMBED_DIM)
    with pytest.raises(ValueError, match="divisible by 4"):
        model.init(jax.random.PRNGKey(0), jnp.zeros((1, 10, 10, 1)))
    with pytest.raises(ValueError, match="unknown ddconfig keys"):
        vqgan.create_vqgan(dict(DDCONFIGS["levels"], give_pre_end=True), N_EMBED, EMBED_DIM)
    with pytest.raises(ValueError, match="double_z"):
        taming_convert.vqgan_from_taming(
            {}, dict(DDCONFIGS["levels"], double_z=True), N_EMBED, EMBED_DIM
        )


@pytest.mark.parametrize("name", sorted(DDCONFIGS))
def test_token_grid_is_the_shape_encode_gives(name):
    model = vqgan.create_vqgan(DDCONFIGS[name], N_EMBED, EMBED_DIM)
    example = jnp.zeros((1, 16, 16, model.in_channels))
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), example)
    for height, width in ((16, 16), (32, 16), (8, 24)):
        image = jax.ShapeDtypeStruct((2, height, width, model.in_channels), jnp.float32)
        indices = jax.eval_shape(
            lambda v, x: model.apply(v, x, method=vqgan.VQGAN.encode)[1], variables, image
        )
        assert model.token_grid(height, width) == indices.shape[1:]
    with pytest.raises(ValueError, match=r"divisible by \d+ .*got 9 x 16"):
        model.token_grid(9, 16)


def test_bfloat16_compute_keeps_float32_parameters_quantizer_and_image():
    """dtype=bfloat16: the encoder and decoder compute in bf16 (their convolutions are bf16 in the
    program), while parameters, the quantizer's input and the image out stay float32; encoder
    and decoder outputs stay within bf16 rounding of taming's float32 ones."""
    reference, model, variables, images = _converted("attention")
    half = model.clone(dtype=jnp.bfloat16)
    params = jax.eval_shape(half.init, jax.random.key(0), jnp.asarray(images))["params"]
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}

    with torch.no_grad():
        latents = reference.encoder(nchw(images))
        decoded = reference.decoder(latents)
    encoded = half.apply(variables, jnp.asarray(images), method=lambda m, x: m.encoder(x))
    assert encoded.dtype == jnp.bfloat16
    assert relative_to_max(encoded, nhwc(latents)) < 2e-2
    image = half.apply(variables, jnp.asarray(nhwc(latents)), method=lambda m, z: m.decoder(z))
    assert image.dtype == jnp.float32
    # The decoder's bfloat16 rounding, compounded over its blocks: 2.04e-2 with today's lock.
    assert relative_to_max(image, nhwc(decoded)) < 3e-2

    reconstruction, aux = half.apply(variables, jnp.asarray(images))
    assert reconstruction.dtype == aux["latents"].dtype == aux["loss"].dtype == jnp.float32
    hlo = jax.jit(half.apply).lower(variables, jnp.asarray(images)).as_text()
    convolutions = [line for line in hlo.splitlines() if "stablehlo.convolution" in line]
    float32 = [line for line in convolutions if "bf16" not in line]
    assert len(convolutions) > 10 and len(float32) == 2, float32  # quant_conv, conv_out
