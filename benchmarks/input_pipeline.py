"""The input pipeline's speed: decode + crop + flip + normalise of JPEG files into batches of
256 x 256 images, attnjax (grain over a folder, and over its ArrayRecord shards) against
torchvision's ``ImageFolder`` + ``DataLoader``, with 0, 1 and 2 workers each (attnjax: grain's
read threads or worker processes; torchvision: DataLoader's worker processes).

    python benchmarks/input_pipeline.py --num-images 1024

The files (ImageNet-like 500 x 375 JPEGs of quality 90, in 8 class folders) are generated once
into ``--files`` and reused. Both sides apply taming's crop: the shorter side resized to 256
(bilinear), a random 256 square, a random flip, then (x / 255 - 0.5) / 0.5 into float32 batches of
``--batch-size``. Each setting is timed from the start of iteration to its last batch (workers'
start-up included: a run pays it too) over every image once, the best of ``--repeats`` (run in
turns, every side once per round); the first batch is also timed apart, and the rate after it.
Results: benchmarks/results/input_pipeline.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
from absl import flags
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import configs  # noqa: E402
from attnjax import data  # noqa: E402
from attnjax.data import prepare  # noqa: E402
from attnjax.ops.platform import processor  # noqa: E402

SIZE, WIDTH, HEIGHT, CLASSES = 256, 500, 375, 8
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_files(root: str, number: int) -> None:
    """``number`` photo-like JPEGs (smooth gradients with noise: sizes of real photos' order)."""
    done = os.path.join(root, f".{number}.done")
    if os.path.exists(done):
        return
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH].astype(np.float32)
    for i in range(number):
        folder = os.path.join(root, "train", f"class{i % CLASSES}")
        os.makedirs(folder, exist_ok=True)
        colour = rng.uniform(0, 255, (3,))
        slope = rng.uniform(-0.3, 0.3, (2, 3))
        pixels = colour + x[..., None] * slope[0] + y[..., None] * slope[1]
        pixels += rng.normal(0, 12, pixels.shape)
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
        image.save(os.path.join(folder, f"{i:06d}.jpg"), quality=90)
    for c in range(CLASSES):  # an eval split, which the folder source requires
        folder = os.path.join(root, "test", f"class{c}")
        os.makedirs(folder, exist_ok=True)
        Image.new("RGB", (WIDTH, HEIGHT)).save(os.path.join(folder, "0.jpg"))
    open(done, "w").close()


def attnjax_config(name: str, processes: int, threads: int, batch_size: int):
    config = configs.load("vqgan_folder")
    config.data.update(name=name, image_size=SIZE, train_crop="random", flip=True)
    config.data.update(worker_count=processes, read_threads=threads)
    config.batch_size = batch_size
    return config


