"""attnjax/data/folder.py, files.py, sources.py: folders of images and file lists read as the
embedded digits are read, batch for batch; the folder layouts and their held-out split."""

import functools
import os

import jax
import numpy as np
import pytest
from helpers import load_config, tiny_vit
from PIL import Image

from attnjax import data
from attnjax.data import folder
from attnjax.tasks import classification


def _configs(digits_dir, digits_folder):
    """The tiny ViT on the embedded digits and on their folder of PNG files."""
    embedded = tiny_vit(load_config("vit_digits"))
    embedded.data.data_dir = digits_dir
    files = tiny_vit(load_config("vit_digits"))
    files.data.name = f"folder:{digits_folder}"
    return embedded, files


@pytest.fixture(scope="module")
def digits_datasets(digits_dir, digits_folder):
    """``(config, embedded Datasets, folder Datasets)``."""
    embedded, files = _configs(digits_dir, digits_folder)
    return embedded, data.make_datasets(embedded), data.make_datasets(files)


def test_the_digits_folder_gives_the_embedded_batches(digits_datasets):
    """The first 20 train batches (random shifts included) and every eval batch equal, pixels
    and labels."""
    _, embedded, files = digits_datasets
    assert (files.num_train_examples, files.num_eval_examples) == (1437, 360)
    ours, theirs = data.make_iterator(files.train), data.make_iterator(embedded.train)
    for _ in range(20):
        got, want = next(ours), next(theirs)
        np.testing.assert_array_equal(got["image"], want["image"])
        np.testing.assert_array_equal(got["label"], want["label"])
    for got, want in zip(data.make_iterator(files.eval), data.make_iterator(embedded.eval)):
        for key in ("image", "label", "mask"):
            np.testing.assert_array_equal(got[key], want[key])


def test_the_digits_folder_trains_to_the_embedded_losses(digits_datasets):
    """20 steps of the tiny ViT from the same initial state, one compiled step for both
    streams: the folder's losses are the embedded digits' losses."""
    config, embedded, files = digits_datasets
    model = classification.create_model(config)
    step = jax.jit(functools.partial(classification.train_step, config=config, model=model))
    init_rng, train_rng = jax.random.split(jax.random.PRNGKey(config.seed))

    def losses(train):
        batches = data.make_iterator(train)
        first = next(batches)
        state = classification.create_train_state(init_rng, config, model, first)
        result = []
        for i in range(20):
            batch = first if i == 0 else next(batches)
            state, metrics = step(state, batch, jax.random.fold_in(train_rng, i))
            result.append(float(metrics["loss"]))
        return result

    want = losses(embedded.train)
    assert len(set(want)) > 1  # it trains: the losses move
    np.testing.assert_array_equal(losses(files.train), want)


def _image(path, size=(6, 4), value=0):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", size, (value, value, value)).save(path)


def _truncated_image(path):
    noise = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(noise).save(path)
    path.write_bytes(path.read_bytes()[:-500])


def test_a_class_tree_holds_out_a_fixed_share_that_adding_files_never_moves(tmp_path):
    for c in ("cat", "dog"):
        for i in range(40):
            _image(tmp_path / c / f"{i:03d}.png")
    first = folder.list_splits("folder", str(tmp_path), ("train", "test"), fraction=0.25, seed=3)
    assert first["train"].classes == first["test"].classes == ("cat", "dog")
    held = set(first["test"].names)
    assert held.isdisjoint(first["train"].names) and len(held) + len(first["train"].names) == 80
    # The reference: the files whose hash of (seed, path) is below the fraction.
    expected = {
        f"{c}/{i:03d}.png"
        for c in ("cat", "dog")
        for i in range(40)
        if folder.held_out_share(f"{c}/{i:03d}.png", 3) < 0.25
    }
    assert held == expected and 10 <= len(held) <= 30
    for name, label in zip(first["test"].names, first["test"].labels):
        assert first["test"].classes[label] == name.split("/")[0]

    for i in range(40, 80):
        _image(tmp_path / "dog" / f"{i:03d}.png")
    _image(tmp_path / "emu" / "000.png")
    again = folder.list_splits("folder", str(tmp_path), ("train", "test"), fraction=0.25, seed=3)
    old = {n for n in again["test"].names if not n.startswith("emu") and int(n[4:7]) < 40}
    assert old == held
    assert again["train"].classes == ("cat", "dog", "emu")


