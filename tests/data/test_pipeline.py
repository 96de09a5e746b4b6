"""attnjax/data.py: the embedded digits dataset and the TFDS data_source + grain pipeline."""

import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import load_config
from sklearn.datasets import load_digits

from attnjax import data
from attnjax.data import pipeline


@pytest.fixture
def digits_config(digits_dir):
    config = load_config("vit_digits")
    config.data.data_dir = digits_dir
    config.batch_size = 32
    config.eval_batch_size = 100
    return config


def _records(source):
    return [source[i] for i in range(len(source))]


def test_digits_split_is_fixed_stratified_and_complete(digits_dir):
    train = _records(data.load_source("digits", "train", digits_dir))
    test = _records(data.load_source("digits", "test", digits_dir))
    assert (len(train), len(test)) == (1437, 360)

    reference = load_digits()
    expected = np.round(reference.images * 255.0 / 16.0).astype(np.uint8)
    # Together the two splits are exactly sklearn's 1797 (image, label) pairs.
    key = lambda image, label: (int(label), image.reshape(-1).tobytes())
    ours = sorted(key(r["image"], r["label"]) for r in train + test)
    theirs = sorted(key(image, label) for image, label in zip(expected, reference.target))
    assert ours == theirs
    assert all(r["image"].shape == (8, 8, 1) and r["image"].dtype == np.uint8 for r in test)

    # Stratified: each class's test share is 360/1797 of its count, to within one example.
    all_counts = np.bincount(reference.target, minlength=10)
    test_counts = np.bincount([r["label"] for r in test], minlength=10)
    assert np.all(np.abs(test_counts - all_counts * 360 / 1797) <= 1), test_counts


def test_train_stream_is_seeded_reshuffled_per_epoch_and_resumable(digits_config):
    digits_config.data.crop_padding = 0
    digits_config.batch_size = 479  # 1437 = 3 * 479: epochs align with batches
    ds = data.make_datasets(digits_config)
    it = data.make_iterator(ds.train)
    epoch_batches = 3
    first = [next(it) for _ in range(2 * epoch_batches)]
    again = data.make_iterator(data.make_datasets(digits_config).train)
    np.testing.assert_array_equal(next(again)["image"], first[0]["image"])

    # Epoch 1 and epoch 2 each visit distinct examples, in different orders.
    def fingerprints(batches):
        return [img.tobytes() for b in batches for img in b["image"]]

    e1, e2 = fingerprints(first[:epoch_batches]), fingerprints(first[epoch_batches:])
    assert sorted(e1) == sorted(e2) and len(set(e1)) == len(set(e2))
    assert e1 != e2

    digits_config.seed = 1
    other = next(data.make_iterator(data.make_datasets(digits_config).train))
    assert not np.array_equal(other["label"], first[0]["label"])
    digits_config.batch_size = 32
    ds = data.make_datasets(digits_config)

    # Restoring the iterator state replays exactly the batches that followed.
    it = data.make_iterator(ds.train)
    for _ in range(5):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(3)]
    resumed = data.make_iterator(ds.train)
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        np.testing.assert_array_equal(got["image"], want["image"])
        np.testing.assert_array_equal(got["label"], want["label"])


def test_batches_are_normalised_resized_and_shifted(digits_config, digits_dir):
    digits_config.data.crop_padding = 0
    plain = next(data.make_iterator(data.make_datasets(digits_config).train))
    assert plain["image"].shape == (32, 16, 16, 1) and plain["image"].dtype == np.float32
    assert plain["label"].dtype == np.int32
    assert -1.0 <= plain["image"].min() and plain["image"].max() <= 1.0

    digits_config.data.crop_padding = 1
    shifted = next(data.make_iterator(data.make_datasets(digits_config).train))
    np.testing.assert_array_equal(shifted["label"], plain["label"])  # same order, only moved
    background = -1.0  # a zero pixel after (x - 0.5) / 0.5
    for a, b in zip(plain["image"], shifted["image"]):
        candidates = []
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                moved = np.full_like(a, background)
                src = a[max(0, -dy) : 16 - max(0, dy), max(0, -dx) : 16 - max(0, dx)]
                moved[max(0, dy) : 16 - max(0, -dy), max(0, dx) : 16 - max(0, -dx)] = src
                candidates.append(np.array_equal(moved, b))
        assert any(candidates)


def test_random_crop_flip_reference():
    image = np.arange(2 * 3 * 1, dtype=np.uint8).reshape(2, 3, 1) + 1
    flips = {
        data.random_crop_flip(image, np.random.default_rng(s), 0, True).tobytes() for s in range(20)
    }
    assert flips == {image.tobytes(), image[:, ::-1].tobytes()}


@pytest.mark.parametrize("padding", [1, 2, 5])
def test_random_crop_is_a_crop_of_the_zero_padded_image(padding):
    """Against the definition: pad with zeros, crop at the offsets the generator draws."""
    image = np.random.default_rng(0).integers(1, 256, (4, 5, 3), dtype=np.uint8)
    for seed in range(30):
        dy, dx = np.random.default_rng(seed).integers(0, 2 * padding + 1, size=2)
        want = np.pad(image, ((padding, padding), (padding, padding), (0, 0)))[
            dy : dy + 4, dx : dx + 5
        ]
        got = data.random_crop_flip(image, np.random.default_rng(seed), padding, False)
        np.testing.assert_array_equal(got, want)


