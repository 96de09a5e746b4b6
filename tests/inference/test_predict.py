"""attnjax/inference/predict.py, with docs/training.md's pretrained-ViT commands as written: a
random timm ViT saved with torch, converted by the command, made a run without training
(``num_train_steps=0``) on a folder of JPEGs, and run over a folder of new JPEGs of several
sizes. The CSV's probabilities are timm's own on the same files with timm's preprocessing."""

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

from attnjax.inference import predict

pytestmark = [
    # ml_collections' config_flags loads a config file as train.py does, with load_module.
    pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning"),
]

CLASSES = ("cat", "dog", "fox")
# Shorter side 40, the longer one 40 * long / short a whole number with an even surplus over 32:
# timm's Resize (which truncates) and center crop (which rounds) cut what attnjax's do.
PHOTO_SIZES = {"a.jpg": (40, 40), "b.jpg": (50, 40), "sub/c.jpg": (40, 50), "d.jpg": (60, 48)}
PHOTO_SIZES.update({"e.jpg": (64, 40), "f.jpg": (100, 80)})
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


def run(argv, cwd):
    env = {**os.environ, "XLA_FLAGS": xla_flags(), "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def predicted(tmp_path_factory, train_py):
    """The page's three commands run in a fresh folder -> what the test files check."""
    import torch

    home = tmp_path_factory.mktemp("pretrained")
    model = random_timm_vit(
        img_size=32, patch_size=8, embed_dim=128, depth=2, num_heads=2, num_classes=len(CLASSES)
    )
    torch.save(model.state_dict(), home / "vit.pth")
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
        command = command.replace("$IMAGES", str(home / "images"))
        argv = shlex.split(command.replace("$PHOTOS", str(home / "photos")))[1:]
        if argv[0] == "train.py":
            with contextlib.chdir(home):
                outputs["train"] = train_py(argv[1:] + TINY["train.py"])
        else:
            outputs[argv[1]] = run(argv + TINY.get(argv[1], []), home)
            assert outputs[argv[1]].returncode == 0, outputs[argv[1]].stderr
    return home, model, outputs


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


def test_the_pages_commands_predict_timms_probabilities_by_class_folder_name(predicted):
    home, model, outputs = predicted
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
        got = {row[f"label{s}"]: float(row[f"probability{s}"]) for s in ("", "_2", "_3")}
        assert sorted(got) == sorted(CLASSES)
        ranked = [float(row[f"probability{s}"]) for s in ("", "_2", "_3")]
        assert ranked == sorted(ranked, reverse=True)
        expected = timm_probabilities(model, home / "photos" / row["file"])
        assert_relative([got[name] for name in CLASSES], expected, 1e-5, what=row["file"])


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