def test_flat_folders_file_lists_and_split_folders(tmp_path):
    for i in range(10):
        _image(tmp_path / "flat" / f"{i}.jpg")
    flat = folder.list_splits("folder", str(tmp_path / "flat"), ("train", "test"), fraction=0.5)
    assert flat["train"].classes == () and not flat["train"].labels.any()
    assert sorted(flat["train"].names + flat["test"].names) == [f"{i}.jpg" for i in range(10)]

    lists = tmp_path / "lists"
    for split, rows in (("train", ["a/1.png\tb", "a/2.png\ta"]), ("val", ["3.png\ta", "4.png\tb"])):
        for row in rows:
            _image(lists / row.split("\t")[0])
        (lists / f"{split}.txt").write_text("# images\n" + "\n".join(rows) + "\n")
    listed = folder.list_splits("filelist", f"{lists}/{{split}}.txt", ("train", "val"))
    assert listed["train"].names == ["a/1.png", "a/2.png"]  # the list's order
    assert listed["train"].labels.tolist() == [1, 0] and listed["val"].labels.tolist() == [0, 1]
    assert listed["val"].paths[0] == os.path.join(lists, "3.png")

    config = load_config("vqgan_folder")
    config.data.update(name=f"filelist:{lists}/{{split}}.txt", eval_split="val", image_size=4)
    source = data.open_split(config.data, "val")
    image = source[1]["image"]
    assert image.shape == (4, 6, 3) and source[1]["label"] == 1


def _assert_one_line(error, *parts):
    message = str(error.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, message


def _folder_config(name, **fields):
    config = load_config("vqgan_folder")
    config.data.update(name=name, image_size=4, **fields)
    return config


@pytest.mark.parametrize(
    "layout, part",
    [
        ("empty", "holds no image files"),
        ("empty_split", "holds no image files"),
        ("missing_class", "has no images of class 'b'"),
        ("not_an_image", "is not an image"),
        ("truncated", "is truncated or damaged"),
        ("unreadable", "cannot be read"),
        ("too_small", "is 3x3, smaller than the 4-pixel shorter side"),
    ],
)
def test_bad_input_is_one_line_naming_the_file_before_training(tmp_path, layout, part):
    root = tmp_path / layout
    for split in ("train", "test"):
        for c in ("a", "b"):
            _image(root / split / c / "0.png")
    culprit = {
        "empty_split": root / "test",
        "missing_class": root / "test",
        "not_an_image": root / "train" / "a" / "1.png",
        "truncated": root / "train" / "a" / "1.png",
        "unreadable": root / "train" / "a" / "1.png",
        "too_small": root / "train" / "a" / "1.png",
    }.get(layout, root)
    if layout in ("empty", "empty_split", "missing_class"):
        for path in sorted(culprit.rglob("b/*.png" if layout == "missing_class" else "*.png")):
            path.unlink()
    if layout == "not_an_image":
        culprit.write_text("not a picture")
    if layout == "truncated":
        _truncated_image(culprit)
    if layout == "unreadable":
        culprit.symlink_to(tmp_path / "gone.png")
    if layout == "too_small":
        _image(culprit, size=(3, 3))
    config = _folder_config(f"folder:{root}")
    config.batch_size = 2
    with pytest.raises(ValueError) as error:
        # A truncated file has a whole header: it is found when decoded (here, as the records
        # are kept in memory), or at start-up with skip_unreadable.
        next(data.make_iterator(data.make_datasets(config).train))
    _assert_one_line(error, part, str(culprit))


def test_skip_unreadable_counts_the_bad_files_at_start_up_and_in_the_metrics(tmp_path):
    from attnjax.tasks import classification

    for split in ("train", "test"):
        for i in range(4):
            _image(tmp_path / split / f"{i}.png", value=40 * i)
    (tmp_path / "train" / "1.png").write_text("not a picture")
    _truncated_image(tmp_path / "train" / "2.png")
    config = _folder_config(f"folder:{tmp_path}", skip_unreadable=True)
    config.batch_size = 2
    datasets = data.make_datasets(config)
    assert datasets.num_train_examples == 2 and data.unreadable_count(config.data) == 2
    assert classification.finalize(None, {}, config=config, model=None, workdir="") == {
        "data/unreadable_files": 2
    }
    images = data.eval_images(config.data, "train")[0]
    want = [np.full((4, 4, 3), v, np.uint8) for v in (0, 120)]
    np.testing.assert_array_equal(images, want)
