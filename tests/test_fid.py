"""``python -m attnjax.fid`` against pytorch-fid's ``calculate_fid_given_paths`` with the same
random Inception weights on two tiny folders, its statistics files, and its bad-input errors."""

import pathlib

import numpy as np
import pytest
from helpers import pytorch_fid_weights, random_fid_inception
from PIL import Image
from pytorch_fid import fid_score

from attnjax import fid

IMAGES = 5  # per folder: covariances of rank 4, singular at every depth, as pytorch-fid's are


@pytest.fixture(scope="module")
def setup(tmp_path_factory, inception_weights):
    """``{"weights": converted .npz, "a": folder, "b": folder, "state": torch state dict}``."""
    root = tmp_path_factory.mktemp("fid")
    state = random_fid_inception().state_dict()
    rng = np.random.default_rng(0)
    for name, high in (("a", 256), ("b", 160)):
        (root / name).mkdir()
        for i in range(IMAGES):
            pixels = rng.integers(0, high, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    names = {"weights": inception_weights["npz"], "a": root / "a", "b": root / "b"}
    return {**{key: str(path) for key, path in names.items()}, "state": state}


def _run(capsys, *args):
    code = fid.main(["--no-progress", *args])
    captured = capsys.readouterr()
    return code, captured.out.strip().splitlines(), captured.err


def _pytorch_fid(setup, dims):
    with pytorch_fid_weights(setup["state"]):
        return fid_score.calculate_fid_given_paths(
            [setup["a"], setup["b"]], batch_size=50, device="cpu", dims=dims, num_workers=0
        )


def test_the_fid_of_two_folders_equals_pytorch_fids(setup, capsys):
    """At 192 dims: the FID end to end. At 2048 the features and their statistics are checked
    against pytorch-fid below and in test_inception.py; a 2048 x 2048 matrix square root takes
    scipy 20-50 s on each side, so the 2048-dim FID of both tools is compared by
    benchmarks/fid_cpu.py instead."""
    extra = ["--metrics", "is,pr,kid", "--isc-splits", "2", "--kid-subset-size", "4"]
    code, lines, err = _run(
        capsys, "--inception", setup["weights"], setup["a"], setup["b"], "--dims", "192", *extra
    )
    assert code == 0, err
    assert lines[-1].startswith("FID: ")
    expected = _pytorch_fid(setup, 192)
    assert float(lines[-1].split()[-1]) == pytest.approx(expected, rel=1e-3)
    assert [line.split(":")[0] for line in lines] == ["IS", "precision", "recall", "KID", "FID"]
    assert all(0 <= float(line.split()[-1]) <= 1 for line in lines[1:3])


def test_saved_statistics_are_pytorch_fids_and_give_the_same_fid(setup, capsys, tmp_path):
    for dims, block in ((2048, 3), (192, 1)):
        out = str(tmp_path / f"a_stats_{dims}.npz")
        code, lines, err = _run(
            capsys, "--inception", setup["weights"], "--dims", str(dims), "--save-stats",
            setup["a"], out,
        )  # fmt: skip
        assert code == 0 and lines == [f"wrote {out}"], err
        mu, sigma = fid_score.compute_statistics_of_path(out, None, 50, dims, "cpu")
        assert mu.shape == (dims,) and sigma.shape == (dims, dims)
        with pytorch_fid_weights(setup["state"]):
            from pytorch_fid.inception import InceptionV3

            model = InceptionV3([block]).eval()
            files = sorted(str(p) for p in pathlib.Path(setup["a"]).glob("*.png"))
            theirs = fid_score.calculate_activation_statistics(files, model, 50, dims, "cpu", 0)
        capsys.readouterr()  # pytorch-fid prints a batch-size warning
        np.testing.assert_allclose(mu, theirs[0], rtol=1e-4, atol=1e-4 * np.abs(theirs[0]).max())
        scale = np.abs(theirs[1]).max()
        np.testing.assert_allclose(sigma, theirs[1], rtol=1e-3, atol=1e-4 * scale)
    code, lines, err = _run(capsys, "--dims", "192", out, out)
    assert code == 0 and float(lines[-1].split()[-1]) == pytest.approx(0.0, abs=1e-6), err

    before = open(out, "rb").read()
    code, lines, err = _run(
        capsys, "--inception", setup["weights"], "--save-stats", setup["b"], out
    )
    assert code == 2 and "exists" in err and err.count("\n") == 1
    assert open(out, "rb").read() == before


def test_bad_input_is_one_line_and_writes_nothing(setup, capsys, tmp_path):
    np.savez(tmp_path / "bad.npz", mean=np.zeros(3))
    weights = setup["weights"]
    cases = [
        (["--inception", weights, str(tmp_path / "missing"), setup["b"]], "missing"),
        (["--inception", weights, str(tmp_path / "bad.npz"), setup["b"]], "bad.npz"),
        (["--inception", weights, str(tmp_path), setup["b"]], "no image files"),
        ([setup["a"], setup["b"]], "--inception"),
        (["--inception", str(tmp_path / "none.npz"), setup["a"], setup["b"]], "none.npz"),
        (["--inception", weights, "--metrics", "fast", setup["a"], setup["b"]], "unknown"),
        (["--inception", weights, "--save-stats", setup["a"], str(tmp_path / "o.txt")], ".npz"),
    ]
    for args, expected in cases:
        code, lines, err = _run(capsys, *args)
        assert code == 2 and lines == [], (args, lines)
        assert err.startswith("python -m attnjax.fid: ") and err.count("\n") == 1, err
        assert expected in err, (expected, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz"]
