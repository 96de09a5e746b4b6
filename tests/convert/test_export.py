"""Export to PyTorch: attnjax -> timm / taming modules give the same outputs, in PyTorch, to
1e-5."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_close
from taming.modules.diffusionmodules.model import Decoder as TorchDecoder
from taming.modules.diffusionmodules.model import Encoder as TorchEncoder
from taming.modules.transformer import mingpt
from taming.modules.vqvae.quantize import VectorQuantizer as TorchVectorQuantizer

from attnjax.convert import common, taming, timm
from attnjax.models import gpt, vit, vqgan

DDCONFIG = dict(
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
)
N_EMBED, EMBED_DIM = 24, 8


def _perturbed(variables, seed):
    """Zero-initialised heads, tokens and biases would hide a wrong mapping: randomise every
    leaf."""
    leaves, tree = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    noisy = [leaf + 0.1 * jax.random.normal(key, leaf.shape) for leaf, key in zip(leaves, keys)]
    return jax.tree.unflatten(tree, noisy)


@pytest.mark.parametrize(
    "config",
    [
        dict(pool="cls"),
        dict(pool="gap", class_token=False, layer_norm_eps=1e-5, image_size=None),
        dict(pool="gap", no_embed_class=True, fc_norm=False, scan_layers=True),
    ],
)
def test_vit_to_timm_gives_the_same_logits(config):
    config = dict(
        dict(
            num_classes=5, patch_size=4, width=24, depth=2, num_heads=3, mlp_dim=40, image_size=16
        ),
        **config,
    )
    model = vit.create_vit(**config)
    images = np.random.default_rng(0).standard_normal((2, 16, 16, 3)).astype(np.float32)
    variables = _perturbed(jax.jit(model.init)(jax.random.PRNGKey(0), jnp.asarray(images)), seed=1)
    timm_model = timm.vit_to_timm(model, variables)
    with torch.no_grad():
        theirs = timm_model(torch.from_numpy(images.transpose(0, 3, 1, 2).copy())).numpy()
    assert_close(
        jax.jit(model.apply)(variables, images), theirs, what="timm logits of the exported ViT"
    )
    # and back: the importer reads the export into the same parameters
    _, reimported = timm.vit_from_timm(timm_model, scan_layers=model.scan_layers)
    for (path, got), expected in zip(
        jax.tree_util.tree_leaves_with_path(reimported), jax.tree.leaves(variables)
    ):
        np.testing.assert_array_equal(got, expected, err_msg=jax.tree_util.keystr(path))


class TorchVQModel(torch.nn.Module):
    """taming's VQModel minus pytorch-lightning: the same submodules and names."""

    def __init__(self):
        super().__init__()
        self.encoder = TorchEncoder(**DDCONFIG)
        self.decoder = TorchDecoder(**DDCONFIG)
        self.quantize = TorchVectorQuantizer(N_EMBED, EMBED_DIM, beta=0.25)
        self.quant_conv = torch.nn.Conv2d(DDCONFIG["z_channels"], EMBED_DIM, 1)
        self.post_quant_conv = torch.nn.Conv2d(EMBED_DIM, DDCONFIG["z_channels"], 1)

    def forward(self, x):
        quant, _, (_, _, indices) = self.quantize(self.quant_conv(self.encoder(x)))
        return self.decoder(self.post_quant_conv(quant)), indices


def test_vqgan_safetensors_load_into_taming(tmp_path):
    model = vqgan.create_vqgan(DDCONFIG, N_EMBED, EMBED_DIM, quantizer={"legacy": True})
    images = np.random.default_rng(0).uniform(-1, 1, (2, 16, 16, 3)).astype(np.float32)
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.asarray(images))
    variables = {**variables, "params": _perturbed(variables["params"], seed=2)}
    path = taming.save_vqgan(variables, tmp_path / "vqgan.safetensors")

    reference = TorchVQModel().eval()
    result = reference.load_state_dict(
        {k: torch.from_numpy(v) for k, v in common.load_state_dict(path).items()}, strict=True
    )
    assert not result.missing_keys and not result.unexpected_keys
    with torch.no_grad():
        expected, indices = reference(torch.from_numpy(images.transpose(0, 3, 1, 2).copy()))
    reconstruction, aux = jax.jit(model.apply)(variables, images)
    np.testing.assert_array_equal(
        np.asarray(aux["indices"]).reshape(-1), indices.numpy().reshape(-1)
    )
    expected = expected.numpy().transpose(0, 2, 3, 1)
    assert_close(
        reconstruction,
        expected,
        atol=1e-5 * float(np.abs(expected).max()),
        what="taming reconstruction",
    )
    _, reimported = taming.vqgan_from_taming(path, DDCONFIG, N_EMBED, EMBED_DIM)
    for (path_, got), want in zip(
        jax.tree_util.tree_leaves_with_path(reimported["params"]),
        jax.tree.leaves(variables["params"]),
    ):
        np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path_))


def test_gpt_safetensors_load_into_mingpt(tmp_path):
    model = gpt.GPT(vocab_size=37, block_size=12, n_layer=2, n_head=4, n_embd=32)
    tokens = np.random.default_rng(0).integers(0, 37, (2, 12))
    variables = _perturbed(jax.jit(model.init)(jax.random.PRNGKey(0), jnp.asarray(tokens)), seed=3)
    path = taming.save_gpt(model, variables, tmp_path / "gpt.safetensors")
    reference = mingpt.GPT(37, 12, n_layer=2, n_head=4, n_embd=32).eval()
    reference.load_state_dict(
        {k: torch.from_numpy(v) for k, v in common.load_state_dict(path).items()}, strict=True
    )
    with torch.no_grad():
        expected, _ = reference(torch.from_numpy(tokens))
    assert_close(
        jax.jit(model.apply)(variables, tokens),
        expected.numpy(),
        what="minGPT logits of the exported GPT",
    )


def test_failed_export_leaves_existing_files_alone(tmp_path):
    target = tmp_path / "gpt.safetensors"
    target.write_bytes(b"keep")
    model = gpt.GPT(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=4)
    variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="must end in .safetensors"):
        taming.save_gpt(model, variables, tmp_path / "gpt.pt")
    with pytest.raises(ValueError, match="are these VQGAN variables"):
        taming.save_vqgan(variables, target)
    assert target.read_bytes() == b"keep"