def test_eval_covers_every_example_once_with_mask(digits_config, digits_dir):
    digits_config.eval_batch_size = 128  # 360 = 2 * 128 + 104 -> 24 padded slots
    ds = data.make_datasets(digits_config)
    batches = list(data.make_iterator(ds.eval))
    assert len(batches) == 3 and all(b["image"].shape[0] == 128 for b in batches)
    mask = np.concatenate([b["mask"] for b in batches])
    labels = np.concatenate([b["label"] for b in batches])
    assert mask.sum() == 360 and np.all(mask[:360] == 1) and np.all(mask[360:] == 0)
    truth = [r["label"] for r in _records(data.load_source("digits", "test", digits_dir))]
    np.testing.assert_array_equal(labels[:360], truth)


def test_process_shards_are_disjoint_and_complete(digits_config):
    digits_config.data.crop_padding = 0
    everything = data.make_datasets(digits_config)
    full = sorted(
        img.tobytes()
        for b in data.make_iterator(everything.eval)
        for img in b["image"][b["mask"] > 0]
    )
    shards = []
    for index in range(2):
        ds = data.make_datasets(digits_config, process_index=index, process_count=2)
        assert ds.num_train_examples == 1437  # each process reads rows of every global batch
        batches = list(data.make_iterator(ds.eval))
        assert len(batches) == 4 and batches[0]["image"].shape[0] == 50  # 100 / 2 per process
        shards += [img.tobytes() for b in batches for img in b["image"][b["mask"] > 0]]
    assert sorted(shards) == full


def test_global_batches_do_not_depend_on_the_process_count(digits_config):
    """Process p's train batch t is rows [p * b, (p + 1) * b) of the one-process batch t, random
    crops included, across an epoch boundary (1437 examples: 44.9 batches of 32)."""
    one = data.make_iterator(data.make_datasets(digits_config).train)
    two = [
        data.make_iterator(
            data.make_datasets(digits_config, process_index=index, process_count=2).train
        )
        for index in range(2)
    ]
    for _ in range(46):
        whole = next(one)
        halves = [next(iterator) for iterator in two]
        for key in ("image", "label"):
            np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), whole[key])
    assert two[1].get_state() == two[0].get_state() == {"next_index": 46}


def test_unknown_dataset_and_unprepared_dataset_errors(tmp_path):
    with pytest.raises(ValueError, match="no_such_dataset"):
        data.load_source("no_such_dataset", "train", str(tmp_path))
    # mnist is a real TFDS dataset that is not on disk here: preparing it needs TensorFlow.
    with pytest.raises(RuntimeError, match=r"attnjax\[tfds-prepare\]"):
        data.load_source("mnist", "train", str(tmp_path))


def test_batch_size_must_divide_over_processes(digits_config):
    digits_config.batch_size = 33
    with pytest.raises(ValueError, match="config.batch_size=33"):
        data.make_datasets(digits_config, process_index=0, process_count=2)


_PREPARE_WHEN_TOLD = """
import os, sys, time
import tensorflow_datasets
from attnjax import data
go, data_dir = sys.argv[1], sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.005)
print(len(data.load_source("digits", "train", data_dir)))
"""


def test_processes_started_together_prepare_the_digits_once(tmp_path):
    """Runs launched at once on a fresh machine all find the digits unprepared; without a lock the
    later ones fail renaming their copy onto the first one's."""
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PREPARE_WHEN_TOLD, str(go), str(tmp_path / "tfds")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    # Every process has imported TFDS and is polling before any starts preparing.
    time.sleep(8)
    go.touch()
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-500:] for _, err in results]
    assert [out.strip().splitlines()[-1] for out, _ in results] == ["1437"] * 3


def test_decoding_once_in_memory_leaves_the_stream_unchanged(digits_config, monkeypatch):
    """The digits fit in memory and are decoded once; the stream equals the one that decodes
    every record as it is read (IN_MEMORY_BYTES = 0: the pipeline as it was before), batch for
    batch."""

    class CountingSource:
        def __init__(self, source):
            self.source, self.reads = source, 0

        def __len__(self):
            return len(self.source)

        def __getitem__(self, i):
            self.reads += 1
            return self.source[i]

    source = CountingSource(data.load_source("digits", "train", digits_config.data.data_dir))
    kept = data.records_in_memory(source)
    source.reads = 0
    [kept[i] for i in range(10)]
    assert source.reads == 0
    cached = data.make_iterator(data.make_datasets(digits_config).train)
    batches = [next(cached) for _ in range(50)]  # past the first epoch (1437 / 32 batches)
    monkeypatch.setattr(pipeline, "IN_MEMORY_BYTES", 0)
    read_through = data.records_in_memory(source)
    source.reads = 0
    [read_through[i] for i in range(10)]
    assert source.reads >= 10
    read_each_time = data.make_iterator(data.make_datasets(digits_config).train)
    for want in batches:
        got = next(read_each_time)
        np.testing.assert_array_equal(got["image"], want["image"])
        np.testing.assert_array_equal(got["label"], want["label"])
