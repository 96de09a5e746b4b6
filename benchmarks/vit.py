"""ViT speed and memory: attnjax (scan_layers / remat settings) vs timm on the same weights.

    python benchmarks/vit.py [--variant Ti/16] [--image-size 224] [--batch 8] [--repeats 5]
                             [--dtype float32|bfloat16]

A timm ``VisionTransformer`` of the variant's shape is built with random weights and converted with
``attnjax.convert.timm.vit_from_timm``; then for each attnjax setting (``scan_layers`` x ``remat``)
it measures the compile time of the jitted forward and of a cross-entropy forward+backward, their
steady-state times, and XLA's temporary buffer size (activation memory), next to timm's eager
PyTorch forward and forward+backward on the same weights and images. The first row also checks that
the logits agree. Prints a table and writes ``benchmarks/results/vit_<platform>.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_seconds
from tqdm import tqdm

from attnjax.convert.common import make_torchvision_importable
from attnjax.convert.timm import vit_from_timm
from attnjax.models import vit


def bench_attnjax(model, variables, images, labels, repeats: int) -> dict:
    def loss(params):
        logits = model.apply({"params": params}, images)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    calls = {
        "forward": (jax.jit(lambda p: model.apply({"params": p}, images)), variables["params"]),
        "forward_backward": (jax.jit(jax.grad(loss)), variables["params"]),
    }
    result = {}
    for name, (fn, params) in calls.items():
        start = time.perf_counter()
        compiled = fn.lower(params).compile()
        result[f"{name}_compile_s"] = time.perf_counter() - start
        jax.block_until_ready(compiled(params))
        result[f"{name}_ms"] = 1e3 * median_seconds(
            lambda: jax.block_until_ready(compiled(params)), repeats
        )
        memory = compiled.memory_analysis()
        result[f"{name}_temp_mib"] = (
            memory.temp_size_in_bytes / 2**20 if memory is not None else float("nan")
        )
    result["logits"] = np.asarray(calls["forward"][0](variables["params"]))
    return result


def bench_timm(reference, images_nchw, labels, repeats: int, dtype) -> dict:
    import torch
    import torch.nn.functional as F

    reference = reference.to(dtype)
    images_nchw = images_nchw.to(dtype)

    def forward():
        with torch.no_grad():
            return reference(images_nchw)

    def forward_backward():
        reference.zero_grad()
        F.cross_entropy(reference(images_nchw).float(), labels).backward()

    forward()
    forward_backward()
    return {
        "forward_ms": 1e3 * median_seconds(forward, repeats),
        "forward_backward_ms": 1e3 * median_seconds(forward_backward, repeats),
        "logits": forward().float().numpy(),
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", default="Ti/16")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()

    import torch

    make_torchvision_importable()  # timm imports torchvision
    from timm.models.vision_transformer import VisionTransformer

    shape = vit.variant_config(args.variant)
    torch.manual_seed(0)
    reference = VisionTransformer(
        img_size=args.image_size,
        patch_size=shape["patch_size"],
        embed_dim=shape["width"],
        depth=shape["depth"],
        num_heads=shape["num_heads"],
        mlp_ratio=shape["mlp_dim"] / shape["width"],
        num_classes=args.num_classes,
    ).eval()
    rng = np.random.default_rng(0)
    images = rng.standard_normal((args.batch, args.image_size, args.image_size, 3)).astype(
        np.float32
    )
    labels = rng.integers(0, args.num_classes, args.batch)
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else None

    rows = []
    settings = [(scan, remat) for scan in (False, True) for remat in (False, True)]
    for scan, remat in tqdm(settings, desc="attnjax settings"):
        model, variables = vit_from_timm(reference, scan_layers=scan, remat=remat, dtype=dtype)
        result = bench_attnjax(
            model, variables, jnp.asarray(images), jnp.asarray(labels), args.repeats
        )
        rows.append({"impl": f"attnjax scan={scan} remat={remat}", **result})
    torch_dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    images_nchw = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
    rows.append(
        {
            "impl": "timm (torch eager)",
            **bench_timm(
                reference, images_nchw, torch.from_numpy(labels), args.repeats, torch_dtype
            ),
        }
    )

    expected = rows[-1].pop("logits")
    for row in rows[:-1]:
        logits = row.pop("logits")
        row["max_abs_logit_diff_vs_timm"] = float(np.abs(logits - expected).max())

    device = f"{jax.default_backend()} ({platform.processor() or platform.machine()})"
    print(
        f"\nViT {args.variant} at {args.image_size}, batch {args.batch}, {args.dtype}, device "
        f"{device}"
    )
    header = (
        f"{'implementation':34s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} {'compile s (fwd/bwd)':>20s} "
        f"{'temp MiB (fwd/bwd)':>19s} {'|dlogits|':>10s}"
    )
    print(header)
    for row in rows:
        compile_s = (
            f"{row['forward_compile_s']:.1f} / {row['forward_backward_compile_s']:.1f}"
            if "forward_compile_s" in row
            else "-"
        )
        memory = (
            f"{row['forward_temp_mib']:.0f} / {row['forward_backward_temp_mib']:.0f}"
            if "forward_temp_mib" in row
            else "-"
        )
        diff = (
            f"{row['max_abs_logit_diff_vs_timm']:.1e}"
            if "max_abs_logit_diff_vs_timm" in row
            else "-"
        )
        print(
            f"{row['impl']:34s} {row['forward_ms']:9.1f} {row['forward_backward_ms']:11.1f} "
            f"{compile_s:>20s} {memory:>19s} {diff:>10s}"
        )

    out_dir = pathlib.Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"vit_{jax.default_backend()}.json"
    path.write_text(json.dumps({"args": vars(args), "device": device, "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
