"""Input pipelines: TFDS ``data_source`` or image files read through grain.

Every dataset (the embedded digits, CIFAR-10, MNIST, ..., a folder of your own images) takes the
same path::

    source (tfds.data_source, or image files: attnjax.data.sources) -> grain.MapDataset
        -> seeded shuffle (re-drawn every epoch) -> repeat -> decode, resize (preprocess.prepare)
        -> crops and flips (random_map) -> this process's rows of each global batch -> normalise

A train batch is ``{"image": float32 [batch, H, W, C], "label": int32 [batch]}``; an eval batch
adds ``"mask"`` float32 ``[batch]`` (0.0 on the padding that completes the last batch, so every
eval example counts exactly once). Batches are per process: ``global_batch / process_count``.
Train batch ``t`` of process ``p`` is rows ``[p * b, (p + 1) * b)`` of global batch ``t`` (``b``
the per-process batch), and the global stream is the same whatever the process count, so a run
on several processes sees the same examples in the same order as one process over as many
devices. Each process checkpoints its own iterator state.

Random transforms draw from generators seeded by (seed, position in the stream), so the
stream is a pure function of the seed and the iterator's position; the position
(``iterator.get_state()``) is what a checkpoint stores.

Preparing a TFDS dataset that is not on disk yet needs TensorFlow
(``pip install attnjax[tfds-prepare]``); the embedded digits never do.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
from typing import Any, Callable, NamedTuple

import grain
import numpy as np

from attnjax.data import preprocess, sources
from attnjax.data.transforms import normalize


class Datasets(NamedTuple):
    """What a task's input pipeline hands the training loop.

    train: infinite ``grain.MapDataset`` of per-process batches; ``make_iterator(train)`` gives
        an iterator with ``get_state()``/``set_state()`` (saved in checkpoints).
    eval: finite ``grain.MapDataset`` of padded per-process batches with a ``"mask"`` entry.
    """

    train: grain.MapDataset
    eval: grain.MapDataset
    num_train_examples: int
    num_eval_examples: int


def make_iterator(dataset: grain.MapDataset, data_config=None):
    """An iterator over ``dataset`` with ``get_state``/``set_state``.

    ``data_config.read_threads`` (default 0: elements are computed in the calling thread, the
    right choice for in-memory sources and a busy CPU; grain's own default is 16 threads with
    500 elements read ahead) and ``data_config.worker_count`` (default 0; > 0 moves the
    pipeline into that many worker processes, which need absl flags parsed first).
    """
    get = (
        (lambda key, default: data_config.get(key, default))
        if data_config
        else (lambda key, default: default)
    )
    threads = get("read_threads", 0)
    iterable = dataset.to_iter_dataset(
        grain.ReadOptions(num_threads=threads, prefetch_buffer_size=max(2 * threads, 1))
    )
    workers = get("worker_count", 0)
    if workers:
        iterable = iterable.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return iter(iterable)


def default_data_dir(data_dir: str | None = None) -> str:
    """``data_dir`` if given, else ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``."""
    if data_dir:
        return os.path.expanduser(data_dir)
    return os.environ.get("TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))


@contextlib.contextmanager
def _preparation_lock(data_dir: str, name: str):
    """One process at a time prepares ``name`` in ``data_dir`` (runs started together on a fresh
    machine all find it unprepared)."""
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, f".{name}.prepare.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load_source(name: str, split: str, data_dir: str | None = None):
    """Random-access TFDS source for ``name``/``split``; prepares embedded datasets on first use."""
    # Imported here, not with the module: TFDS and its builder registry take a tenth of a second
    # to import, which runs that read image folders or cached codes need not pay.
    import tensorflow_datasets as tfds

    from attnjax.data.digits import EMBEDDED_BUILDERS

    data_dir = default_data_dir(data_dir)
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError as e:
        raise ValueError(
            f"config.data.name={name!r} is not a TFDS dataset (nor an embedded one: "
            f"{[b.name for b in EMBEDDED_BUILDERS]})."
        ) from e
    if isinstance(builder, EMBEDDED_BUILDERS) and not builder.is_prepared():
        with _preparation_lock(data_dir, name):
            # Another process may have finished while this one waited: TFDS would then fail to
            # rename its own copy onto the finished one.
            if not tfds.builder(name, data_dir=data_dir).is_prepared():
                builder.download_and_prepare(file_format="array_record")
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except (NotImplementedError, FileNotFoundError, AssertionError) as e:
        raise RuntimeError(
            f"TFDS dataset {name!r} (split {split!r}) is not prepared as array_record under "
            f"{data_dir!r}. Preparing it needs TensorFlow: `pip install attnjax[tfds-prepare]`, "
            f"then `tfds build {name} --data_dir={data_dir} --file_format=array_record`."
        ) from e
    except ValueError as e:
        raise ValueError(f"config.data split {split!r} of {name!r}: {e}") from e


def open_split(data_config, split: str):
    """The random-access source of ``split`` of ``config.data``: image files (``folder:``,
    ``filelist:``, ``shards:``; ``attnjax.data.sources``) or a TFDS dataset."""
    if sources.file_kind(data_config.name):
        return sources.open_split(data_config, split)
    return load_source(data_config.name, split, data_config.get("data_dir"))


def _prepare_fn(data_config, transform) -> Callable[[dict], dict]:
    """A record -> the same record with ``transform`` applied to its image."""
    image_key = data_config.image_key

    def prepared(record):
        return {**record, image_key: transform(np.asarray(record[image_key]))}

    return prepared


def _example_fn(data_config, transform) -> Any:
    image_key, label_key = data_config.image_key, data_config.label_key

    def example(record):
        image = transform(np.asarray(record[image_key]))
        return {"image": image, "label": np.int32(record[label_key])}

    return example


def eval_images(data_config, split: str, limit: int | None = None):
    """The first ``limit`` (None: all) images of ``split`` as the eval pipeline reads them, uint8
    ``[n, H, W, C]``, and their labels int32 ``[n]``."""
    source = open_split(data_config, split)
    example = _example_fn(data_config, preprocess.eval_fn(data_config))
    records = [example(source[i]) for i in range(min(limit or len(source), len(source)))]
    return np.stack([r["image"] for r in records]), np.asarray([r["label"] for r in records])


def _normalize_fn(data_config):
    def normalized(example):
        return {**example, "image": normalize(example["image"], data_config)}

    return normalized


def per_process_batch_size(batch_size: int, process_count: int, what: str = "config.batch_size"):
    if batch_size % process_count:
        raise ValueError(
            f"{what}={batch_size} must be divisible by the process count {process_count}."
        )
    return batch_size // process_count


def process_batches(
    examples: grain.MapDataset, global_batch: int, process_index: int = 0, process_count: int = 1
) -> grain.MapDataset:
    """This process's rows of each global batch of ``examples``: ``[global_batch / count, ...]``.

    Global batch ``t`` is ``examples[t * global_batch:(t + 1) * global_batch]`` for every process
    count; ``examples`` is read by index, so its random transforms (seeded by position) do not
    depend on the process count either.
    """
    local = per_process_batch_size(global_batch, process_count)

    def read(i):
        return examples[(i // local) * global_batch + process_index * local + i % local]

    rows = grain.MapDataset.range(len(examples) // process_count).map(read)
    return rows.batch(local, drop_remainder=True)


# Sources whose decoded records fit in this many bytes are read once and kept in memory: reading
# a record decodes its image again each time (22 ms of a 64-digit batch, more than the digits
# ViT's whole training step on 2 cores).
IN_MEMORY_BYTES = 512 * 2**20


def _fits_in_memory(source, first: dict) -> bool:
    nbytes = sum(np.asarray(v).nbytes for v in first.values()) * len(source)
    return nbytes <= IN_MEMORY_BYTES


def records_in_memory(source, prepare: Callable[[dict], dict] = lambda record: record):
    """``[prepare(source[i]) for i in ...]`` if that fits ``IN_MEMORY_BYTES``, else ``source``.

    ``prepare`` is work every read of a record would repeat (the resize to ``image_size``).
    Only the source changes, not the pipeline built on it: grain derives the seeds of random
    transforms from the pipeline's structure, so the stream stays the one of reading ``source``."""
    first = prepare(source[0])
    if not _fits_in_memory(source, first):
        return source
    return [first] + [prepare(source[i]) for i in range(1, len(source))]


