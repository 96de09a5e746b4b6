"""Image files as the splits of ``config.data``: ``folder:ROOT`` and ``filelist:LISTS``
(``attnjax.data.folder``), ``shards:DIR`` (``attnjax.data.shards``). Any other name is a TFDS
dataset (``attnjax.data.pipeline.load_source``).

Both splits are listed, checked (``attnjax.data.files.checked``: every header read, so a bad file
stops the run before training) and cached once per process: the train and eval pipelines, the
prior's codes and the FID's real images all read the same lists.
"""

from __future__ import annotations

import functools

from absl import logging

from attnjax.data import folder, preprocess, shards
from attnjax.data.files import FileSource, ImageList, check_sizes, checked

KINDS = (*folder.KINDS, "shards")


def file_kind(name: str) -> tuple[str, str] | None:
    """``(kind, location)`` of a name of image files, None for a TFDS name."""
    kind, colon, location = name.partition(":")
    if not colon or kind not in KINDS:
        return None
    if not location:
        raise ValueError(f"config.data.name={name!r} names no location; expected {kind}:PATH")
    return kind, location


@functools.lru_cache(maxsize=8)
def _lists(kind, location, splits, fraction, seed, skip_unreadable) -> dict[str, ImageList]:
    if kind == "shards":
        lists = {split: shards.split_list(location, split) for split in splits}
    else:
        listed = folder.list_splits(kind, location, splits, fraction=fraction, seed=seed)
        lists = {
            split: checked(images, skip_unreadable=skip_unreadable, where=f"{location} ({split})")
            for split, images in listed.items()
        }
    for split, images in lists.items():
        logging.info(
            "%s:%s: %s split, %d images, %d classes%s",
            kind,
            location,
            split,
            len(images.paths),
            len(images.classes),
            f", {len(images.unreadable)} unreadable left out" if images.unreadable else "",
        )
    return lists


def split_lists(data) -> dict[str, ImageList]:
    """``{split: ImageList}`` of ``config.data``'s train and eval splits, checked."""
    kind, location = file_kind(data.name)
    lists = _lists(
        kind,
        location,
        (data.train_split, data.eval_split),
        float(data.get("holdout_fraction", 0.0)),
        int(data.get("holdout_seed", 0)),
        bool(data.get("skip_unreadable", False)),
    )
    if not data.get("upscale", True):
        train, evaluation = preprocess.crops(data)
        why = f"config.data (image_size={data.image_size}, crops {train!r}/{evaluation!r})"
        for images in lists.values():
            check_sizes(images, preprocess.needed_side(data), why)
    return lists


def channels(data) -> int:
    return int(data.get("channels") or len(data.mean))


def open_split(data, split: str):
    """A random-access source of ``{"image": uint8 [H, W, C], "label": int32}`` records."""
    images = split_lists(data)[split]
    kind, location = file_kind(data.name)
    draft, side = preprocess.draft_side(data), preprocess.source_side(data)
    if kind == "shards":
        return shards.ShardSource(location, split, channels(data), draft, side)
    return FileSource(images, channels(data), draft, side)


def num_classes(data) -> int:
    """The classes of ``config.data``'s files (0: unlabelled)."""
    if not file_kind(data.name):
        raise ValueError(
            f"config.data.name={data.name!r} is a TFDS dataset; the class count is read only from "
            "image files (folder:, filelist:, shards:): set config.model.num_classes"
        )
    return len(split_lists(data)[data.train_split].classes)


def class_names(data) -> tuple[str, ...]:
    """The class names of ``config.data``'s image files, label ``i`` the ``i``-th; ``()`` for a
    TFDS dataset or unlabelled files."""
    if not file_kind(data.name):
        return ()
    return split_lists(data)[data.train_split].classes


def unreadable_count(data) -> int:
    """Files left out by ``config.data.skip_unreadable`` (or by prepare's), in both splits; 0
    for TFDS datasets."""
    if not file_kind(data.name):
        return 0
    return sum(len(images.unreadable) for images in split_lists(data).values())


def unreadable_metrics(data) -> dict:
    """``{"data/unreadable_files": n}`` for image files (a metric of the run), ``{}`` for TFDS."""
    return {"data/unreadable_files": unreadable_count(data)} if file_kind(data.name) else {}
