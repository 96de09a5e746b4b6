"""Time for the FID of 10,000 32 x 32 images on this CPU: ``python -m attnjax.fid`` against
pytorch-fid's ``calculate_fid_given_paths``, same weights, same files, same machine.

Both read one folder of PNG files (random pixels, seeded) and one statistics ``.npz`` (a random
full-rank Gaussian), resize every image to 299 x 299, run the FID Inception to its 2048
features and take the Frechet distance. Each side runs as its own process, timed from start to
end (imports, compilation and the matrix square root included), one after the other:

* attnjax: ``python -m attnjax.fid --inception W.npz FOLDER STATS.npz`` (one CPU device per
  core, batch 50);
* pytorch-fid: ``calculate_fid_given_paths`` (batch 50, its command's default data-loader
  workers, torch's default threads), its weight download replaced by the same random state dict.

Random weights: the speed of a network does not depend on its values. Prints a table and writes
``benchmarks/results/fid_cpu.json`` and ``fid_cpu.md``.

    .venv/bin/python benchmarks/fid_cpu.py [--num-images 10000]   # the issue's figure: 10,000
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

from attnjax.ops.platform import processor

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BATCH = 50

# pytorch-fid's calculate_fid_given_paths with its weight download replaced by a local file.
PYTORCH_FID = """
import os, sys
from unittest import mock
import torch
from attnjax.convert.common import make_torchvision_importable
make_torchvision_importable()
from pytorch_fid import fid_score, inception
weights, folder, stats, batch = sys.argv[1:5]
state = torch.load(weights, weights_only=True)
workers = min(len(os.sched_getaffinity(0)), 8)
with mock.patch.object(inception, "load_state_dict_from_url", lambda *a, **k: state):
    value = fid_score.calculate_fid_given_paths([folder, stats], int(batch), "cpu", 2048, workers)
print("FID:", value)
"""

# The random FID Inception, its state dict saved and converted.
WEIGHTS = """
import sys
import torch
sys.path.insert(0, "tests")
from attnjax.convert.common import make_torchvision_importable
make_torchvision_importable()
from helpers import random_fid_inception
torch.save(random_fid_inception().state_dict(), sys.argv[1])
"""


def _prepare(workdir: pathlib.Path, images: int) -> dict[str, str]:
    from PIL import Image

    from attnjax.metrics.statistics import save_statistics

    folder = workdir / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(images):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    basis = rng.standard_normal((2048, 2048)) / 2048**0.5
    stats = save_statistics(workdir / "stats.npz", rng.random(2048), basis @ basis.T)
    pth = workdir / "pt_inception.pth"
    subprocess.run([sys.executable, "-c", WEIGHTS, str(pth)], cwd=ROOT, check=True)
    npz = workdir / "inception.npz"
    convert = [sys.executable, "-m", "attnjax.convert.inception", str(pth), str(npz)]
    subprocess.run(convert, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return {"folder": str(folder), "stats": stats, "pth": str(pth), "npz": str(npz)}


def _timed(command: list[str]) -> tuple[float, float]:
    """Wall seconds of ``command`` and the FID of its last output line."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    return seconds, float(done.stdout.strip().splitlines()[-1].split()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", "--images", dest="images", type=int, default=10_000)
    parser.add_argument("--output", type=pathlib.Path, default=RESULTS / "fid_cpu.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        files = _prepare(pathlib.Path(workdir), args.images)
        ours = [sys.executable, "-m", "attnjax.fid", "--inception", files["npz"], "--no-progress"]
        ours += ["--batch-size", str(BATCH), files["folder"], files["stats"]]
        theirs = [sys.executable, "-c", PYTORCH_FID, files["pth"], files["folder"]]
        theirs += [files["stats"], str(BATCH)]
        rows = {}
        for name, command in (("attnjax", ours), ("pytorch-fid", theirs)):
            seconds, value = _timed(command)
            rows[name] = {"seconds": seconds, "images_per_second": args.images / seconds}
            rows[name]["fid"] = value
            print(f"{name:12s} {seconds:8.1f} s  {args.images / seconds:7.1f} img/s  FID {value}")
    import jax
    import torch

    ratio = rows["pytorch-fid"]["seconds"] / rows["attnjax"]["seconds"]
    result = {
        "images": args.images,
        "image_size": 32,
        "batch_size": BATCH,
        "dims": 2048,
        "processor": processor(),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "rows": rows,
        "speedup_over_pytorch_fid": ratio,
        "fid_relative_difference": abs(rows["attnjax"]["fid"] / rows["pytorch-fid"]["fid"] - 1),
    }
    print(f"attnjax is {ratio:.2f}x pytorch-fid's speed")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    args.output.with_suffix(".md").write_text(_markdown(result))
    print(f"wrote {args.output} and {args.output.with_suffix('.md')}")


def _markdown(result: dict) -> str:
    rows = "\n".join(
        f"| {name} | {row['seconds']:.0f} | {row['images_per_second']:.1f} | {row['fid']:.4f} |"
        for name, row in result["rows"].items()
    )
    return f"""# FID of {result["images"]:,} 32 x 32 images on CPU: attnjax against pytorch-fid

`python benchmarks/fid_cpu.py --num-images {result["images"]}` (JSON:
[fid_cpu.json](fid_cpu.json)) on {result["cpu_cores"]} cores of an {result["processor"]},
jax {result["jax"]}, torch {result["torch"]}. Each side reads the same folder of PNGs and the
same statistics file, runs the same random FID Inception (299 x 299, 2048 features, batch
{result["batch_size"]}) and takes the Frechet distance, as its own process timed from start to
end:

| implementation | seconds | images per second | FID |
|---|---|---|---|
{rows}

attnjax takes {1 / result["speedup_over_pytorch_fid"]:.2f}x pytorch-fid's time
({result["speedup_over_pytorch_fid"]:.2f}x its speed); the two FIDs differ by
{result["fid_relative_difference"]:.1e} relative.
"""


if __name__ == "__main__":
    main()
