"""attnjax.models.vqgan against taming-transformers 0.0.1 (PyTorch), with weights converted from
randomly initialised taming modules by attnjax.convert.taming."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_close
from taming.modules.diffusionmodules.model import Decoder as TorchDecoder
from taming.modules.diffusionmodules.model import Encoder as TorchEncoder
from taming.modules.discriminator.model import NLayerDiscriminator as TorchDiscriminator
from taming.modules.discriminator.model import weights_init
from taming.modules.vqvae.quantize import VectorQuantizer as TorchVectorQuantizer

from attnjax.convert import taming as taming_convert
from attnjax.models import discriminator, vector_quantizer, vqgan

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


def assert_relative(actual, expected, tol=1e-5, what="value"):
    """Relative error in the max norm: ``|a - b| <= tol * (|b| + max |b|)`` elementwise, so that
    entries near zero in a deep float32 network are held to the scale of the output."""
    expected = np.asarray(expected)
    assert_close(actual, expected, rtol=tol, atol=tol * float(np.abs(expected).max()), what=what)


def _randomise_norms(module, generator):
    """Default GroupNorm/BatchNorm affines are 1 and 0: perturb them so that their conversion
    counts."""
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, (torch.nn.GroupNorm, torch.nn.BatchNorm2d)):
                layer.weight.add_(0.2 * torch.randn(layer.weight.shape, generator=generator))
                layer.bias.add_(0.2 * torch.randn(layer.bias.shape, generator=generator))
            if isinstance(layer, torch.nn.BatchNorm2d):
                layer.running_mean.copy_(
                    0.1 * torch.randn(layer.running_mean.shape, generator=generator)
                )
                layer.running_var.copy_(
                    1 + torch.rand(layer.running_var.shape, generator=generator)
                )


def _nchw(x):
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x).transpose(0, 3, 1, 2)))


def _nhwc(t):
    return t.detach().numpy().transpose(0, 2, 3, 1)


@functools.lru_cache(maxsize=None)
def _converted(name):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    ddconfig = DDCONFIGS[name]
    reference = TorchVQModel(ddconfig).eval()
    _randomise_norms(reference, generator)
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
        latents = reference.encoder(_nchw(images))
        decoded = reference.decoder(latents)
    ours = model.apply(variables, jnp.asarray(images), method=lambda m, x: m.encoder(x))
    assert_relative(ours, _nhwc(latents), what="encoder output")
    ours = model.apply(variables, jnp.asarray(_nhwc(latents)), method=lambda m, z: m.decoder(z))
    assert_relative(ours, _nhwc(decoded), what="decoder output")


def test_full_encode_quantize_decode_matches_taming(converted):
    reference, model, variables, images = converted
    with torch.no_grad():
        expected, qloss, indices, quant = reference(_nchw(images))
    reconstruction, aux = model.apply(variables, jnp.asarray(images))
    np.testing.assert_array_equal(
        np.asarray(aux["indices"]).reshape(-1), indices.numpy().reshape(-1)
    )
    assert len(np.unique(indices.numpy())) > 3, "test is weak: the encodings hit too few codes"
    quantized, _, _ = model.apply(variables, jnp.asarray(images), method=model.encode)
    assert_relative(quantized, _nhwc(quant), what="quantized latents")
    assert_close(aux["loss"], qloss.item(), what="quantizer loss")
    assert_relative(reconstruction, _nhwc(expected), what="reconstruction")
    from_indices = model.apply(variables, aux["indices"], method=model.decode_indices)
    assert_relative(from_indices, _nhwc(expected), what="decode_indices")


def test_gradients_match_taming():
    """The straight-through estimator and legacy loss: gradients of one scalar agree."""
    reference, model, variables, images = _converted("attention")
    weights = np.random.default_rng(1).normal(
        size=images.shape[:3] + (reference.decoder.conv_out.out_channels,)
    )
    weights = weights.astype(np.float32)
    reference.zero_grad()
    expected, qloss, _, _ = reference(_nchw(images))
    (torch.sum(expected * _nchw(weights)) + qloss).backward()

    def objective(params):
        reconstruction, aux = model.apply({"params": params}, jnp.asarray(images))
        return jnp.sum(reconstruction * weights) + aux["loss"]

    grads = jax.jit(jax.grad(objective))(variables["params"])
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


def test_vector_quantizer_matches_taming():
    torch.manual_seed(0)
    reference = TorchVectorQuantizer(64, 4, beta=0.25)
    with torch.no_grad():
        reference.embedding.weight.normal_()
    z = np.random.default_rng(0).normal(size=(3, 5, 6, 4)).astype(np.float32)
    z_torch = _nchw(z).requires_grad_(True)
    z_q, loss, (perplexity, _, indices) = reference(z_torch)
    (loss + (z_q**3).sum()).backward()

    quantizer = vector_quantizer.VectorQuantizer(64, 4, beta=0.25, legacy=True)
    params = {"params": {"embedding": jnp.asarray(reference.embedding.weight.detach().numpy())}}

    def objective(params, z):
        quantized, _, aux = quantizer.apply(params, z)
        return aux["loss"] + jnp.sum(quantized**3), (quantized, aux)

    (value, (quantized, aux)), (grad_params, grad_z) = jax.value_and_grad(
        objective, (0, 1), has_aux=True
    )(params, jnp.asarray(z))
    _, ours_indices, _ = quantizer.apply(params, jnp.asarray(z))
    np.testing.assert_array_equal(np.asarray(ours_indices).reshape(-1), indices.numpy().reshape(-1))
    assert_close(quantized, _nhwc(z_q), what="quantized")
    assert_close(aux["loss"], loss.item(), what="legacy loss")
    assert_close(aux["perplexity"], perplexity.item(), what="perplexity")
    assert_close(aux["codebook_usage"], len(np.unique(indices.numpy())) / 64, what="usage")
    assert_close(grad_z, _nhwc(z_torch.grad), what="grad wrt z (straight-through)")
    assert_close(
        grad_params["params"]["embedding"],
        reference.embedding.weight.grad.numpy(),
        what="grad wrt codebook",
    )


def test_non_legacy_loss_puts_beta_on_commitment():
    """VectorQuantizer2(legacy=False): d loss / d z = 2 beta (z - e) / N,
    d loss / d e = 2 (e - z) / N."""
    rng = np.random.default_rng(0)
    codes = rng.normal(size=(8, 3)).astype(np.float32)
    z = rng.normal(size=(1, 2, 5, 3)).astype(np.float32)
    quantizer = vector_quantizer.VectorQuantizer(8, 3, beta=0.25)
    loss_of = lambda p, z: quantizer.apply(p, z)[2]["loss"]
    params = {"params": {"embedding": jnp.asarray(codes)}}
    grad_params, grad_z = jax.grad(loss_of, (0, 1))(params, jnp.asarray(z))
    nearest = ((z.reshape(-1, 1, 3) - codes) ** 2).sum(-1).argmin(-1)
    chosen = codes[nearest].reshape(z.shape)
    assert_close(grad_z, 2 * 0.25 * (z - chosen) / z.size, what="commitment gradient")
    expected = np.zeros_like(codes)
    np.add.at(expected, nearest, 2 * (chosen - z).reshape(-1, 3) / z.size)
    assert_close(grad_params["params"]["embedding"], expected, what="codebook gradient")


def test_l2_normalised_codes_pick_the_most_cosine_similar_code():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(2, 3, 3, 6)).astype(np.float32)
    quantizer = vector_quantizer.VectorQuantizer(16, 6, l2_normalize=True)
    params = quantizer.init(jax.random.PRNGKey(0), z)
    quantized, indices, _ = quantizer.apply(params, z)
    codes = np.asarray(params["params"]["embedding"])
    cosine = (z.reshape(-1, 6) / np.linalg.norm(z.reshape(-1, 6), axis=1, keepdims=True)) @ (
        codes / np.linalg.norm(codes, axis=1, keepdims=True)
    ).T
    np.testing.assert_array_equal(np.asarray(indices).reshape(-1), cosine.argmax(1))
    assert_close(
        np.linalg.norm(np.asarray(quantized), axis=-1), np.ones((2, 3, 3)), what="unit-norm codes"
    )


def test_lookup_dim_projects_in_and_out():
    z = np.random.default_rng(0).normal(size=(2, 3, 3, 8)).astype(np.float32)
    quantizer = vector_quantizer.VectorQuantizer(16, 8, lookup_dim=2)
    params = quantizer.init(jax.random.PRNGKey(0), z)
    quantized, indices, aux = quantizer.apply(params, z)
    p = params["params"]
    low = z @ np.asarray(p["in_proj"]["kernel"]) + np.asarray(p["in_proj"]["bias"])
    codes = np.asarray(p["embedding"])
    nearest = ((low.reshape(-1, 1, 2) - codes) ** 2).sum(-1).argmin(-1)
    np.testing.assert_array_equal(np.asarray(indices).reshape(-1), nearest)
    expected = codes[nearest] @ np.asarray(p["out_proj"]["kernel"]) + np.asarray(
        p["out_proj"]["bias"]
    )
    assert_close(quantized, expected.reshape(2, 3, 3, 8), what="projected-back codes")
    assert aux["latents"].shape == (18, 2)


def test_ema_update_and_dead_code_reseeding():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(1, 4, 4, 3)).astype(np.float32)
    quantizer = vector_quantizer.VectorQuantizer(6, 3, ema_decay=0.9, usage_decay=0.5)
    variables = quantizer.init(jax.random.PRNGKey(0), z)
    assert "params" not in variables, "with EMA the codebook is state, not a parameter"
    codes = np.asarray(variables["vq_state"]["embedding"])
    (_, indices, aux), state = quantizer.apply(variables, z, train=True, mutable=["vq_state"])
    flat, idx = z.reshape(-1, 3), np.asarray(indices).reshape(-1)
    counts = np.bincount(idx, minlength=6).astype(np.float32)
    size = 0.9 * 1.0 + 0.1 * counts
    sums = 0.9 * codes + 0.1 * np.stack([flat[idx == k].sum(0) for k in range(6)])
    smoothed = (size + 1e-5) / (size.sum() + 6e-5) * size.sum()
    assert_close(state["vq_state"]["embedding"], sums / smoothed[:, None], what="EMA codebook")
    usage = np.asarray(state["vq_state"]["usage"])
    assert_close(usage, 0.5 * counts * 6 / 16, what="usage share")

    wrapped_params, wrapped_state = {}, {"quantize": state["vq_state"]}
    _, new_state, reseeded = vector_quantizer.reseed_dead_codes(
        wrapped_params, wrapped_state, aux["latents"], jax.random.PRNGKey(1), threshold=0.5
    )
    dead = usage < 0.5
    new_codes = np.asarray(new_state["quantize"]["embedding"])
    assert int(reseeded) == dead.sum() > 0
    assert_close(
        new_codes[~dead], np.asarray(state["vq_state"]["embedding"])[~dead], what="live codes kept"
    )
    for code in new_codes[dead]:
        assert np.isclose(flat, code, rtol=1e-6).all(1).any(), (
            "a dead code must be reseeded from a latent"
        )
    assert (np.asarray(new_state["quantize"]["usage"])[dead] == 1.0).all()


def test_nlayer_discriminator_matches_taming_in_eval_mode():
    torch.manual_seed(0)
    reference = TorchDiscriminator(input_nc=3, ndf=16, n_layers=2).apply(weights_init).eval()
    _randomise_norms(reference, torch.Generator().manual_seed(2))
    images = np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32)
    with torch.no_grad():
        expected = reference(_nchw(images))
    model, variables = taming_convert.nlayer_discriminator_from_taming(reference.state_dict())
    assert (model.ndf, model.n_layers, model.norm) == (16, 2, "batch")
    assert_relative(
        model.apply(variables, jnp.asarray(images)), _nhwc(expected), what="PatchGAN logits"
    )


def test_actnorm_discriminator_matches_taming():
    torch.manual_seed(0)
    reference = TorchDiscriminator(input_nc=1, ndf=8, n_layers=2, use_actnorm=True).apply(
        weights_init
    )
    images = np.random.default_rng(0).uniform(-1, 1, (3, 16, 16, 1)).astype(np.float32)
    with torch.no_grad():
        reference(_nchw(images))  # ActNorm initialises itself on the first training batch
        expected = reference.eval()(_nchw(images[:2]))
    model, variables = taming_convert.nlayer_discriminator_from_taming(reference.state_dict())
    assert model.norm == "actnorm"
    assert_relative(
        model.apply(variables, jnp.asarray(images[:2])), _nhwc(expected), what="ActNorm PatchGAN"
    )


def test_actnorm_init_matches_taming():
    """Our ActNorm's data-dependent init on a batch gives taming's loc and scale for it."""
    from taming.modules.util import ActNorm as TorchActNorm

    x = np.random.default_rng(0).normal(1.0, 2.0, (4, 5, 5, 6)).astype(np.float32)
    reference = TorchActNorm(6)
    with torch.no_grad():
        expected = reference(_nchw(x))
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
        _nhwc(expected),
        what="ActNorm output",
    )


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


def test_codebook_statistics_count_weighted_examples():
    indices = np.array([[[0, 1], [1, 1]], [[2, 2], [2, 2]], [[3, 3], [3, 0]]])  # [3, 2, 2]
    weights = np.array([1.0, 0.0, 0.5])  # the second example is padding
    stats = vector_quantizer.codebook_statistics(jnp.asarray(indices), 5, jnp.asarray(weights))
    counts = np.array([1 + 0.5, 3, 0, 1.5, 0])  # code 2 only appears in the padding example
    p = counts / counts.sum()
    expected = np.exp(-np.sum(p[p > 0] * np.log(p[p > 0])))
    assert_close(stats["perplexity"], expected, what="weighted perplexity")
    assert_close(stats["codebook_usage"], 3 / 5, what="weighted usage")
    plain = vector_quantizer.codebook_statistics(jnp.asarray(indices), 5)
    assert_close(
        plain["perplexity"],
        np.exp(-np.sum(np.array([2, 3, 4, 3]) / 12 * np.log(np.array([2, 3, 4, 3]) / 12))),
        what="unweighted perplexity",
    )
    assert_close(plain["codebook_usage"], 4 / 5, what="unweighted usage")
    with pytest.raises(ValueError, match=r"weights must be \[batch\] = \(3,\)"):
        vector_quantizer.codebook_statistics(jnp.asarray(indices), 5, jnp.ones(4))


def test_reseeding_a_trained_codebook_replaces_only_the_dead_codes():
    z = np.random.default_rng(3).normal(size=(1, 4, 4, 3)).astype(np.float32)
    quantizer = vector_quantizer.VectorQuantizer(6, 3, usage_decay=0.5)
    variables = quantizer.init(jax.random.PRNGKey(0), z)
    (_, _, aux), state = quantizer.apply(variables, z, train=True, mutable=["vq_state"])
    params, vq_state = {"quantize": variables["params"]}, {"quantize": state["vq_state"]}
    new_params, new_state, reseeded = vector_quantizer.reseed_dead_codes(
        params, vq_state, aux["latents"], jax.random.PRNGKey(1), threshold=0.5
    )
    dead = np.asarray(vq_state["quantize"]["usage"]) < 0.5
    codes, new_codes = (
        np.asarray(params["quantize"]["embedding"]),
        np.asarray(new_params["quantize"]["embedding"]),
    )
    assert int(reseeded) == dead.sum() > 0
    np.testing.assert_array_equal(new_codes[~dead], codes[~dead])
    assert all(
        np.isclose(np.asarray(aux["latents"]), code).all(1).any() for code in new_codes[dead]
    )
    np.testing.assert_array_equal(np.asarray(new_state["quantize"]["usage"])[dead], 1.0)
    chex.assert_trees_all_equal(
        params["quantize"]["embedding"], codes
    )  # the caller's tree is untouched
