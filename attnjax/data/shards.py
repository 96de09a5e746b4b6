"""ArrayRecord shards of image files, as ``python -m attnjax.data.prepare`` writes them, read as a
source: ``config.data.name = "shards:DIR"``.

``DIR`` holds, per split, ``<split>-<i>-of-<n>.array_record`` files and next to each its index
``<shard>.index.npz`` (``names``, ``labels`` int32, ``sizes`` int32 ``[n, 2]``: width, height),
and ``metadata.json`` (written last: its presence means the shards are complete)::

    {"format": FORMAT, "source": "folder:...", "classes": [...],
     "splits": {"train": {"records": n, "shards": [...], "unreadable": [...]}, ...}}

A record is one image file's bytes as they were on disk (not decoded, not re-encoded) behind a
one-line JSON header: ``{"name": <path below the source's root>, "label": <int>}\\n<bytes>``.
Reading a record decodes it as reading the file would (``attnjax.data.decode``), so the batches
of the shards equal the batches of the folder they were made from.
"""

from __future__ import annotations

import json
import os

import numpy as np

from attnjax.data.decode import decode_image
from attnjax.data.files import ImageList

FORMAT = "attnjax image shards 1"
METADATA = "metadata.json"


def encode_record(name: str, label: int, data: bytes) -> bytes:
    return json.dumps({"name": name, "label": int(label)}).encode() + b"\n" + data


def decode_record(record: bytes) -> tuple[dict, bytes]:
    header, _, data = record.partition(b"\n")
    return json.loads(header), data


def shard_name(split: str, index: int, count: int) -> str:
    return f"{split}-{index:05d}-of-{count:05d}.array_record"


def read_metadata(directory: str) -> dict:
    path = os.path.join(directory, METADATA)
    if not os.path.isfile(path):
        raise ValueError(
            f"config.data.name='shards:{directory}': {path!r} not found; expected the output of "
            "python -m attnjax.data.prepare (an interrupted one: rerun it to finish)"
        )
    with open(path) as file:
        metadata = json.load(file)
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path!r}: format {metadata.get('format')!r}; expected {FORMAT!r}")
    return metadata


def split_list(directory: str, split: str) -> ImageList:
    """The ``ImageList`` of ``split`` in the shards at ``directory``: ``paths`` are the records'
    descriptions (``DIR/<split>[i] (<name>)``), ``sizes`` and ``unreadable`` as prepare found."""
    metadata = read_metadata(directory)
    if split not in metadata["splits"]:
        raise ValueError(
            f"{directory!r} holds no split {split!r}; expected one of {sorted(metadata['splits'])}"
        )
    names, labels, sizes = [], [], []
    for shard in metadata["splits"][split]["shards"]:
        with np.load(os.path.join(directory, f"{shard}.index.npz")) as index:
            names += index["names"].tolist()
            labels.append(index["labels"])
            sizes.append(index["sizes"])
    where = os.path.join(directory, split)
    return ImageList(
        paths=[f"{where}[{i}] ({name})" for i, name in enumerate(names)],
        names=names,
        labels=np.concatenate(labels).astype(np.int32),
        classes=tuple(metadata["classes"]),
        sizes=np.concatenate(sizes).astype(np.int32).reshape(-1, 2),
        unreadable=tuple(metadata["splits"][split].get("unreadable", ())),
    )


class ShardSource:
    """Random access to the decoded records of one split: ``source[i]`` -> ``{"image": uint8
    [H, W, channels], "label": int32}``, as ``attnjax.data.files.FileSource`` gives for files
    (``min_side``, ``shorter_side``: as there)."""

    def __init__(
        self, directory: str, split: str, channels: int, min_side: int = 0, shorter_side: int = 0
    ):
        import grain

        metadata = read_metadata(directory)
        shards = metadata["splits"][split]["shards"]
        self.where = os.path.join(directory, split)
        self.records = grain.sources.ArrayRecordDataSource(
            [os.path.join(directory, shard) for shard in shards]
        )
        self.channels, self.min_side, self.shorter_side = channels, min_side, shorter_side

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        header, data = decode_record(self.records[int(index)])
        where = f"{self.where}[{int(index)}] ({header['name']})"
        image = decode_image(data, self.channels, where, self.min_side, self.shorter_side)
        return {"image": image, "label": np.int32(header["label"])}
