"""attnjax/inference/predict.py, with docs/training.md's pretrained-ViT commands as written: a
random timm ViT saved with torch (or written as a Google ``.npz``), converted by the command, made
a run without training (``num_train_steps=0``) on a folder of JPEGs, and run over a folder of new
JPEGs of several sizes on one CPU device and on eight. The CSV's probabilities are timm's own on
the same files with timm's preprocessing (for the ``.npz``, the model timm's own ``.npz`` reader
builds)."""

import contextlib
import csv
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, assert_relative, random_timm_vit, xla_flags
from PIL import Image

from attnjax.convert.google_npz import save_google_npz
from attnjax.convert.timm import vit_from_timm
from attnjax.inference import predict

pytestmark = [
    # ml_collections' config_flags loads a config file as train.py does, with load_module.
    pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning"),
]

CLASSES = ("cat", "dog", "fox")
# Shorter side 40, the longer one 40 * long / short a whole number with an even surplus over 32:
# timm's Resize (which truncates) and center crop (which rounds) cut what attnjax's do.
PHOTO_SIZES = {"a.jpg": (40, 40), "b.jpg": (50, 40), "sub/c.jpg": (40, 50), "d.jpg": (60, 48)}
PHOTO_SIZES.update({"e.jpg": (64, 40), "f.jpg": (100, 80), "g.jpg": (40, 40)})
PHOTO_SIZES.update({"i.jpg": (80, 100), "sub/h.jpg": (48, 60)})
# The CSV's column suffixes of the top classes under --top-k 3.
RANKS = ("", "_2", "_3")
# The random timm ViT of both weight files: 64-dimensional heads, as the converter assumes.
TIMM_VIT = dict(img_size=32, patch_size=8, embed_dim=128, depth=2, num_heads=2, num_classes=3)
# What each command gets appended: tiny batches; timm's crop_pct 0.8 (a resize to 40, then 32).
TINY = {
    "train.py": [
        "--config.batch_size=2",
        "--config.eval_batch_size=4",
        "--config.data.crop_fraction=0.8",
        "--config.data.read_threads=0",
    ],
    "attnjax.inference.predict": ["--batch-size", "4"],
}


def page_commands():
    """The ``python ...`` commands of docs/training.md's pretrained-ViT section."""
    with open(os.path.join(ROOT, "docs", "training.md")) as page:
        section = page.read().split("## A pretrained ViT on your images", 1)[1].split("\n## ")[0]
    block = re.findall(r"```\n(.*?)```", section, flags=re.S)[0]
    return [line for line in block.replace("\\\n", " ").splitlines() if line.startswith("python")]


def write_jpeg(path, size, seed):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8)
    Image.fromarray(pixels).save(path, quality=95)


