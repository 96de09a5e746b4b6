"""Run a trained classifier over a folder of images and write its top classes as a CSV.

    python -m attnjax.inference.predict --workdir runs/vit_folder folder:/path/to/photos \\
        --out predictions.csv [--top-k 5] [--batch-size 64] [--on-bad-file skip|stop]

One row per image file below the folder (any depth, sorted by path): ``file`` (its path below the
folder), then ``label`` and ``probability`` of the top class, then ``label_2, probability_2``, ...
up to ``--top-k``. Labels are the run's class names (``config.data.class_names``: the class
folders it trained on), the TFDS label names, or else the class indices. Each image goes through
the run's own evaluation preprocessing (``attnjax.data``: decoding, ``config.data.eval_crop``,
normalisation), in batches of ``--batch-size`` through one compiled program. Each batch is split
along its leading axis over this process's devices and the parameters are replicated on each
(``attnjax.metrics.features.FeatureExtractor``: a 1-D ``data`` mesh); a ``--batch-size`` that the
device count does not divide is rounded up to a multiple of it, said in one line on stderr, and
the last, short batch is padded with zeros whose rows are dropped.

A file that does not decode is reported on stderr in one line and skipped (``--on-bad-file
skip``, the default), or stops the command with status 1 (``stop``). The CSV is written under a
temporary name and renamed when complete, so a stopped command leaves none; an existing
``--out`` is kept unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import csv
import os
import sys

if __name__ == "__main__":
    from attnjax import huge_pages

    # First, as train.py: glibc reads its tunables only when a process starts.
    huge_pages.restart_with_huge_pages()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from attnjax import data, storage  # noqa: E402
from attnjax.data import folder, preprocess, sources  # noqa: E402
from attnjax.data.files import FileSource, ImageList  # noqa: E402
from attnjax.metrics.features import FeatureExtractor  # noqa: E402
from attnjax.tasks import classification  # noqa: E402
from attnjax.train import checkpoint, collector, compilation_cache  # noqa: E402

BAD_FILE_CHOICES = ("skip", "stop")
# Files decoded at once while the previous batch runs: decoding is most of the time on a CPU.
READ_THREADS = 8
# The one output of the network the extractor runs: the softmax over the classes.
PROBABILITIES = "probabilities"


class BadFile(Exception):
    """A file that does not decode, under ``--on-bad-file stop``."""


def class_names(config) -> list[str]:
    """Label ``i``'s name: the run's class folders, its TFDS dataset's label names, or ``"i"``."""
    count = int(config.model.num_classes)
    names = list(config.data.get("class_names", None) or ())
    if not names and not sources.file_kind(config.data.name):
        names = _tfds_label_names(config.data)
    return names if len(names) == count else [str(i) for i in range(count)]


def _tfds_label_names(data_config) -> list[str]:
    """The label names a prepared TFDS dataset records; none where it records none."""
    import tensorflow_datasets as tfds

    from attnjax.data import digits  # noqa: F401  (registers the embedded builders with TFDS)

    try:
        builder = tfds.builder(
            data_config.name, data_dir=data.default_data_dir(data_config.get("data_dir"))
        )
        return list(builder.info.features[data_config.label_key].names)
    except Exception:  # an unprepared, unlabelled or unnamed dataset: indices then
        return []


def _files(spec: str) -> tuple[str, list[str]]:
    kind, colon, location = spec.partition(":")
    if kind != "folder" or not colon or not location:
        raise ValueError(f"images {spec!r}: expected folder:PATH")
    return os.path.expanduser(location), folder.images_below(location)


def check_args(args: argparse.Namespace) -> None:
    """The arguments' one-line errors, before anything is read or written."""
    if not storage.isdir(args.workdir):
        raise ValueError(f"--workdir {args.workdir!r}: no such folder; expected a trained run")
    if os.path.exists(args.out) and not args.overwrite:
        raise ValueError(f"--out {args.out!r} exists; not overwriting it without --overwrite")
    if args.top_k < 1 or args.batch_size < 1:
        raise ValueError(
            f"--top-k {args.top_k} and --batch-size {args.batch_size}: expected positive counts"
        )


def _header(top_k: int) -> list[str]:
    columns = ["file", "label", "probability"]
    for rank in range(2, top_k + 1):
        columns += [f"label_{rank}", f"probability_{rank}"]
    return columns


def _reader(config, root: str, names: list[str]):
    """``read(i)`` -> uint8 ``[image_size, image_size, C]``: file ``i`` decoded and cropped as the
    run's eval pipeline does (``attnjax.data.pipeline.make_datasets``)."""
    images = ImageList(
        paths=[os.path.join(root, name) for name in names],
        names=names,
        labels=np.zeros(len(names), np.int32),
        classes=(),
    )
    source = FileSource(
        images,
        sources.channels(config.data),
        preprocess.draft_side(config.data),
        preprocess.source_side(config.data),
    )
    crop = preprocess.eval_fn(config.data)
    return lambda i: crop(source[i]["image"])


