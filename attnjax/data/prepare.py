"""Image files -> ArrayRecord shards, for datasets too large or too far away to list and read file
by file at every start (``attnjax.data.shards`` describes what is written)::

    python -m attnjax.data.prepare folder:photos/ shards/photos     # or filelist:lists/{split}.txt
    python train.py --config configs/vqgan_folder.py --config.data.name=shards:shards/photos ...

Every file is read and decoded once (so a truncated file is found here, not mid-run; with
``--skip_unreadable`` it is left out and counted). Each shard is written under a temporary name
and renamed when complete: after a kill, rerunning the same command keeps the complete shards
and writes the rest, and gives the same files as an uninterrupted run. ``metadata.json`` is
written last. The source is only read.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import sys

import numpy as np
from tqdm import tqdm

from attnjax.data import folder, shards
from attnjax.data.decode import image_size

PLAN = "plan.json"
READ_THREADS = 8


def _read(path: str, name: str, skip_unreadable: bool):
    """``(bytes, (width, height))`` of a whole, decodable image file; None for a bad one with
    ``skip_unreadable``."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as error:
        if skip_unreadable:
            return None
        raise ValueError(f"{path!r} cannot be read ({error}); expected a readable file") from None
    try:
        return data, image_size(data, path, full=True)
    except ValueError:
        if skip_unreadable:
            return None
        raise


def _write_shard(directory, shard, records, pool, skip_unreadable, bar) -> list[str]:
    """Writes ``shard`` (complete or not at all) -> the names of the files left out."""
    from array_record.python.array_record_module import ArrayRecordWriter

    final = os.path.join(directory, shard)
    temporary = os.path.join(directory, f".{shard}.tmp")
    names, labels, sizes, unreadable = [], [], [], []
    writer = ArrayRecordWriter(temporary, "group_size:1")
    reads = pool.map(lambda r: _read(r[0], r[1], skip_unreadable), records)
    for (_, name, label), read in zip(records, reads):
        bar.update(1)
        if read is None:
            unreadable.append(name)
            continue
        writer.write(shards.encode_record(name, label, read[0]))
        names.append(name)
        labels.append(label)
        sizes.append(read[1])
    writer.close()
    index = dict(
        names=np.asarray(names, dtype=str),
        labels=np.asarray(labels, np.int32),
        sizes=np.asarray(sizes, np.int32).reshape(-1, 2),
        unreadable=np.asarray(unreadable, dtype=str),
    )
    with open(f"{temporary}.index.npz", "wb") as file:
        np.savez(file, **index)
    os.replace(f"{temporary}.index.npz", f"{final}.index.npz")
    os.replace(temporary, final)  # last: a shard that exists is complete, index and all
    return unreadable


def _plan(source: str, lists: dict, records_per_shard: int) -> dict:
    digest = hashlib.sha256()
    for split, images in lists.items():
        digest.update(json.dumps([split, list(images.names), images.labels.tolist()]).encode())
    return {"source": source, "records_per_shard": records_per_shard, "files": digest.hexdigest()}


def _start(out: str, plan: dict) -> None:
    """Records ``plan`` in ``out``, or checks that ``out`` was started with the same one."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, PLAN)
    if os.path.exists(path):
        with open(path) as file:
            started = json.load(file)
        if started != plan:
            raise ValueError(
                f"{out!r} holds shards of another source or file list ({started['source']!r}, "
                f"{started['records_per_shard']} records a shard); expected an empty folder or "
                "one started by the same command"
            )
        return
    with open(f"{path}.tmp", "w") as file:
        json.dump(plan, file)
    os.replace(f"{path}.tmp", path)


def prepare(
    source: str,
    out: str,
    *,
    splits=("train", "test"),
    holdout_fraction: float = 0.1,
    holdout_seed: int = 0,
    records_per_shard: int = 1000,
    skip_unreadable: bool = False,
) -> dict:
    """Writes the shards of ``source`` (``folder:ROOT``, ``filelist:LISTS`` or a folder's path)
    into ``out``; returns the metadata."""
    kind, _, location = source.partition(":")
    if kind not in folder.KINDS:
        kind, location = "folder", source
    lists = folder.list_splits(
        kind, location, tuple(splits), fraction=holdout_fraction, seed=holdout_seed
    )
    if os.path.isfile(os.path.join(out, shards.METADATA)):
        return shards.read_metadata(out)
    _start(out, _plan(f"{kind}:{location}", lists, records_per_shard))
    total = sum(len(images.paths) for images in lists.values())
    metadata = {"format": shards.FORMAT, "source": f"{kind}:{location}", "splits": {}}
    metadata["classes"] = list(lists[splits[0]].classes)
    with (
        concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool,
        tqdm(total=total, desc=f"writing {out}", unit="img", smoothing=0.1) as bar,
    ):
        for split, images in lists.items():
            count = max(1, -(-len(images.paths) // records_per_shard))
            names, unreadable, records = [], [], 0
            for i in range(count):
                shard = shards.shard_name(split, i, count)
                chunk = slice(i * records_per_shard, (i + 1) * records_per_shard)
                if os.path.exists(os.path.join(out, shard)):
                    bar.update(len(images.paths[chunk]))
                else:
                    rows = list(zip(images.paths[chunk], images.names[chunk], images.labels[chunk]))
                    _write_shard(out, shard, rows, pool, skip_unreadable, bar)
                with np.load(os.path.join(out, f"{shard}.index.npz")) as index:
                    records += len(index["names"])
                    unreadable += index["unreadable"].tolist()
                names.append(shard)
            metadata["splits"][split] = dict(records=records, shards=names, unreadable=unreadable)
    with open(os.path.join(out, f"{shards.METADATA}.tmp"), "w") as file:
        json.dump(metadata, file, indent=1)
    os.replace(os.path.join(out, f"{shards.METADATA}.tmp"), os.path.join(out, shards.METADATA))
    return metadata


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnjax.data.prepare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("source", help="folder:ROOT, filelist:LISTS ({split} in it) or a folder")
    parser.add_argument("out", help="folder for the shards (created; rerun to resume)")
    parser.add_argument("--splits", default="train,test", help="train and eval split names")
    parser.add_argument("--holdout_fraction", type=float, default=0.1)
    parser.add_argument("--holdout_seed", type=int, default=0)
    parser.add_argument("--records_per_shard", type=int, default=1000)
    parser.add_argument("--skip_unreadable", action="store_true")
    args = parser.parse_args(argv)
    try:
        metadata = prepare(
            args.source,
            args.out,
            splits=tuple(args.splits.split(",")),
            holdout_fraction=args.holdout_fraction,
            holdout_seed=args.holdout_seed,
            records_per_shard=args.records_per_shard,
            skip_unreadable=args.skip_unreadable,
        )
    except ValueError as error:
        print(f"prepare: error: {error}", file=sys.stderr)
        return 1
    for split, entry in metadata["splits"].items():
        skipped = f", {len(entry['unreadable'])} unreadable left out" if entry["unreadable"] else ""
        print(f"{split}: {entry['records']} images in {len(entry['shards'])} shards{skipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
