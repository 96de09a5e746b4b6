"""The parity report names the layer where a conversion goes wrong: plant a wrong weight, find
it."""

import jax
import numpy as np
import pytest
import torch
from taming.modules.transformer import mingpt
from timm.models import vision_transformer as timm_vit

from attnjax.convert import compare, taming, torch_nn
from attnjax.convert import timm as convert_timm


def _planted(variables, path):
    """A copy of ``variables`` with the leaf at ``path`` (a Flax parameter) shifted by 1e-2
    noise."""
    noise = np.random.default_rng(0).standard_normal

    def shift(key_path, leaf):
        names = tuple(getattr(key, "key", key) for key in key_path)
        return leaf + 1e-2 * noise(np.shape(leaf)).astype(np.float32) if names == path else leaf

    return jax.tree_util.tree_map_with_path(shift, variables)


def _assert_report_names(torch_model, flax_module, variables, inputs, planted_path, expected_layer):
    rows = compare.compare_layers(torch_model, flax_module, variables, inputs)
    assert len(rows) > 5 and all(row.ok for row in rows), compare.format_report(rows, 1e-5)
    rows = compare.compare_layers(
        torch_model, flax_module, _planted(variables, planted_path), inputs
    )
    failure = compare.first_failure(rows)
    assert failure is not None and failure.layer == expected_layer, compare.format_report(
        rows, 1e-5
    )
    before = rows[: rows.index(failure)]
    assert before and all(row.ok for row in before)
    assert rows[-1].layer == "(output)" and not rows[-1].ok


def test_timm_vit_report_names_the_planted_layer():
    torch.manual_seed(0)
    model = timm_vit.VisionTransformer(
        img_size=16, patch_size=4, embed_dim=24, depth=2, num_heads=3, num_classes=5
    )
    with torch.no_grad():
        model.head.weight.normal_()
    flax_module, variables = convert_timm.vit_from_timm(model)
    images = np.random.default_rng(0).standard_normal((2, 16, 16, 3)).astype(np.float32)
    _assert_report_names(
        model,
        flax_module,
        variables,
        images,
        ("params", "blocks_1", "attn", "value", "kernel"),
        "blocks.1.attn.qkv",
    )


def test_taming_gpt_report_names_the_planted_layer():
    torch.manual_seed(0)
    model = mingpt.GPT(29, 8, n_layer=2, n_head=2, n_embd=16).eval()
    flax_module, variables = taming.gpt_from_taming(model.state_dict(), n_head=2)
    tokens = np.random.default_rng(0).integers(0, 29, (2, 8))
    _assert_report_names(
        model,
        flax_module,
        variables,
        tokens,
        ("params", "blocks_1", "attn", "value", "kernel"),
        "blocks.1.attn.value",
    )


def test_taming_vqgan_report_names_the_planted_layer():
    torch_model, flax_module, variables, images = compare.build("taming-vqgan")
    _assert_report_names(
        torch_model,
        flax_module,
        variables,
        images,
        ("params", "decoder", "up_1_block_0", "conv1", "kernel"),
        "decoder.up.1.block.0.conv1",
    )


def test_torch_transformer_report_names_the_planted_layer():
    torch.manual_seed(0)
    model = torch.nn.Transformer(16, 2, 1, 2, 24, dropout=0.0, batch_first=False).eval()
    flax_module, variables = torch_nn.transformer_from_torch(model)
    rng = np.random.default_rng(0)
    inputs = tuple(rng.standard_normal((length, 3, 16)).astype(np.float32) for length in (5, 4))
    _assert_report_names(
        model,
        flax_module,
        variables,
        inputs,
        ("params", "decoder", "layers_1", "norm2", "scale"),
        "decoder.layers.1.norm2",
    )


def test_command_line_plants_and_reports(capsys):
    assert (
        compare.main(
            ["--model", "torch:TransformerEncoder", "--n-head", "2", "--plant", "layers.1.linear1"]
        )
        == 1
    )
    assert "first layer beyond max_rel 1e-05: layers.1.linear1" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--model 'keras:vit'"):
        compare.main(["--model", "keras:vit"])


def test_a_module_without_pairing_raises():
    import flax.linen as nn

    with pytest.raises(ValueError, match="no layer pairing for Dense"):
        compare.compare_layers(torch.nn.Linear(8, 3), nn.Dense(3), {}, np.zeros((1, 8), np.float32))
