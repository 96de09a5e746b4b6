"""attnjax.convert.common: safe loading, the layer converters against PyTorch, apply_key_table."""

import pickle

import chex
import flax.linen as nn
import numpy as np
import pytest
import torch
from helpers import assert_close, write_pickle_that_runs_code
from safetensors.torch import save_file

from attnjax.convert import common


def nchw(x):
    return torch.tensor(np.ascontiguousarray(np.transpose(x, (0, 3, 1, 2))))


def to_nhwc(t):
    return t.detach().numpy().transpose(0, 2, 3, 1)


@pytest.mark.parametrize("bias", [True, False])
def test_linear(bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 3, bias=bias)
    x = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
    params = common.linear(layer.state_dict(), "")
    ours = nn.Dense(3, use_bias=bias).apply({"params": params}, x)
    assert_close(ours, layer(torch.tensor(x)).detach().numpy(), what="Linear")


def test_conv2d():
    torch.manual_seed(0)
    layer = torch.nn.Conv2d(3, 5, kernel_size=3, stride=2, padding=1)
    x = np.random.default_rng(1).normal(size=(2, 9, 9, 3)).astype(np.float32)
    params = common.conv2d({"conv." + k: v for k, v in layer.state_dict().items()}, "conv")
    ours = nn.Conv(5, (3, 3), strides=2, padding=((1, 1), (1, 1))).apply({"params": params}, x)
    assert_close(ours, to_nhwc(layer(nchw(x))), what="Conv2d")


def test_layer_norm_group_norm_batch_norm_embedding():
    torch.manual_seed(0)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 4, 4, 6)).astype(np.float32)

    ln = torch.nn.LayerNorm(6)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    ours = nn.LayerNorm(epsilon=1e-5).apply({"params": common.layer_norm(ln.state_dict(), "")}, x)
    assert_close(ours, ln(torch.tensor(x)).detach().numpy(), rtol=1e-5, atol=1e-5, what="LayerNorm")

    gn = torch.nn.GroupNorm(3, 6)
    with torch.no_grad():
        gn.weight.normal_(), gn.bias.normal_()
    ours = nn.GroupNorm(num_groups=3, epsilon=1e-5).apply(
        {"params": common.group_norm(gn.state_dict(), "")}, x
    )
    assert_close(ours, to_nhwc(gn(nchw(x))), rtol=1e-5, atol=1e-5, what="GroupNorm")

    bn = torch.nn.BatchNorm2d(6)
    with torch.no_grad():
        (
            bn.weight.normal_(),
            bn.bias.normal_(),
            bn.running_mean.normal_(),
            bn.running_var.uniform_(0.5, 2),
        )
    bn.eval()
    params, stats = common.batch_norm(bn.state_dict(), "")
    ours = nn.BatchNorm(use_running_average=True, epsilon=1e-5).apply(
        {"params": params, "batch_stats": stats}, x
    )
    assert_close(ours, to_nhwc(bn(nchw(x))), rtol=1e-5, atol=1e-5, what="BatchNorm2d (eval)")

    emb = torch.nn.Embedding(7, 3)
    ids = np.array([[0, 6, 2]])
    ours = nn.Embed(7, 3).apply({"params": common.embedding(emb.state_dict(), "")}, ids)
    assert_close(ours, emb(torch.tensor(ids)).detach().numpy(), what="Embedding")


def test_load_state_dict_sources(tmp_path):
    layer = torch.nn.Linear(2, 2)
    expected = {k: v.numpy() for k, v in layer.state_dict().items()}
    torch.save({"state_dict": layer.state_dict()}, tmp_path / "wrapped.pt")
    save_file(layer.state_dict(), str(tmp_path / "w.safetensors"))
    for source in (
        layer,
        layer.state_dict(),
        tmp_path / "wrapped.pt",
        str(tmp_path / "w.safetensors"),
    ):
        loaded = common.load_state_dict(source)
        assert loaded.keys() == expected.keys()
        chex.assert_trees_all_equal(loaded, expected)
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        common.load_state_dict(tmp_path / "missing.pt")
    with pytest.raises(
        TypeError, match="expected a torch module, a mapping or a checkpoint path, got list"
    ):
        common.load_state_dict([1, 2])
    with pytest.raises(KeyError, match="state dict has no key 'fc.weight'"):
        common.linear({}, "fc")


