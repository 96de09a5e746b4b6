"""Whether PyTorch's CUDA build is as fast on the CPU as its CPU build: the check behind the
peer of ``compare_torch.py`` on the newest JAX (envs/newest.sh, ``NEWEST_PART=compare-torch``),
where Python 3.13 has no CPU-only wheel and the CUDA build stands in.

    python benchmarks/torch_builds.py --peer DIR [--rounds 3]

``DIR`` holds the other build, installed with ``pip install --no-deps --target DIR`` (torch and
the NVIDIA libraries of envs/torch-peer-py313.txt, built for this Python); the environment's own
torch is the first build. The torch steps of three of ``compare_torch.py``'s rows (``ROWS``),
built and timed as that script times them (one warm-up, the median of 5), under the glibc
tunables every command starts with. Each build runs in fresh processes, alternating, for
``--rounds`` rounds. Writes benchmarks/results/torch_builds.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from attnjax import huge_pages

if __name__ == "__main__":
    # As compare_torch.py starts; the measuring processes inherit the tunables.
    huge_pages.restart_with_huge_pages()

from attnjax.ops.platform import processor  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ROWS = ("sdpa_1024", "vit_ti16_train", "vqgan_autoencoder")
REPEATS = 5


def measure() -> dict:
    """One process's median torch step (ms) per row of ``ROWS``, with the build's version."""
    import compare_torch
    import torch
    from timing import median_seconds
    from torch_vs_jax import use_devices

    use_devices(0)  # the rows build their attnjax side too, as compare_torch.py runs it
    torch.set_num_threads(os.cpu_count())
    out = {"torch": torch.__version__}
    with tempfile.TemporaryDirectory() as directory:
        table = compare_torch.rows(False, directory)
        for name in ROWS:
            _, _, torch_step = table[name]()
            torch_step()  # warm-up
            out[f"{name}_ms"] = 1e3 * median_seconds(torch_step, REPEATS)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peer", help="a directory holding the other torch build")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return
    if not args.peer or not (pathlib.Path(args.peer) / "torch").is_dir():
        raise SystemExit(f"--peer {args.peer!r}: expected a directory with a torch package in it")
    runs = []
    for _ in range(args.rounds):
        for path in ("", str(pathlib.Path(args.peer).resolve())):
            line = subprocess.run(
                [sys.executable, __file__, "--measure"],
                env=dict(os.environ, PYTHONPATH=path),
                check=True,
                capture_output=True,
                text=True,
            ).stdout.splitlines()[-1]
            runs.append(json.loads(line))
            print(line, flush=True)
    out = RESULTS / "torch_builds.json"
    meta = {"cpu": processor(), "cores": os.cpu_count(), "glibc_tunables": huge_pages.in_effect()}
    out.write_text(json.dumps({"machine": meta, "runs": runs}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
