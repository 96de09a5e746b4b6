"""attnjax.convert.taming: the key tables against taming's own modules. Numerical parity of the
converted models is tested with the models (tests/test_vqgan.py, tests/test_prior.py); here,
which tensor lands where, which keys are ignored, and which are refused."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_close
from taming.modules.discriminator.model import NLayerDiscriminator as TorchDiscriminator
from taming.modules.transformer import mingpt

from attnjax.convert.taming import (
    gpt_from_taming,
    nlayer_discriminator_from_taming,
    vqgan_from_taming,
)

DDCONFIG = dict(
    ch=32,
    ch_mult=(1, 2),
    num_res_blocks=1,
    attn_resolutions=(4,),
    in_channels=3,
    out_ch=3,
    resolution=8,
    z_channels=8,
    double_z=False,
    dropout=0.0,
)
N_EMBED, EMBED_DIM = 16, 4


def _numpy(state):
    return {key: value.detach().numpy() for key, value in state.items()}


def _vqmodel_state():
    from taming.modules.diffusionmodules.model import Decoder, Encoder
    from taming.modules.vqvae.quantize import VectorQuantizer

    torch.manual_seed(0)
    parts = torch.nn.ModuleDict(
        {
            "encoder": Encoder(**DDCONFIG),
            "decoder": Decoder(**DDCONFIG),
            "quantize": VectorQuantizer(N_EMBED, EMBED_DIM, beta=0.25),
            "quant_conv": torch.nn.Conv2d(DDCONFIG["z_channels"], EMBED_DIM, 1),
            "post_quant_conv": torch.nn.Conv2d(EMBED_DIM, DDCONFIG["z_channels"], 1),
        }
    )
    return _numpy(parts.state_dict())


def test_vqgan_table_places_taming_tensors():
    state = _vqmodel_state()
    _, variables = vqgan_from_taming(state, DDCONFIG, N_EMBED, EMBED_DIM)
    params = variables["params"]
    expected = {
        ("encoder", "down_0_block_0", "conv1", "kernel"): state[
            "encoder.down.0.block.0.conv1.weight"
        ].transpose(2, 3, 1, 0),
        ("encoder", "down_1_attn_0", "q", "bias"): state["encoder.down.1.attn.0.q.bias"],
        ("encoder", "down_0_downsample", "conv", "kernel"): state[
            "encoder.down.0.downsample.conv.weight"
        ].transpose(2, 3, 1, 0),
        ("decoder", "up_1_upsample", "conv", "bias"): state["decoder.up.1.upsample.conv.bias"],
        ("decoder", "mid_attn_1", "norm", "scale"): state["decoder.mid.attn_1.norm.weight"],
        ("decoder", "norm_out", "bias"): state["decoder.norm_out.bias"],
        ("quant_conv", "kernel"): state["quant_conv.weight"].transpose(2, 3, 1, 0),
        ("quantize", "embedding"): state["quantize.embedding.weight"],
    }
    for path, want in expected.items():
        leaf = params
        for part in path:
            leaf = leaf[part]
        np.testing.assert_array_equal(leaf, want, err_msg="/".join(path))


def test_vqgan_from_lightning_checkpoint_ignores_loss_and_refuses_unknown_keys():
    state = _vqmodel_state()
    _, plain = vqgan_from_taming(state, DDCONFIG, N_EMBED, EMBED_DIM)
    wrapped = {f"model.{key}": value for key, value in state.items()}
    wrapped["model.loss.discriminator.main.0.weight"] = np.zeros((8, 3, 4, 4), np.float32)
    _, unwrapped = vqgan_from_taming({"state_dict": wrapped}, DDCONFIG, N_EMBED, EMBED_DIM)
    chex.assert_trees_all_close(unwrapped, plain, rtol=0, atol=0)
    state["encoder.down.0.block.0.conv1.lora"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"vqgan_from_taming: keys not converted .*conv1\.lora"):
        vqgan_from_taming(state, DDCONFIG, N_EMBED, EMBED_DIM)
    del state["encoder.down.0.block.0.conv1.lora"], state["decoder.conv_out.weight"]
    with pytest.raises(KeyError, match="no key 'decoder.conv_out.weight'"):
        vqgan_from_taming(state, DDCONFIG, N_EMBED, EMBED_DIM)
    del state["decoder.conv_out.bias"]
    with pytest.raises(ValueError, match=r"does not match the model: missing .*'conv_out'"):
        vqgan_from_taming(state, DDCONFIG, N_EMBED, EMBED_DIM)


def test_discriminator_under_a_prefix_with_batch_statistics():
    torch.manual_seed(0)
    reference = TorchDiscriminator(input_nc=3, ndf=8, n_layers=2)
    state = {f"loss.discriminator.{k}": v for k, v in _numpy(reference.state_dict()).items()}
    model, variables = nlayer_discriminator_from_taming(state, prefix="loss.discriminator")
    assert (model.ndf, model.n_layers, model.norm) == (8, 2, "batch")
    np.testing.assert_array_equal(
        variables["batch_stats"]["main_3"]["var"], state["loss.discriminator.main.3.running_var"]
    )
    np.testing.assert_array_equal(
        variables["params"]["main_3"]["scale"], state["loss.discriminator.main.3.weight"]
    )
    with pytest.raises(KeyError, match="no 'other.main.N.weight' conv keys"):
        nlayer_discriminator_from_taming(state, prefix="other")


def test_gpt_from_net2net_state_dict_and_bad_inputs():
    torch.manual_seed(0)
    reference = mingpt.GPT(11, 6, n_layer=2, n_head=2, n_embd=8).eval()
    state = {f"transformer.{k}": v for k, v in _numpy(reference.state_dict()).items()}
    state["first_stage_model.encoder.conv_in.weight"] = np.zeros((1,), np.float32)  # not the GPT's
    model, variables = gpt_from_taming(state, n_head=2)
    assert (model.vocab_size, model.block_size, model.n_layer, model.n_embd) == (11, 6, 2, 8)
    np.testing.assert_array_equal(
        variables["params"]["blocks_1"]["attn"]["out"]["kernel"],
        state["transformer.blocks.1.attn.proj.weight"].T,
    )
    indices = np.array([[1, 4, 9, 0, 3]])
    with torch.no_grad():
        expected = reference(torch.from_numpy(indices))[0].numpy()
    assert_close(model.apply(variables, jnp.asarray(indices)), expected, what="GPT logits")
    with pytest.raises(ValueError, match="n_head=3 does not divide n_embd=8"):
        gpt_from_taming(state, n_head=3)
    with pytest.raises(KeyError, match="no key 'pos_emb'; is it a taming GPT"):
        gpt_from_taming({"tok_emb.weight": np.zeros((3, 8))}, n_head=2)