def run(argv, cwd, devices=1):
    env = {**os.environ, "XLA_FLAGS": xla_flags(devices), "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def run_the_page(home, weights, train_py):
    """The page's three commands run in ``home`` with the converter reading ``weights`` (a file
    in ``home``) -> ``{"train": final metrics, module: finished subprocess}``."""
    for split, count in (("train", 2), ("test", 1)):
        for c, name in enumerate(CLASSES):
            for i in range(count):
                write_jpeg(str(home / "images" / split / name / f"{i}.jpg"), (48, 40), 10 * c + i)
    for seed, (name, size) in enumerate(PHOTO_SIZES.items()):
        write_jpeg(str(home / "photos" / name), size, 100 + seed)
    (home / "photos" / "bad.jpg").write_bytes(b"not a jpeg at all")
    os.symlink(os.path.join(ROOT, "configs"), home / "configs")

    outputs = {}
    for command in page_commands():
        command = command.replace("$IMAGES", str(home / "images")).replace(
            " vit.pth ", f" {weights} "
        )
        argv = shlex.split(command.replace("$PHOTOS", str(home / "photos")))[1:]
        if argv[0] == "train.py":
            with contextlib.chdir(home):
                outputs["train"] = train_py(argv[1:] + TINY["train.py"])
        else:
            outputs[argv[1]] = run(argv + TINY.get(argv[1], []), home)
            assert outputs[argv[1]].returncode == 0, outputs[argv[1]].stderr
    return outputs


@pytest.fixture(scope="module")
def predicted(tmp_path_factory, train_py):
    """The page's commands on a random timm ViT saved with torch -> ``(home, timm model,
    outputs)``."""
    import torch

    home = tmp_path_factory.mktemp("pretrained")
    model = random_timm_vit(**TIMM_VIT)
    torch.save(model.state_dict(), home / "vit.pth")
    return home, model, run_the_page(home, "vit.pth", train_py)


@pytest.fixture(scope="module")
def predicted_from_google_npz(tmp_path_factory, train_py):
    """The page's commands on a random ViT written as a Google ``.npz`` -> ``(home, the timm
    model timm's own .npz reader makes of the file, outputs)``."""
    from timm.models import vision_transformer as timm_vit

    home = tmp_path_factory.mktemp("google_npz")
    model, variables = vit_from_timm(random_timm_vit(seed=1, **TIMM_VIT))
    save_google_npz(home / "google.npz", model, variables)
    reference = random_timm_vit(seed=2, **TIMM_VIT)
    timm_vit._load_weights(reference, str(home / "google.npz"))
    return home, reference.eval(), run_the_page(home, "google.npz", train_py)


def timm_probabilities(model, path):
    import torch
    from timm.data import create_transform

    transform = create_transform(
        input_size=32, crop_pct=0.8, interpolation="bilinear", mean=(0.5,) * 3, std=(0.5,) * 3
    )
    with Image.open(path) as image:
        batch = transform(image.convert("RGB"))[None]
    with torch.no_grad():
        return torch.softmax(model(batch), -1)[0].numpy()


def read_csv(path):
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def assert_the_page_predicts_timms_probabilities(home, model, outputs):
    assert [c.split()[1:3] for c in page_commands()] == [
        ["-m", "attnjax.convert.vit_checkpoint"],
        ["train.py", "--config"],
        ["-m", "attnjax.inference.predict"],
    ]
    assert outputs["train"]["step"] == 0
    assert os.listdir(home / "runs" / "pretrained" / "checkpoints") == ["0"]
    rows = read_csv(home / "predictions.csv")
    assert [row["file"] for row in rows] == sorted(PHOTO_SIZES)
    assert list(rows[0]) == ["file", "label", "probability"] + [
        f"{kind}_{k}" for k in (2, 3) for kind in ("label", "probability")
    ]
    for row in rows:
        got = {row[f"label{s}"]: float(row[f"probability{s}"]) for s in RANKS}
        assert sorted(got) == sorted(CLASSES)
        ranked = [float(row[f"probability{s}"]) for s in RANKS]
        assert ranked == sorted(ranked, reverse=True)
        expected = timm_probabilities(model, home / "photos" / row["file"])
        assert_relative([got[name] for name in CLASSES], expected, 1e-5, what=row["file"])


def test_the_pages_commands_predict_timms_probabilities_by_class_folder_name(predicted):
    assert_the_page_predicts_timms_probabilities(*predicted)


def test_a_google_npz_through_the_pages_commands_predicts_timms_probabilities(
    predicted_from_google_npz,
):
    assert_the_page_predicts_timms_probabilities(*predicted_from_google_npz)


def test_eight_devices_split_each_batch_and_predict_what_one_device_does(predicted):
    """9 images and a bad file in batches of 4 rounded up to 8: the first batch holds 7 images
    (the bad file skipped) and the second 2, each padded to 8, one row per device."""
    home, _, outputs = predicted
    argv = outputs["attnjax.inference.predict"].args[1:]
    argv[argv.index("--out") + 1] = "eight_devices.csv"
    eight = run(argv, home, devices=8)
    assert eight.returncode == 0, eight.stderr
    assert (
        "--batch-size 4: rounded up to 8, a multiple of the 8 devices each batch is split over"
        in eight.stderr.splitlines()
    )
    one, split = read_csv(home / "predictions.csv"), read_csv(home / "eight_devices.csv")
    assert [row["file"] for row in split] == [row["file"] for row in one]
    for a, b in zip(one, split):
        assert [a[f"label{s}"] for s in RANKS] == [b[f"label{s}"] for s in RANKS]
        np.testing.assert_allclose(
            [float(b[f"probability{s}"]) for s in RANKS],
            [float(a[f"probability{s}"]) for s in RANKS],
            rtol=0,
            atol=1e-6,
            err_msg=a["file"],
        )


def test_a_bad_file_is_reported_in_one_line_and_skipped_or_stops_with_no_csv(predicted, tmp_path):
    home, _, outputs = predicted
    reported = [
        line
        for line in outputs["attnjax.inference.predict"].stderr.splitlines()
        if "bad.jpg" in line
    ]
    assert len(reported) == 1 and reported[0].startswith("skipped: ")
    out = tmp_path / "stopped.csv"
    argv = ["--workdir", str(home / "runs" / "pretrained"), f"folder:{home / 'photos'}"]
    with pytest.raises(SystemExit) as stopped:
        predict.main([*argv, "--out", str(out), "--on-bad-file", "stop"])
    assert re.fullmatch(r"error: '.*bad\.jpg' is not an image .*", stopped.value.code)
    assert os.listdir(tmp_path) == []


def test_a_missing_workdir_or_an_existing_out_is_one_line_and_overwrites_nothing(
    predicted, tmp_path
):
    home, _, _ = predicted
    out = tmp_path / "kept.csv"
    out.write_text("keep me")
    photos = f"folder:{home / 'photos'}"
    cases = [
        (
            ["--workdir", str(tmp_path / "nowhere"), photos, "--out", str(tmp_path / "new.csv")],
            r"error: --workdir '.*nowhere': no such folder; expected a trained run",
        ),
        (
            ["--workdir", str(home / "runs" / "pretrained"), photos, "--out", str(out)],
            r"error: --out '.*kept\.csv' exists; not overwriting it without --overwrite",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as refused:
            predict.main(argv)
        assert re.fullmatch(message, refused.value.code)
    assert out.read_text() == "keep me" and sorted(os.listdir(tmp_path)) == ["kept.csv"]