def time_attnjax(name, processes, threads, batch_size, number) -> tuple[float, float]:
    """(seconds to the first batch, seconds for ``number`` images)."""
    config = attnjax_config(name, processes, threads, batch_size)
    start = time.perf_counter()
    iterator = data.make_iterator(data.make_datasets(config).train, config.data)
    batch = next(iterator)
    first = time.perf_counter() - start
    for _ in range(number // batch_size - 1):
        batch = next(iterator)
    assert batch["image"].shape == (batch_size, SIZE, SIZE, 3)
    total = time.perf_counter() - start
    del iterator
    return first, total


def time_torchvision(root: str, workers: int, batch_size: int, number: int):
    import torch
    from torchvision import datasets, transforms

    transform = transforms.Compose(
        [
            transforms.Resize(SIZE),
            transforms.RandomCrop(SIZE),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ]
    )
    start = time.perf_counter()
    folder = datasets.ImageFolder(os.path.join(root, "train"), transform=transform)
    loader = torch.utils.data.DataLoader(
        folder, batch_size=batch_size, shuffle=True, num_workers=workers, drop_last=True
    )
    iterator = iter(loader)
    images, _ = next(iterator)
    first = time.perf_counter() - start
    for _ in range(number // batch_size - 1):
        images, _ = next(iterator)
    assert tuple(images.shape) == (batch_size, 3, SIZE, SIZE)
    total = time.perf_counter() - start
    del iterator
    return first, total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-images", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="0,1,2")
    parser.add_argument("--files", default="/tmp/attnjax_input_pipeline")
    args = parser.parse_args(argv)
    flags.FLAGS.mark_as_parsed()  # grain's worker processes read absl flags

    from attnjax.convert.common import make_torchvision_importable

    make_torchvision_importable()
    import torch

    torch.set_num_threads(1)  # as DataLoader's workers do: one image at a time per process
    load_before = os.getloadavg()[0]
    write_files(args.files, args.num_images)
    shards = os.path.join(args.files, f"shards_{args.num_images}")
    prepare.prepare(f"folder:{args.files}", shards, records_per_shard=256)
    number = args.num_images - args.num_images % args.batch_size
    folder = f"folder:{args.files}"
    sides = {
        "attnjax folder": lambda w: time_attnjax(folder, w, 0, args.batch_size, number),
        "attnjax folder, threads": lambda w: time_attnjax(folder, 0, w, args.batch_size, number),
        "attnjax shards, threads": lambda w: time_attnjax(
            f"shards:{shards}", 0, w, args.batch_size, number
        ),
        "torchvision ImageFolder": lambda w: time_torchvision(
            args.files, w, args.batch_size, number
        ),
    }
    rows = []
    for workers in (int(w) for w in args.workers.split(",")):
        # Repeats interleaved, every side once per round: load from other jobs hits all alike.
        runs = {side: [] for side in sides}
        for _ in range(args.repeats):
            for side, run in sides.items():
                runs[side].append(run(workers))
        for side in sides:
            first, total = min(runs[side], key=lambda r: r[1])
            steady = (number - args.batch_size) / (total - first)
            rows.append(
                dict(
                    side=side,
                    workers=workers,
                    images_per_s=number / total,
                    steady_images_per_s=steady,
                    first_batch_s=first,
                )
            )
            print(f"{side:24s} workers={workers}: {number / total:7.1f} images/s", flush=True)
    machine = f"{processor()}, {os.cpu_count()} cores"
    versions = {m: sys.modules[m].__version__ for m in ("grain", "PIL", "torch", "torchvision")}
    result = dict(
        machine=machine,
        python=platform.python_version(),
        versions=versions,
        num_images=number,
        batch_size=args.batch_size,
        image=f"{WIDTH}x{HEIGHT} JPEG -> {SIZE}x{SIZE}",
        rows=rows,
    )
    result["conditions"] = (
        f"load average {load_before:.1f} before the run, {os.getloadavg()[0]:.1f} at its end "
        "(1 minute; above 2 on 2 cores means another job was running)"
    )
    with open(os.path.join(RESULTS, "input_pipeline.json"), "w") as file:
        json.dump(result, file, indent=1)
    write_table(result)
    return 0


def write_table(result: dict) -> None:
    by = {(r["side"], r["workers"]): r for r in result["rows"]}
    workers = sorted({r["workers"] for r in result["rows"]})
    lines = [
        "# Input pipeline: attnjax (grain) against torchvision's ImageFolder + DataLoader",
        "",
        f"`python benchmarks/input_pipeline.py --num-images {result['num_images']}` on "
        f"{result['machine']} (JSON: [input_pipeline.json](input_pipeline.json)); "
        f"{result['image']}, batches of {result['batch_size']}, "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items())
        + ".",
        "",
        "Images per second (decode, resize the shorter side to 256, random 256 crop, flip, "
        "normalise into float32 batches; the best of the repeats), from the start of listing the "
        "folder to the last batch, start-up and worker start-up included: what a user waits for. "
        "attnjax's workers are grain's read threads (`config.data.read_threads`) or worker "
        "processes (`worker_count`); torchvision's are DataLoader worker processes.",
        "",
        "| workers | attnjax folder, processes | attnjax folder, threads | attnjax shards, "
        "threads | torchvision | best attnjax / torchvision |",
        "|---|---|---|---|---|---|",
    ]
    sides = ("attnjax folder", "attnjax folder, threads", "attnjax shards, threads")
    for w in workers:
        rates = [by[(side, w)]["images_per_s"] for side in sides]
        t = by[("torchvision ImageFolder", w)]["images_per_s"]
        cells = " | ".join(f"{rate:.1f}" for rate in rates)
        lines.append(f"| {w} | {cells} | {t:.1f} | {max(rates) / t:.2f}x |")
    lines += [
        "",
        "At 0 workers both attnjax folder columns run one pipeline (no threads, no processes): "
        "their difference is the run-to-run noise of a shared machine.",
    ]
    for title, key, digits in (
        ("Steady state: images per second after the first batch (start-up left out):",
         "steady_images_per_s", 1),
        ("Seconds to the first batch (listing, header reads, worker start-up):",
         "first_batch_s", 2),
    ):  # fmt: skip
        lines += ["", title, "", "| workers | " + " | ".join(sides) + " | torchvision |"]
        lines.append("|---|---|---|---|---|")
        for w in workers:
            values = [by[(side, w)][key] for side in (*sides, "torchvision ImageFolder")]
            lines.append(f"| {w} | " + " | ".join(f"{v:.{digits}f}" for v in values) + " |")
    lines += ["", f"Conditions: {result.get('conditions', '')}"]
    with open(os.path.join(RESULTS, "input_pipeline.md"), "w") as file:
        file.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
