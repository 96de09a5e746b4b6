"""docs/own_images.md: its commands, as written, on the digits written as a class tree of PNG
files without split folders (tiny models, 2 steps, an FID of few images): every stage trains,
samples are written, the FID is the samples' against exactly the files training held out, and the
folder is byte for byte what it was; the FID command on a flat folder of mixed-size JPEGs with no
size flag."""

import os
import re
import shlex

import numpy as np
import pytest
from helpers import ROOT, TINY_RUN_SCHEDULE, tiny_vit_flags, write_digits_class_tree
from PIL import Image

from attnjax import data, fid
from attnjax.data import folder, prepare
from attnjax.inference import generate
from attnjax.metrics import sources
from attnjax.metrics.statistics import frechet_distance, load_statistics
from attnjax.train import checkpoint

pytestmark = [
    pytest.mark.xdist_group("trained_runs"),
    # ml_collections' config_flags loads a config file as train.py does, with load_module.
    pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning"),
]

STEPS = 2
# Logged, evaluated and saved once, at the end.
SCHEDULE = [
    f"--config.{k}={v}"
    for k, v in dict(
        num_train_steps=STEPS,
        warmup_steps=1,
        log_every=STEPS,
        eval_every=STEPS,
        checkpoint_every=STEPS,
    ).items()
]
BATCHES = [f"--config.{k}={TINY_RUN_SCHEDULE[k]}" for k in ("batch_size", "eval_batch_size")]
# Images written; training holds out 10% of them, the FID's real images: Inception at 299 x 299
# on each is most of what the two FID commands cost.
IMAGES = 240
# What each command gets appended: tiny models, 2 steps, few samples.
TINY = {
    "configs/vit_folder.py": [*tiny_vit_flags(), *SCHEDULE],
    "configs/vqgan_folder.py": [
        *SCHEDULE,
        *BATCHES,
        "--config.model.ddconfig.ch=32",
        "--config.model.ddconfig.num_res_blocks=1",
        "--config.model.ddconfig.z_channels=8",
        "--config.model.n_embed=16",
        "--config.model.embed_dim=8",
    ],
    "configs/prior_folder.py": [
        *SCHEDULE,
        *BATCHES,
        "--config.model.n_layer=1",
        "--config.model.n_head=2",
        "--config.model.n_embd=16",
        "--config.sampling.top_k=8",  # of the tiny VQGAN's 16 codes
        "--config.sampling.per_class=2",
    ],
    "attnjax.fid": ["--dims=64", "--no-progress"],
    "attnjax.inference.generate": ["--dims=64", "--number=16"],
}


def page_commands():
    """The ``python ...`` commands of the page's code blocks, continuation lines joined."""
    with open(os.path.join(ROOT, "docs", "own_images.md")) as page:
        blocks = re.findall(r"```\n(.*?)```", page.read(), flags=re.S)
    return [
        line
        for block in blocks
        for line in block.replace("\\\n", " ").splitlines()
        if line.startswith("python ")
    ]


