"""attnjax (jit) against PyTorch (eager) on the same workloads and weights, in one process.

    python benchmarks/compare_torch.py [--rows sdpa,vit_cifar_train] [--quick] [--repeats 5]

Each row builds the PyTorch reference (torch, timm, taming-transformers), converts its weights
with ``attnjax.convert`` where a converter exists, and times one step on each side: the
median of ``--repeats`` steps after one warm-up step. attnjax's compile time is reported apart.
torch runs with one intra-op thread per core (CUDA when available, as JAX then uses its GPU).
Peak memory per row: XLA's temporary buffers of the compiled step (``memory_analysis``) and the
process's resident-set growth during the row (``getrusage``; torch's allocations are in it).
Prints a table and writes ``benchmarks/results/compare_torch_<platform>.json`` with the machine
(CPU model, cores, jax/torch versions). ``--quick`` shrinks repeats and the largest rows.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import tempfile

from attnjax import huge_pages

if __name__ == "__main__":
    # As train.py starts (both sides of a row share the process, so torch runs under it too).
    huge_pages.restart_with_huge_pages()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from rows_transformers import gpt_sample, gpt_train, mha, sdpa, vit_row  # noqa: E402
from rows_vqgan import vqgan_autoencoder, vqgan_gan_step  # noqa: E402
from timing import median_seconds  # noqa: E402
from torch_vs_jax import add_cpu_devices_flag, device, use_devices  # noqa: E402

from attnjax import xla_cpu  # noqa: E402
from attnjax.convert.common import make_torchvision_importable  # noqa: E402
from attnjax.ops.platform import processor  # noqa: E402

make_torchvision_importable()  # timm and lpips import torchvision


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def rows(quick, directory):
    """Row name -> thunk building (description, attnjax step, torch step)."""
    return {
        "sdpa_1024": lambda: sdpa(1024),
        "sdpa_4096": lambda: sdpa(1024 if quick else 4096),
        "mha": mha,
        "vit_cifar_train": lambda: vit_row("cifar", 32, 32 if quick else 128, True, 10),
        "vit_cifar_infer": lambda: vit_row("cifar", 32, 64 if quick else 256, False, 10),
        "vit_ti16_train": lambda: vit_row("Ti/16", 224, 2 if quick else 8, True, 1000),
        "vit_b16_infer": lambda: vit_row("B/16", 224, 2 if quick else 8, False, 1000),
        "vit_b16_train": lambda: vit_row("B/16", 224, 2 if quick else 8, True, 1000),
        "vqgan_autoencoder": lambda: vqgan_autoencoder(4 if quick else 16),
        "vqgan_gan_step": lambda: vqgan_gan_step(4 if quick else 16, directory),
        "gpt_train": lambda: gpt_train(4 if quick else 16, 64 if quick else 256),
        "gpt_sample": lambda: gpt_sample(4 if quick else 16, 32 if quick else 256),
    }


def machine() -> dict:
    return {
        "cpu": processor(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "jax_device": jax.devices()[0].device_kind,
        "jax_device_count": jax.device_count(),
        "xla_flags": xla_cpu.in_effect(),
        "glibc_tunables": huge_pages.in_effect(),
        "torch": torch.__version__,
        "torch_device": device() if device() == "cpu" else torch.cuda.get_device_name(),
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    parser.add_argument(
        "--quick", action="store_true", help="small sizes and 2 repeats: a smoke run"
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=None)
    add_cpu_devices_flag(parser)
    args = parser.parse_args()
    use_devices(args.cpu_devices)
    torch.set_num_threads(os.cpu_count())
    repeats = args.repeats or (2 if args.quick else 5)

    meta = machine()
    out = pathlib.Path(
        args.out
        or pathlib.Path(__file__).parent / "results" / f"compare_torch_{jax.default_backend()}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as directory:
        table = rows(args.quick, directory)
        names = [n for n in args.rows.split(",") if n] or list(table)
        unknown = sorted(set(names) - set(table))
        if unknown:
            raise ValueError(f"--rows: unknown rows {unknown}; expected names from {sorted(table)}")
        for name in names:
            rss_before = _rss_mib()
            description, jax_step, torch_step = table[name]()
            jax_step(), torch_step()  # warm-up
            jax_ms, torch_ms = (
                1e3 * median_seconds(jax_step, repeats),
                1e3 * median_seconds(torch_step, repeats),
            )
            row = dict(
                row=name,
                workload=description,
                attnjax_ms=jax_ms,
                torch_ms=torch_ms,
                speedup=torch_ms / jax_ms,
                attnjax_devices=jax_step.devices,
                attnjax_compile_s=jax_step.compile_s,
                attnjax_xla_temp_mib=jax_step.temp_mib,
                rss_growth_mib=_rss_mib() - rss_before,
            )
            results.append(row)
            # Written after every row, so an interrupted run keeps the rows it finished.
            out.write_text(
                json.dumps(
                    {"machine": meta, "quick": args.quick, "repeats": repeats, "rows": results},
                    indent=2,
                )
            )
            print(
                f"{name:18s} attnjax {jax_ms:9.1f} ms  torch {torch_ms:9.1f} ms  "
                f"torch/attnjax {row['speedup']:5.2f}  ({jax_step.devices} device(s), compile "
                f"{jax_step.compile_s:.1f} s)",
                flush=True,
            )

    print(
        f"\nattnjax jit vs torch eager on {meta['cpu']} ({meta['cores']} cores, torch threads "
        f"{meta['torch_threads']}), jax {meta['jax']} {meta['jax_backend']}, torch {meta['torch']} "
        f"{device()}; median of {repeats} after warm-up\n"
    )
    print(
        "| workload | attnjax ms | torch ms | torch / attnjax | attnjax devices | compile s "
        "| XLA temp MiB | RSS growth MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['workload']} | {r['attnjax_ms']:.1f} | {r['torch_ms']:.1f} | {r['speedup']:.2f} "
            f"| {r['attnjax_devices']} | {r['attnjax_compile_s']:.1f} "
            f"| {r['attnjax_xla_temp_mib']:.0f} | {r['rss_growth_mib']:.0f} |"
        )
    speedups = [r["speedup"] for r in results]
    print(f"\ngeometric mean torch / attnjax: {float(np.exp(np.mean(np.log(speedups)))):.2f}")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
