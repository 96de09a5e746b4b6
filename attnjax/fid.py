"""FID between two sets of images, with pytorch-fid's command line::

    python -m attnjax.convert.inception pt_inception-2015-12-05-6726825d.pth inception.npz
    python -m attnjax.fid --inception inception.npz PATH_A PATH_B [--dims 2048] [--batch-size 50]
    python -m attnjax.fid --inception inception.npz --save-stats PATH OUT.npz
    python -m attnjax.fid --inception inception.npz PATH_A PATH_B --metrics is,pr,kid

A PATH is a folder of images, a statistics ``.npz`` (``mu``, ``sigma``: pytorch-fid's, read and
written), ``tfds:NAME:SPLIT``, or image files as ``train.py`` reads them (``folder:ROOT`` in any
layout, ``filelist:LISTS``, ``shards:DIR``: every image; ``folder:ROOT:SPLIT`` and the like: one
split), each image's central square resized to ``--image-size`` (default 299, the Inception's
input, so that photos of mixed sizes work; 0 keeps the sizes, which must then be one). The split
is the one training reads (``attnjax.data.folder.list_split``): ``folder:photos:test`` is
``photos/test`` where ``photos`` holds split folders, and otherwise the files a run held out
for evaluation (``--holdout-fraction 0.1``, ``--holdout-seed 0``: configs/common.py's
``config.data`` defaults, given here when the run changed them); ``train`` is the rest. Against
a VQGAN's or a prior's samples, ``--image-size`` is the run's ``config.data.image_size``: both
sides at one resolution. The last line printed is ``FID: <value>``; ``--metrics`` adds
the Inception Score of PATH_A (``is``), precision and recall of PATH_A (generated) against
PATH_B (real) (``pr``) and the KID (``kid``), on the same features, printed before it.
``--save-stats`` writes PATH's statistics to OUT.npz and never overwrites OUT.

Exit status: 0 done, 2 bad input (one line on stderr naming what is wrong).

From Python, ``evaluate`` takes any ``FeatureExtractor``: another network's features give a
domain FID.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
    from attnjax import huge_pages

    # First, as train.py: glibc reads its tunables only when a process starts.
    huge_pages.restart_with_huge_pages()

from attnjax.data import folder  # noqa: E402
from attnjax.metrics import scores, sources  # noqa: E402
from attnjax.metrics.features import (  # noqa: E402
    FeatureExtractor,
    inception_extractor,
    measure,
)
from attnjax.metrics.statistics import frechet_distance, save_statistics  # noqa: E402
from attnjax.train import collector, compilation_cache  # noqa: E402

DIMS = (64, 192, 768, 2048)
METRICS = ("is", "pr", "kid")
ISC_FEATURE = "logits_unbiased"  # torch-fidelity's and the original Inception Score's
# Image files' default side: the Inception's input, so photos of any sizes stack into batches.
IMAGE_SIZE = 299


def _needs_network(opened) -> bool:
    """Whether any of the opened sources holds images rather than their statistics."""
    return not all(isinstance(source, sources.Statistics) for source in opened)


def evaluate(
    path_a: str,
    path_b: str,
    extractor: FeatureExtractor | None,
    feature: str = "2048",
    metrics=(),
    data_dir: str | None = None,
    progress: bool = True,
    isc_splits: int = 10,
    kid_subset_size: int = 1000,
    image_size: int = 0,
    holdout_fraction: float = folder.HOLDOUT_FRACTION,
    holdout_seed: int = folder.HOLDOUT_SEED,
) -> dict[str, float]:
    """``{"fid": ...}`` of two PATHs (or the sources ``sources.open_source`` made of them), plus
    ``"is_mean"``, ``"is_std"`` (``"is"``, on PATH_A's ``"logits_unbiased"``), ``"precision"``,
    ``"recall"`` (``"pr"``) and ``"kid_mean"``, ``"kid_std"`` (``"kid"``) when asked; PATH_A is
    the generated set. ``image_size``, ``holdout_fraction``, ``holdout_seed``: of image files
    (``sources.DataImages``; ``image_size`` 0 keeps each image's size)."""
    opened = [
        sources.open_source(path, data_dir, image_size, holdout_fraction, holdout_seed)
        if isinstance(path, (str, os.PathLike))
        else path
        for path in (path_a, path_b)
    ]
    if extractor is None and _needs_network(opened):
        raise ValueError("images need a network: pass --inception WEIGHTS.npz")
    keep = [[feature] if "pr" in metrics or "kid" in metrics else [] for _ in opened]
    if "is" in metrics:
        keep[0].append(ISC_FEATURE)
    gaussians, kept = [], []
    for source, names in zip(opened, keep):
        if isinstance(source, sources.Statistics):
            if names:
                raise ValueError(f"{source.path!r}: --metrics {','.join(metrics)} needs images")
            gaussians.append((source.mu, source.sigma))
            kept.append({})
        else:
            gaussian, arrays = measure(source, extractor, feature, names, progress)
            gaussians.append(gaussian)
            kept.append(arrays)
    results = {}
    if "is" in metrics:
        results["is_mean"], results["is_std"] = scores.inception_score(
            kept[0][ISC_FEATURE], splits=isc_splits
        )
    if "pr" in metrics:
        results["precision"], results["recall"] = scores.precision_recall(
            kept[0][feature], kept[1][feature]
        )
    if "kid" in metrics:
        results["kid_mean"], results["kid_std"] = scores.kernel_inception_distance(
            kept[0][feature], kept[1][feature], subset_size=kid_subset_size
        )
    (mu1, sigma1), (mu2, sigma2) = gaussians
    results["fid"] = frechet_distance(mu1, sigma1, mu2, sigma2)
    return results


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m attnjax.fid",
        description="FID (and IS, precision/recall, KID) of two image sets, as pytorch-fid.",
    )
    parser.add_argument("--inception", help="converted Inception weights (.npz)")
    parser.add_argument("--batch-size", type=int, default=50, help="images per step")
    parser.add_argument("--dims", type=int, default=2048, choices=DIMS, help="feature depth")
    parser.add_argument("--save-stats", action="store_true", help="write PATH's stats to OUT")
    parser.add_argument("--metrics", default="", help="comma-separated extras: is, pr, kid")
    parser.add_argument("--isc-splits", type=int, default=10, help="Inception Score splits")
    parser.add_argument("--kid-subset-size", type=int, default=1000, help="KID subset size")
    parser.add_argument("--data-dir", help="TFDS data dir (default $TFDS_DATA_DIR)")
    parser.add_argument(
        "--image-size",
        type=int,
        default=IMAGE_SIZE,
        help="folder:/filelist:/shards: images' central square resized to this side (default "
        f"{IMAGE_SIZE}, the Inception's input; a generator's image_size against its samples; "
        "0: as they are, one size)",
    )
    parser.add_argument(
        "--holdout-fraction",
        type=float,
        default=folder.HOLDOUT_FRACTION,
        help="KIND:PATH:test without split folders: the share a run held out (config.data's)",
    )
    parser.add_argument(
        "--holdout-seed",
        type=int,
        default=folder.HOLDOUT_SEED,
        help="KIND:PATH:test without split folders: the seed of the held-out share",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "path", nargs=2, help="folders, statistics .npz, tfds:NAME:SPLIT or folder:ROOT[:SPLIT]"
    )
    return parser


def _use_every_core() -> None:
    # One CPU device per core splits the batch: faster than one device for convolutional models
    # (benchmarks/results/xla_cpu_flags.md).
    from attnjax.ops.platform import cpu_cores
    from attnjax.parallel import data_parallel

    data_parallel.set_cpu_devices(cpu_cores())


def _run(args) -> list[str]:
    metrics = tuple(name for name in args.metrics.split(",") if name)
    unknown = sorted(set(metrics) - set(METRICS))
    if unknown:
        raise ValueError(f"--metrics {args.metrics!r}: unknown {unknown}; known {list(METRICS)}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be positive, got {args.batch_size}")
    if args.image_size < 0:
        raise ValueError(f"--image-size must be 0 (as is) or positive, got {args.image_size}")
    if not 0.0 < args.holdout_fraction < 1.0:
        raise ValueError(
            f"--holdout-fraction={args.holdout_fraction}: expected a share in (0, 1), as "
            "config.data.holdout_fraction"
        )
    opening = (args.data_dir, args.image_size, args.holdout_fraction, args.holdout_seed)
    # Every check on the paths before the network's weights are read: bad input fails at once.
    progress = not args.no_progress
    if args.save_stats:
        source, out = args.path
        if not out.endswith(".npz"):
            raise ValueError(f"--save-stats: OUT {out!r} must end in .npz")
        opened = sources.open_source(source, *opening)
        if isinstance(opened, sources.Statistics):
            raise ValueError(f"--save-stats: {source!r} holds statistics already, not images")
        if args.inception is None:
            raise ValueError("images need a network: pass --inception WEIGHTS.npz")
        if os.path.exists(out):
            raise ValueError(f"--save-stats: OUT {out!r} exists; not overwriting it")
        extractor = inception_extractor(args.inception, args.dims, args.batch_size)
        (mu, sigma), _ = measure(opened, extractor, str(args.dims), progress=progress)
        return [f"wrote {save_statistics(out, mu, sigma)}"]
    opened = [sources.open_source(path, *opening) for path in args.path]
    extractor = None
    if args.inception is not None and _needs_network(opened):
        extractor = inception_extractor(args.inception, args.dims, args.batch_size, "is" in metrics)
    results = evaluate(
        *opened,
        extractor,
        str(args.dims),
        metrics,
        args.data_dir,
        progress,
        args.isc_splits,
        args.kid_subset_size,
        args.image_size,
    )
    lines = []
    if "is" in metrics:
        lines.append(f"IS: {results['is_mean']} +- {results['is_std']}")
    if "pr" in metrics:
        lines += [f"precision: {results['precision']}", f"recall: {results['recall']}"]
    if "kid" in metrics:
        lines.append(f"KID: {results['kid_mean']} +- {results['kid_std']}")
    return [*lines, f"FID: {results['fid']}"]


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    compilation_cache.enable()
    collector.raise_thresholds()
    try:
        lines = _run(args)
    except (ValueError, OSError) as error:
        print(f"python -m attnjax.fid: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    _use_every_core()  # here, not in main(): a caller in-process keeps its own devices
    sys.exit(main())