class KeptOnRead:
    """``source`` with each record prepared and kept the first time it is read, where that fits
    ``IN_MEMORY_BYTES`` (``records_in_memory``'s records, without decoding every file before the
    first batch: image files are decoded in the first epoch, as it reads them). Reads from
    several threads at once may prepare a record twice, never differently."""

    def __init__(self, source, prepare: Callable[[dict], dict]):
        self.source, self.prepare = source, prepare
        first = prepare(source[0])
        self.kept = [first] + [None] * (len(source) - 1) if _fits_in_memory(source, first) else None

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index):
        if self.kept is None:
            return self.prepare(self.source[index])
        record = self.kept[index]
        if record is None:
            record = self.kept[index] = self.prepare(self.source[index])
        return record


def make_datasets(config, *, process_index: int = 0, process_count: int = 1) -> Datasets:
    """Train and eval pipelines for ``config.data`` (see the module docstring)."""
    data = config.data
    eval_batch = per_process_batch_size(
        config.get("eval_batch_size") or config.batch_size, process_count, "config.eval_batch_size"
    )

    train_source = open_split(data, data.train_split)
    eval_source = open_split(data, data.eval_split)
    prepare, augment = preprocess.prepare_fn(data), preprocess.augment_fn(data)
    example, normalize = _example_fn(data, prepare), _normalize_fn(data)
    eval_example = _example_fn(data, preprocess.eval_fn(data))

    # Kept records are prepared once; ``example`` below then finds them prepared (and leaves
    # them). Files are kept as they are first read, in grain's threads when it has them; worker
    # processes would each keep a copy.
    if not sources.file_kind(data.name):
        train_source = records_in_memory(train_source, _prepare_fn(data, prepare))
    elif not data.get("worker_count", 0):
        train_source = KeptOnRead(train_source, _prepare_fn(data, prepare))
    train = grain.MapDataset.source(train_source)
    num_train = len(train)
    if num_train < config.batch_size:
        raise ValueError(
            f"config.batch_size={config.batch_size} is larger than the "
            f"{num_train} train examples of {data.name!r}."
        )
    train = train.seed(config.seed).shuffle().repeat(None).map(example)
    if augment:
        train = train.random_map(lambda ex, rng: {**ex, "image": augment(ex["image"], rng)})
    # Normalised by the batch: uint8 images are stacked, a quarter of float32's bytes.
    train = process_batches(train, config.batch_size, process_index, process_count).map(normalize)

    evaluation = padded_eval_dataset(
        eval_source,
        eval_batch,
        process_index=process_index,
        process_count=process_count,
        transform=lambda record: normalize(eval_example(record)),
    )
    return Datasets(
        train=train,
        eval=evaluation,
        num_train_examples=num_train,
        num_eval_examples=len(eval_source),
    )


def padded_eval_dataset(
    source,
    batch_size: int,
    *,
    process_index: int = 0,
    process_count: int = 1,
    transform: Callable[[dict], dict] = lambda record: record,
) -> grain.MapDataset:
    """This process's share of ``source`` as ``transform``ed batches of ``batch_size``, each
    example with ``"mask"`` 1.0, completed by all-zero examples with ``"mask"`` 0.0.

    Every process gets the same number of batches, ``ceil(ceil(len(source) / process_count) /
    batch_size)``: a process that ran one batch fewer would leave the others waiting in a
    collective.
    """
    shard = grain.MapDataset.source(source)[process_index::process_count]
    num_batches = math.ceil(math.ceil(len(source) / process_count) / batch_size)
    blank = {k: np.zeros_like(v) for k, v in transform(source[0]).items()}

    def eval_example(i):
        if i < len(shard):
            return {**transform(shard[i]), "mask": np.float32(1.0)}
        return {**blank, "mask": np.float32(0.0)}

    return grain.MapDataset.range(num_batches * batch_size).map(eval_example).batch(batch_size)