def _batches(read, count: int, batch_size: int, on_bad_file: str, report):
    """``(indices, uint8 images [b, H, W, C])`` of the files that decode, ``batch_size`` at a
    time; the next batch is decoded while the caller runs this one."""

    def attempt(i):
        try:
            return read(i)
        except ValueError as error:
            return error

    batches = [list(range(s, min(s + batch_size, count))) for s in range(0, count, batch_size)]
    with concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool:
        decoding = [pool.map(attempt, batch) for batch in batches[:1]]
        for n, indices in enumerate(batches):
            if n + 1 < len(batches):  # decoded while the caller runs this batch
                decoding.append(pool.map(attempt, batches[n + 1]))
            good = []
            for i, result in zip(indices, decoding.pop(0)):
                if not isinstance(result, ValueError):
                    good.append((i, result))
                elif on_bad_file == "stop":
                    raise BadFile(f"{result} (--on-bad-file skip skips it)")
                else:
                    report(f"skipped: {result}")
            if good:
                yield [i for i, _ in good], np.stack([image for _, image in good])


def _classifier(workdir: str, batch_size: int, step: int | None):
    """``(config, extractor)``: the run's classifier over batches split across the local devices,
    ``{PROBABILITIES: float32 [b, num_classes]}`` of normalised images ``[b, H, W, C]``."""
    config, variables = checkpoint.load(
        workdir, variables=classification.VARIABLE_FIELDS, step=step
    )
    model = classification.create_model(config)

    def probabilities(variables, images):
        logits = model.apply(variables, images, train=False)
        return {PROBABILITIES: jax.nn.softmax(logits.astype("float32"))}

    return config, FeatureExtractor(probabilities, variables, batch_size)


def predict_folder(args: argparse.Namespace) -> int:
    """Writes ``args.out`` -> the number of rows written."""
    check_args(args)
    root, names = _files(args.images)
    task = checkpoint.read_config(args.workdir).get("task")
    if task != "classification":
        raise ValueError(f"--workdir {args.workdir!r} is a {task!r} run; expected classification")
    config, classifier = _classifier(args.workdir, args.batch_size, args.step)
    labels = class_names(config)
    top_k = min(args.top_k, len(labels))
    read = _reader(config, root, names)
    partial = f"{args.out}.partial"
    rows = 0
    bar = tqdm(total=len(names), unit="image", desc="predict", file=sys.stderr)

    def report(line):
        bar.write(line, file=sys.stderr)

    if classifier.batch_size != args.batch_size:
        report(
            f"--batch-size {args.batch_size}: rounded up to {classifier.batch_size}, a multiple "
            f"of the {jax.local_device_count()} devices each batch is split over"
        )
    # The files of each batch, in the order the classifier returns the batches.
    batch_indices = collections.deque()

    def normalized_batches():
        for indices, images in _batches(
            read, len(names), classifier.batch_size, args.on_bad_file, report
        ):
            batch_indices.append(indices)
            yield data.normalize(images, config.data)

    try:
        with bar, open(partial, "w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(_header(top_k))
            for outputs in classifier(normalized_batches(), len(names), progress=False):
                indices = batch_indices.popleft()
                for i, row in zip(indices, outputs[PROBABILITIES]):
                    best = np.argsort(-row, kind="stable")[:top_k]
                    cells = [names[i]]
                    for k in best:
                        cells += [labels[k], f"{row[k]:.9g}"]
                    writer.writerow(cells)
                rows += len(indices)
                bar.update(indices[-1] + 1 - bar.n)
            bar.update(len(names) - bar.n)
        os.replace(partial, args.out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m attnjax.inference.predict", description=__doc__.splitlines()[0]
    )
    parser.add_argument("images", help="folder:PATH, the images to classify")
    parser.add_argument("--workdir", required=True, help="a trained classification run")
    parser.add_argument("--out", required=True, help="the CSV to write")
    parser.add_argument("--top-k", type=int, default=5, help="classes per image (default 5)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--on-bad-file", choices=BAD_FILE_CHOICES, default="skip")
    parser.add_argument("--step", type=int, default=None, help="checkpoint (default: latest)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    compilation_cache.enable()
    collector.raise_thresholds()
    try:
        rows = predict_folder(args)
    except (ValueError, FileNotFoundError, BadFile) as error:
        sys.exit(f"error: {' '.join(str(error).split())}")
    print(f"wrote {args.out}: {rows} images")
    return rows


if __name__ == "__main__":
    main()
