"""Whether PyTorch's CUDA build is as fast on the CPU as its CPU build: the check behind the
peer of ``compare_torch.py`` on the newest JAX (envs/newest.sh, ``NEWEST_PART=compare-torch``),
where Python 3.13 has no CPU-only wheel and the CUDA build stands in.

    python benchmarks/torch_builds.py --peer DIR [--rounds 2]

``DIR`` holds the other build, installed with ``pip install --no-deps --target DIR`` (torch and
the NVIDIA libraries of envs/torch-peer-py313.txt, built for this Python); the environment's own
torch is the first build. Three of ``compare_torch.py``'s torch steps, on 2 threads, under the
glibc tunables every command starts with: causal SDPA forward + backward (1 x 8 x 1024 x 64),
timm's ViT Ti/16 AdamW step (batch 8, 224 px) and taming's encoder + decoder (ch 64, 32 px,
batch 16) with Adam. Each build runs in fresh processes, alternating, for ``--rounds`` rounds;
each process reports the median of its steps. Writes benchmarks/results/torch_builds.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

from attnjax import huge_pages
from attnjax.ops.platform import processor

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def measure() -> dict:
    """One process's medians (ms) for the three steps, with the build's version."""
    import torch
    from taming.modules.diffusionmodules.model import Decoder, Encoder
    from timing import median_seconds

    from attnjax.convert.common import make_torchvision_importable

    make_torchvision_importable()
    from timm.models.vision_transformer import VisionTransformer

    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)

    def timed(step, repeats):
        step(), step()  # warm-up: oneDNN picks and caches its kernels
        return 1e3 * median_seconds(step, repeats)

    q, k, v = (torch.randn(1, 8, 1024, 64, requires_grad=True) for _ in range(3))

    def sdpa():
        for t in (q, k, v):
            t.grad = None
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    vit = VisionTransformer(embed_dim=192, depth=12, num_heads=3, num_classes=1000)
    vit_opt = torch.optim.AdamW(vit.parameters(), 1e-4)
    images, labels = torch.randn(8, 3, 224, 224), torch.randint(0, 1000, (8,))

    def vit_step():
        vit_opt.zero_grad()
        torch.nn.functional.cross_entropy(vit(images), labels).backward()
        vit_opt.step()

    shape = dict(ch=64, out_ch=3, ch_mult=(1, 1, 2, 2), num_res_blocks=2, attn_resolutions=(8,))
    shape |= dict(dropout=0.0, in_channels=3, resolution=32, z_channels=64, double_z=False)
    encoder, decoder = Encoder(**shape), Decoder(**shape)
    ae_opt = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], 1e-4)
    small = torch.randn(16, 3, 32, 32)

    def autoencoder():
        ae_opt.zero_grad()
        ((decoder(encoder(small)) - small) ** 2).mean().backward()
        ae_opt.step()

    return {
        "torch": torch.__version__,
        "sdpa_1024_ms": timed(sdpa, 9),
        "vit_ti16_train_ms": timed(vit_step, 5),
        "conv_autoencoder_ms": timed(autoencoder, 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peer", help="a directory holding the other torch build")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return
    if not args.peer or not (pathlib.Path(args.peer) / "torch").is_dir():
        raise SystemExit(f"--peer {args.peer!r}: expected a directory with a torch package in it")
    own = os.environ.get("GLIBC_TUNABLES", "")
    tunables = huge_pages.tunables_with_huge_pages(own) or own
    runs = []
    for _ in range(args.rounds):
        for path in ("", str(pathlib.Path(args.peer).resolve())):
            env = dict(os.environ, PYTHONPATH=path, GLIBC_TUNABLES=tunables)
            line = subprocess.run(
                [sys.executable, __file__, "--measure"],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout.splitlines()[-1]
            runs.append(json.loads(line))
            print(line, flush=True)
    out = RESULTS / "torch_builds.json"
    meta = {"cpu": processor(), "cores": os.cpu_count(), "glibc_tunables": tunables}
    out.write_text(json.dumps({"machine": meta, "runs": runs}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