def snapshot(root):
    return {
        path: (path.read_bytes(), path.stat().st_mtime_ns)
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


class MeasuredSources:
    """``fid.measure`` recording each image source it measured and the Gaussian it returned."""

    def __init__(self, measure):
        self.measure, self.calls = measure, []

    def __call__(self, source, *args, **kwargs):
        result = self.measure(source, *args, **kwargs)
        self.calls.append((source, result[0]))
        return result


def test_the_pages_commands_train_every_stage_sample_and_print_an_fid(
    digits_dir, inception_weights, tmp_path, capsys, monkeypatch, train_py
):
    images = write_digits_class_tree(digits_dir, tmp_path / "digits_png", IMAGES)
    before = snapshot(tmp_path / "digits_png")
    monkeypatch.chdir(tmp_path)
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    measured = MeasuredSources(fid.measure)
    monkeypatch.setattr(fid, "measure", measured)
    commands = page_commands()
    assert [c.split()[1:3] for c in commands] == [
        ["train.py", "--config"],
        ["train.py", "--config"],
        ["train.py", "--config"],
        ["-m", "attnjax.inference.generate"],
        ["-m", "attnjax.fid"],
        ["-m", "attnjax.data.prepare"],
    ]
    for command in commands:
        argv = shlex.split(command.replace("$IMAGES", images))[1:]
        argv = [inception_weights["npz"] if a == "inception.npz" else a for a in argv]
        if argv[0] == "train.py":
            metrics = train_py(argv[1:] + TINY[argv[2]])
            assert metrics["step"] == STEPS
        elif argv[1] == "attnjax.inference.generate":
            assert os.path.isfile(generate.main(argv[2:] + TINY[argv[1]]))
        elif argv[1] == "attnjax.fid":
            assert fid.main(argv[2:] + TINY[argv[1]]) == 0
            last = capsys.readouterr().out.splitlines()[-1]
            assert re.fullmatch(r"FID: \d+\.\d+(e[-+]\d+)?", last), last
            printed = float(last.split()[-1])
        else:
            assert prepare.main(argv[2:]) == 0
    assert os.path.isfile(tmp_path / "runs" / "own" / "samples.png")
    assert snapshot(tmp_path / "digits_png") == before

    # The FID's real images are the VQGAN's eval split, image for image: the held-out files.
    vqgan_data = checkpoint.read_config(str(tmp_path / "runs" / "own" / "vqgan")).data
    held_out = data.eval_images(vqgan_data, vqgan_data.eval_split)[0]
    assert 0 < len(held_out) < IMAGES / 5
    ((real, gaussian),) = measured.calls  # the samples are statistics, the real side images
    assert len(real) == len(held_out)
    np.testing.assert_array_equal(
        np.concatenate(list(real.batches(64))), held_out / np.float32(255)
    )
    mu, sigma = load_statistics(tmp_path / "runs" / "own" / "samples.npz")
    np.testing.assert_allclose(printed, frechet_distance(mu, sigma, *gaussian), rtol=1e-12)


def test_the_fid_of_a_flat_folder_of_mixed_size_photos_reads_the_held_out_split(
    inception_weights, tmp_path, capsys, np_rng
):
    """No size flag: each photo's central square at 299 (the Inception's input); the held-out
    split is the files training holds out."""
    photos = tmp_path / "photos"
    photos.mkdir()
    names = [f"photo_{i:03d}.jpg" for i in range(100)]
    held = [n for n in names if folder.held_out_share(n, folder.HOLDOUT_SEED) < 0.1][:3]
    kept = [n for n in names if n not in held][:3]
    for i, name in enumerate(held + kept):
        size = (12 + 5 * i, 9 + 3 * i)
        Image.fromarray(np_rng.integers(0, 256, (*size, 3), np.uint8)).save(photos / name)
    listed = folder.list_splits("folder", str(photos), folder.SPLITS, fraction=0.1)
    assert sorted(os.path.basename(p) for p in listed["test"].paths) == sorted(held)
    split = sources.open_source(f"folder:{photos}:test", image_size=fid.IMAGE_SIZE)
    assert sorted(path for path, _ in split.items) == sorted(listed["test"].paths)

    argv = ["--inception", inception_weights["npz"], "--dims=64", "--no-progress"]
    assert fid.main([*argv, f"folder:{photos}:test", f"folder:{photos}:train"]) == 0
    assert re.fullmatch(r"FID: \d+\.\d+(e[-+]\d+)?", capsys.readouterr().out.splitlines()[-1])
    assert fid.main([*argv, f"folder:{photos}:validation", f"folder:{photos}:train"]) == 2
    error = capsys.readouterr().err
    assert "'validation'" in error and "'test'" in error and str(photos) in error
    assert error.count("\n") == 1
