"""Input data: TFDS sources and image files read through grain (``pipeline``), image files as
sources (``sources``: ``folder``, ``files``, ``shards``, ``decode``; ``prepare`` writes shards),
per-example transforms and pixel normalisation (``preprocess``, ``transforms``), the embedded
digits dataset (``digits``) and PNG pictures (``images``).

The pipeline's public functions are re-exported here, so a caller writes ``data.make_datasets``.
"""

from attnjax.data.pipeline import (
    Datasets,
    default_data_dir,
    eval_images,
    load_source,
    make_datasets,
    make_iterator,
    open_split,
    padded_eval_dataset,
    per_process_batch_size,
    process_batches,
    records_in_memory,
)
from attnjax.data.sources import class_names, num_classes, unreadable_count, unreadable_metrics
from attnjax.data.transforms import denormalize, normalize, random_crop_flip, resize

__all__ = [
    "DIGITS_TEST_SIZE",
    "EMBEDDED_BUILDERS",
    "Datasets",
    "Digits",
    "class_names",
    "default_data_dir",
    "denormalize",
    "eval_images",
    "load_source",
    "make_datasets",
    "make_iterator",
    "normalize",
    "num_classes",
    "open_split",
    "padded_eval_dataset",
    "per_process_batch_size",
    "process_batches",
    "random_crop_flip",
    "records_in_memory",
    "resize",
    "unreadable_count",
    "unreadable_metrics",
]

_DIGITS = ("DIGITS_TEST_SIZE", "EMBEDDED_BUILDERS", "Digits")


def __getattr__(name):
    # The digits builder subclasses a TFDS class: importing it imports TFDS, so only on use.
    if name in _DIGITS:
        from attnjax.data import digits

        return getattr(digits, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