def test_checkpoint_with_code_is_refused(tmp_path):
    path = write_pickle_that_runs_code(tmp_path / "bad.pth")
    with pytest.raises(pickle.UnpicklingError):
        common.load_state_dict(path)


# A two-layer model in torch naming: "layers.N.fc" Linear modules, a BatchNorm, a bare parameter.
TABLE = (
    (r"layers\.(\d+)\.fc", r"layer_\1/dense", common.linear),
    (r"norm", "norm", common.batch_norm),
    (r"scale", "scale", common.parameter),
)


def _torch_state():
    torch.manual_seed(0)
    modules = torch.nn.ModuleDict(
        {
            "layers": torch.nn.ModuleList(
                [torch.nn.ModuleDict({"fc": torch.nn.Linear(3, 4)}) for _ in range(2)]
            ),
            "norm": torch.nn.BatchNorm1d(4),
        }
    )
    state = dict(modules.state_dict())
    state["scale"] = torch.randn(4)
    return state


def test_apply_key_table_converts_every_key_by_its_row():
    state = _torch_state()
    variables = common.apply_key_table(state, TABLE, "toy", skip=r"num_batches_tracked$")
    expected = {
        "params": {
            "layer_0": {
                "dense": {
                    "kernel": state["layers.0.fc.weight"].numpy().T,
                    "bias": state["layers.0.fc.bias"].numpy(),
                }
            },
            "layer_1": {
                "dense": {
                    "kernel": state["layers.1.fc.weight"].numpy().T,
                    "bias": state["layers.1.fc.bias"].numpy(),
                }
            },
            "norm": {"scale": state["norm.weight"].numpy(), "bias": state["norm.bias"].numpy()},
            "scale": state["scale"].numpy(),
        },
        "batch_stats": {
            "norm": {
                "mean": state["norm.running_mean"].numpy(),
                "var": state["norm.running_var"].numpy(),
            }
        },
    }
    chex.assert_trees_all_close(variables, expected, rtol=0, atol=0)


def test_apply_key_table_refuses_keys_it_did_not_convert():
    state = _torch_state()
    with pytest.raises(
        ValueError, match=r"toy: keys not converted .*\['norm.num_batches_tracked'\]"
    ):
        common.apply_key_table(state, TABLE, "toy")
    state["layers.0.gate.weight"] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"\['layers.0.gate.weight'\]"):
        common.apply_key_table(state, TABLE, "toy", skip=r"num_batches_tracked$")


def test_to_numpy_copies_so_later_torch_updates_do_not_reach_converted_weights():
    layer = torch.nn.Linear(3, 2)
    params = common.linear(layer.state_dict(), "")
    before = params["kernel"].copy()
    with torch.no_grad():
        layer.weight.add_(1.0)  # an optimizer step on the PyTorch side, after conversion
    np.testing.assert_array_equal(params["kernel"], before)
    assert common.to_numpy(np.ones(2)).base is None


def test_export_with_key_table_inverts_apply_key_table_and_names_unmapped_parameters():
    table = (
        (r"blocks\.(\d+)\.attn\.(query|key)", r"blocks_\1/attn/\2", common.linear),
        (r"blocks\.(\d+)\.ln", r"blocks_\1/ln", common.layer_norm),
        (r"pos", "pos/table", common.parameter),
    )
    rng = np.random.default_rng(0)
    state = {
        **{
            f"blocks.{i}.attn.{n}.{leaf}": rng.normal(size=shape).astype(np.float32)
            for i in range(2)
            for n in ("query", "key")
            for leaf, shape in (("weight", (3, 4)), ("bias", (3,)))
        },
        **{
            f"blocks.{i}.ln.{leaf}": rng.normal(size=4).astype(np.float32)
            for i in range(2)
            for leaf in ("weight", "bias")
        },
        "pos": rng.normal(size=(1, 5, 4)).astype(np.float32),
    }
    params = common.apply_key_table(state, table, "test")["params"]
    exported = common.export_with_key_table(params, table, common.TO_TORCH, "test")
    assert sorted(exported) == sorted(state)
    for key, value in state.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    with pytest.raises(
        ValueError, match="no torch key for the Flax parameter blocks_0/extra/kernel"
    ):
        common.export_with_key_table(
            {**params, "blocks_0": {**params["blocks_0"], "extra": {"kernel": np.ones(2)}}},
            table,
            common.TO_TORCH,
            "test",
        )
