"""pytorch-fid's Inception state dict -> the Flax Inception: every tensor lands where the key
table says, the command writes what ``load_variables`` reads, and bad input is one line."""

import numpy as np
import pytest
import torch
from helpers import random_fid_inception, write_pickle_that_runs_code

from attnjax.convert import inception as convert
from attnjax.models import inception


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("inception") / "pt_inception.pth"
    torch.save(random_fid_inception().state_dict(), path)
    return path


def test_every_tensor_is_converted_to_its_flax_place(weights):
    state = torch.load(weights, weights_only=True)
    variables = convert.inception_from_torch(weights)
    params, stats = variables["params"], variables["batch_stats"]
    np.testing.assert_array_equal(
        params["Mixed_6b"]["branch7x7_2"]["conv"]["kernel"],
        state["Mixed_6b.branch7x7_2.conv.weight"].numpy().transpose(2, 3, 1, 0),
    )
    np.testing.assert_array_equal(
        stats["Conv2d_1a_3x3"]["bn"]["var"], state["Conv2d_1a_3x3.bn.running_var"].numpy()
    )
    np.testing.assert_array_equal(params["fc"]["kernel"], state["fc.weight"].numpy().T)
    converted = sum(np.size(leaf) for part in variables.values() for leaf in _leaves(part))
    weights_in_state = sum(v.numel() for k, v in state.items() if "num_batches" not in k)
    assert converted == weights_in_state


def test_the_command_writes_what_load_variables_reads_and_keeps_an_existing_out(
    weights, tmp_path, capsys
):
    out = tmp_path / "inception.npz"
    assert convert.main([str(weights), str(out)]) == 0
    loaded = inception.load_variables(out)
    state = torch.load(weights, weights_only=True)
    np.testing.assert_array_equal(
        loaded["params"]["Mixed_7c"]["branch_pool"]["conv"]["kernel"],
        state["Mixed_7c.branch_pool.conv.weight"].numpy().transpose(2, 3, 1, 0),
    )
    before = out.read_bytes()
    capsys.readouterr()
    assert convert.main([str(weights), str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert out.read_bytes() == before


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    pickle = write_pickle_that_runs_code(tmp_path / "evil.pth")
    other = tmp_path / "other.pth"
    torch.save({"features.0.weight": torch.zeros(3)}, other)
    cases = {
        "missing": (tmp_path / "missing.pth", "no weights file"),
        "code": (pickle, "Weights only load failed"),
        "other": (other, "not converted"),
    }
    for name, (path, expected) in cases.items():
        out = tmp_path / f"{name}.npz"
        assert convert.main([str(path), str(out)]) == 2, name
        captured = capsys.readouterr()
        assert "arbitrary code ran" not in captured.out
        assert captured.err.startswith("python -m attnjax.convert.inception: "), captured.err
        assert captured.err.count("\n") == 1 and expected in captured.err, captured.err
        assert not out.exists()


def _leaves(tree):
    for value in tree.values():
        yield from _leaves(value) if isinstance(value, dict) else [value]
