"""Image folders, statistics files and TFDS splits as metric sources; every problem one line."""

import numpy as np
import pytest
from PIL import Image

from attnjax.data import folder
from attnjax.metrics import sources
from attnjax.metrics.statistics import save_statistics


def _png(path, pixels):
    Image.fromarray(pixels).save(path)
    return path


def test_a_folder_is_read_in_sorted_order_as_rgb_in_0_1(tmp_path, np_rng):
    gray = np_rng.integers(0, 256, (4, 5), dtype=np.uint8)
    color = np_rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)
    _png(tmp_path / "b.png", color)
    _png(tmp_path / "a.png", gray)
    (tmp_path / "notes.txt").write_text("not an image")
    source = sources.open_source(str(tmp_path))
    assert isinstance(source, sources.ImageFolder) and len(source) == 2
    (batch,) = source.batches(5)
    assert batch.dtype == np.float32 and batch.shape == (2, 4, 5, 3)
    np.testing.assert_array_equal(batch[0], np.repeat(gray[..., None], 3, -1) / np.float32(255))
    np.testing.assert_array_equal(batch[1], color / np.float32(255))


def test_a_statistics_file_is_a_source(tmp_path):
    path = save_statistics(tmp_path / "stats.npz", np.zeros(3), np.eye(3))
    source = sources.open_source(path)
    assert isinstance(source, sources.Statistics)
    np.testing.assert_array_equal(source.sigma, np.eye(3))


def test_a_tfds_split_is_a_source(digits_dir):
    source = sources.open_source("tfds:digits:test[:10]", data_dir=digits_dir)
    assert len(source) == 10
    batches = list(source.batches(4))
    assert [b.shape for b in batches] == [(4, 8, 8, 3), (4, 8, 8, 3), (2, 8, 8, 3)]
    assert 0 <= batches[0].min() and batches[0].max() <= 1 and batches[0].max() > 0


def test_bad_sources_are_one_line_naming_the_path(tmp_path, np_rng):
    (tmp_path / "empty").mkdir()
    (tmp_path / "mixed").mkdir()
    _png(tmp_path / "mixed" / "a.png", np.zeros((4, 4, 3), np.uint8))
    _png(tmp_path / "mixed" / "b.png", np.zeros((5, 4, 3), np.uint8))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "x.png").write_bytes(b"not a png")
    (tmp_path / "file.txt").write_text("x")
    cases = [
        (str(tmp_path / "missing"), "no such file or folder"),
        (str(tmp_path / "file.txt"), "not a folder of images"),
        (str(tmp_path / "empty"), "no image files"),
        (str(tmp_path / "mixed"), "b.png is (5, 4)"),
        (str(tmp_path / "broken"), "x.png"),
        (str(tmp_path / "missing.npz"), "no such statistics file"),
        ("tfds:digits", "tfds:NAME:SPLIT"),
        ("tfds:no_such_dataset_here:test", "no_such_dataset_here"),
    ]
    for spec, expected in cases:
        with pytest.raises(ValueError) as error:
            source = sources.open_source(spec, data_dir=str(tmp_path / "tfds"))
            list(source.batches(8))
        message = str(error.value)
        assert expected in message and "\n" not in message, (spec, message)


def test_images_in_memory_are_a_source_as_given():
    images = np.random.default_rng(0).random((5, 4, 4, 1), np.float32)
    source = sources.ArrayImages(images, "samples")
    assert len(source) == 5
    batches = list(source.batches(2))
    assert [len(batch) for batch in batches] == [2, 2, 1]
    np.testing.assert_array_equal(np.concatenate(batches), images)  # gray stays gray
    with pytest.raises(ValueError, match=r"samples: images must be \[n, H, W, C\]"):
        sources.ArrayImages(images[0], "samples")


def test_one_split_of_image_files_is_the_split_training_reads(tmp_path):
    """``folder:ROOT:SPLIT``: a split folder, or the held-out share of a folder without split
    folders; a split not there or left empty is one line naming it and the folder."""
    flat, split = tmp_path / "flat", tmp_path / "split"
    for root in (flat, split / "train" / "cat", split / "test" / "cat"):
        root.mkdir(parents=True)
    for i in range(20):
        _png(flat / f"{i:02d}.png", np.full((4 + i % 3, 6, 3), i, np.uint8))
    _png(split / "train" / "cat" / "a.png", np.zeros((4, 4, 3), np.uint8))
    _png(split / "test" / "cat" / "b.png", np.zeros((4, 4, 3), np.uint8))
    held = folder.list_splits("folder", str(flat), folder.SPLITS, fraction=0.1)
    for name, expected in (("test", held["test"].paths), ("train", held["train"].paths)):
        source = sources.open_source(f"folder:{flat}:{name}", image_size=5)
        assert [path for path, _ in source.items] == expected
        assert sum(len(batch) for batch in source.batches(8)) == len(expected)
    source = sources.open_source(f"folder:{split}:test")
    assert [path for path, _ in source.items] == [str(split / "test" / "cat" / "b.png")]
    assert len(sources.open_source(f"folder:{flat}", image_size=5)) == 20
    cases = [
        (f"folder:{flat}:val", ["'val'", "'train'", "'test'", str(flat)]),
        (f"folder:{split}:val", ["'val'", "train, test", str(split)]),
        (f"folder:{flat}:", ["folder:PATH:SPLIT"]),
        (f"folder:{tmp_path / 'missing'}:test", ["missing", "no such folder"]),
    ]
    for spec, expected in cases:
        with pytest.raises(ValueError) as error:
            sources.open_source(spec)
        message = str(error.value)
        assert all(e in message for e in expected) and "\n" not in message, (spec, message)
    with pytest.raises(ValueError, match=r"holdout_fraction=0.001 of its 20 images leaves the"):
        sources.open_source(f"folder:{flat}:test", holdout_fraction=0.001)
