"""attnjax/inference/generate.py: the sampling command's three modes, its PNGs and its refusals."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import ROOT
from PIL import Image

from attnjax import data
from attnjax.data.images import image_grid
from attnjax.inference import generate
from attnjax.tasks import prior as prior_task
from attnjax.train import checkpoint

# One worker reads the trained runs, so that no other waits for them to be trained.
pytestmark = pytest.mark.xdist_group("trained_runs")


@pytest.fixture
def prior_workdir(trained_runs):
    return trained_runs["prior"]


def read_png(path):
    return np.asarray(Image.open(path))


def test_class_samples_equal_the_tasks_sampler(prior_workdir, tmp_path):
    out = str(tmp_path / "threes.png")
    assert (
        generate.main(
            [
                "--workdir",
                prior_workdir,
                "--class",
                "3",
                "--number",
                "5",
                "--temperature",
                "0.7",
                "--top_k",
                "8",
                "--seed",
                "4",
                "--out",
                out,
            ]
        )
        == out
    )
    config, params = checkpoint.read_config(prior_workdir), checkpoint.load(prior_workdir)[1]
    vqgan = prior_task.load_vqgan(config.vqgan_workdir)
    _, expected = prior_task.sample_images(
        prior_task.create_model(config),
        params,
        vqgan.model,
        vqgan.variables,
        np.full((5,), 3, np.int32),
        jax.random.key(4),
        grid_shape=vqgan.grid_shape,
        codebook_size=vqgan.model.n_embed,
        num_classes=10,
        temperature=0.7,
        top_k=8,
        guidance=config.sampling.guidance,
        mean=0.5,
        std=0.5,
    )
    scale = config.sampling.png_scale
    expected_png = image_grid(expected, 5).repeat(scale, 0).repeat(scale, 1)[..., 0]
    # One grey level of rounding at most where the two float paths land on either side of .5.
    assert np.abs(read_png(out).astype(int) - expected_png.astype(int)).max() <= 1


def test_on_a_mesh_the_same_png(prior_workdir, tmp_path):
    # --mesh's path (parameters placed by the prior's rules, the sampler under on_mesh) on this
    # process's device; tests/models/test_sampling_sharded.py splits a prior over eight.
    flags = ["--workdir", prior_workdir, "--class", "3", "--number", "4", "--seed", "4"]
    plain = generate.main([*flags, "--out", str(tmp_path / "plain.png")])
    on_mesh = generate.main([*flags, "--mesh", "model=1", "--out", str(tmp_path / "mesh.png")])
    np.testing.assert_array_equal(read_png(on_mesh), read_png(plain))
    with pytest.raises(ValueError, match="--mesh must be axis=size pairs"):
        generate.parse_mesh("model:2")
    too_many = jax.device_count() + 1
    with pytest.raises(ValueError, match=f"--mesh model={too_many} needs {too_many} devices"):
        generate.parse_mesh(f"model={too_many}")


def test_sliding_window_grid_and_completion_pngs(prior_workdir, tmp_path, digits_dir):
    scale = checkpoint.read_config(prior_workdir).sampling.png_scale
    wide = generate.main(
        [
            "--workdir",
            prior_workdir,
            "--grid",
            "4x7",
            "--class",
            "1",
            "--number",
            "2",
            "--out",
            str(tmp_path / "wide.png"),
        ]
    )
    # 4x7 codes at f=2 -> 8x14 pixels; two in a row with one-pixel borders.
    assert read_png(wide).shape == (scale * (8 + 2), scale * (2 * 15 + 1))

    completion = generate.main(
        [
            "--workdir",
            prior_workdir,
            "--complete",
            "3",
            "--rows",
            "2",
            "--out",
            str(tmp_path / "completion.png"),
        ]
    )
    picture = read_png(completion)
    assert picture.shape == (scale * (3 * 9 + 1), scale * (3 * 9 + 1))
    # The first row shows the first held-out digits themselves, resized to 8x8 independently here.
    test = data.load_source("digits", "test", digits_dir)
    originals = np.stack([data.resize(np.asarray(test[i]["image"]), 8) for i in range(3)])
    first_row = image_grid(originals / 255.0, 3)[:10].repeat(scale, 0).repeat(scale, 1)[..., 0]
    np.testing.assert_array_equal(picture[: 10 * scale], first_row)
    # The kept-rows picture is grey below the kept half (2 of 4 code rows = 4 of 8 pixel rows).
    kept_bottom = picture[scale * (9 + 1 + 4) : scale * (9 + 1 + 8), scale : scale * 9]
    assert np.all(kept_bottom == 128)


def test_completion_of_the_first_held_out_images_with_their_labels(prior_workdir):
    run = generate.load_prior(prior_workdir)
    settings = generate.sampling_settings(run, temperature=1.0)
    result = generate.complete_test_images(run, 4, 2, jax.random.key(0), **settings)
    images, _, labels = prior_task.first_codes(run.vqgan, 4)
    np.testing.assert_array_equal(result["labels"], labels)
    np.testing.assert_allclose(result["originals"], images * 0.5 + 0.5, rtol=1e-6)
    assert result["completions"].shape == result["originals"].shape == (4, 8, 8, 1)
    assert not np.allclose(result["completions"], result["kept"])


def test_refuses_to_overwrite_and_reports_bad_values_in_one_line(prior_workdir, tmp_path, capsys):
    out = tmp_path / "generate.png"
    out.write_bytes(b"keep me")
    command = [
        sys.executable,
        "-m",
        "attnjax.inference.generate",
        "--workdir",
        prior_workdir,
        "--number",
        "1",
        "--out",
        str(out),
    ]
    refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode != 0
    assert (
        refused.stderr.strip().splitlines()[-1].startswith("error: ")
        and "--force" in refused.stderr
    )
    assert out.read_bytes() == b"keep me"
    # The same command with --force, in this process: its sampler is compiled here already.
    assert generate.main([*command[3:], "--force"]) == str(out)
    assert f"wrote {out}" in capsys.readouterr().out and read_png(out).ndim == 2

    bad = [
        (["--grid", "4by8"], "--grid must be HxW"),
        (["--grid", "3x8"], "--grid 3x8 must be at least the trained grid 4x4"),
        (["--class", "10"], r"--class must be in \[0, 9\]"),
        (["--number", "0"], "--number must be >= 1, got 0"),
        (["--top_p", "1.5"], r"top_p must be in \(0, 1\]"),
        (["--complete", "2", "--rows", "4"], r"--rows must be in \[1, 3\]"),
        (["--grid", "4x8", "--complete", "2"], "separate modes"),
        (["--inception", "w.npz"], "are for --save-stats"),
        (["--save-stats", str(tmp_path / "s.txt"), "--inception", "w.npz"], "must end in .npz"),
        (["--save-stats", str(out) + ".npz"], "needs one network"),
        (["--save-stats", "s.npz", "--inception", "w.npz", "--classifier", "r"], "one network"),
        (["--save-stats", "s.npz", "--inception", "w.npz", "--dims", "100"], "--dims 100"),
    ]
    for flags, message in bad:
        with pytest.raises(ValueError, match=message):
            generate.run_command(
                generate.parse_args(
                    ["--workdir", prior_workdir, "--out", str(tmp_path / "new.png")] + flags
                )
            )
    assert not os.path.exists(tmp_path / "new.png")


def test_save_stats_writes_pytorch_fids_statistics_of_the_samples(
    prior_workdir, inception_weights, tmp_path
):
    """``--save-stats`` on random Inception weights: the mean and covariance of pytorch-fid's
    features of the samples the PNG shows, in a file its ``fid_score`` reads."""
    import torch
    from helpers import pytorch_fid_statistics
    from pytorch_fid import fid_score

    stats, png = str(tmp_path / "samples.npz"), str(tmp_path / "samples.png")
    args = ["--workdir", prior_workdir, "--number", "2", "--seed", "1", "--out", png]
    inception = ["--inception", inception_weights["npz"], "--dims", "64"]
    assert generate.main([*args, "--save-stats", stats, *inception]) == png
    mu, sigma = fid_score.compute_statistics_of_path(stats, None, 50, 64, "cpu")

    run = generate.load_prior(prior_workdir)
    labels = np.repeat(np.arange(10, dtype=np.int32), 2)
    settings = generate.sampling_settings(run)
    codes = generate.sample_codes(run, labels, jax.random.key(1), number=2, **settings)
    samples = np.clip(generate.decode(run, codes), 0, 1)
    state = torch.load(inception_weights["pth"], weights_only=True)
    expected_mu, expected_sigma = pytorch_fid_statistics(state, samples, 64)
    np.testing.assert_allclose(mu, expected_mu, rtol=1e-4, atol=1e-4 * np.abs(expected_mu).max())
    scale = np.abs(expected_sigma).max()
    np.testing.assert_allclose(sigma, expected_sigma, rtol=1e-3, atol=1e-4 * scale)

    before, again = open(stats, "rb").read(), str(tmp_path / "again.png")
    with pytest.raises(ValueError, match="exists; not overwriting"):
        generate.run_command(
            generate.parse_args([*args[:-1], again, "--save-stats", stats, *inception])
        )
    assert open(stats, "rb").read() == before and not os.path.exists(again)
