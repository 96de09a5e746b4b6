"""attnjax.models.weights_file: what save_variables writes, load_variables reads back checked."""

import jax
import numpy as np
import pytest

from attnjax.models import weights_file

TREE = {"params": {"conv": {"kernel": np.arange(24.0).reshape(2, 3, 4), "bias": np.ones(4)}}}
EXPECTED = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32), TREE)


def _load(path):
    return weights_file.load_variables(path, EXPECTED, what="Test weights", command="convert-me")


def test_round_trip_is_float32_and_equal(tmp_path):
    path = weights_file.save_variables(TREE, tmp_path / "w.npz")
    loaded = _load(path)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(TREE)):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)


def test_every_bad_file_is_named_in_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no file .*missing.npz.*convert-me"):
        _load(tmp_path / "missing.npz")
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(ValueError, match=r"text.npz'?: not a readable .npz"):
        _load(tmp_path / "text.npz")
    np.savez(tmp_path / "short.npz", **{"params/conv/kernel": np.zeros((2, 3, 4))})
    with pytest.raises(ValueError, match=r"missing \['params/conv/bias'\], unexpected \[\]"):
        _load(tmp_path / "short.npz")
    np.savez(
        tmp_path / "shape.npz",
        **{"params/conv/kernel": np.zeros((2, 3, 5)), "params/conv/bias": np.zeros(4)},
    )
    with pytest.raises(ValueError, match=r"params/conv/kernel has shape \(2, 3, 5\), expected"):
        _load(tmp_path / "shape.npz")
