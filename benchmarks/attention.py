"""Attention speed and memory: attnjax vs PyTorch's scaled_dot_product_attention, same inputs.

    python benchmarks/attention.py [--lengths 128 512 1024] [--batch 8] [--heads 8] [--head-dim 64]

For each sequence length it times forward and forward+backward of
  * attnjax fused path (``jax.nn.dot_product_attention``: XLA on CPU, cuDNN on a GPU for bf16/f16),
  * attnjax explicit path (einsum + softmax, what runs when weights or dropout are requested),
  * attnjax blocked path (``blocked_attention``: online softmax over key tiles, linear memory),
  * torch ``F.scaled_dot_product_attention`` (eager, the backend PyTorch picks on this device),
and reports XLA's temporary buffer size per compiled call (the memory the scores matrix costs).
Prints a table and writes ``benchmarks/results/attention_<platform>.json``. Compile time is
excluded from the steady-state numbers and reported on its own.

    python benchmarks/attention.py --peak-memory 16384 [--batch 1]

runs one blocked causal forward+backward at that length in a fresh process and reports its peak
resident memory (``getrusage`` max RSS), XLA's temporary buffers and the step time.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import resource
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_seconds

from attnjax.ops.attention import dot_product_attention


def bench_jax(q, k, v, implementation: str, repeats: int) -> dict:
    def loss(q, k, v):
        return jnp.sum(
            dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
        )

    forward = jax.jit(
        lambda q, k, v: dot_product_attention(
            q, k, v, is_causal=True, implementation=implementation
        )
    )
    backward = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    result = {}
    for name, fn in (("forward", forward), ("forward_backward", backward)):
        start = time.perf_counter()
        compiled = fn.lower(q, k, v).compile()
        jax.block_until_ready(compiled(q, k, v))
        result[f"{name}_compile_s"] = time.perf_counter() - start
        result[f"{name}_ms"] = 1e3 * median_seconds(
            lambda: jax.block_until_ready(compiled(q, k, v)), repeats
        )
        memory = compiled.memory_analysis()
        result[f"{name}_temp_mib"] = (
            memory.temp_size_in_bytes / 2**20 if memory is not None else float("nan")
        )
    return result


def bench_torch(q, k, v, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    # torch wants [batch, heads, length, head_dim]; ours is [batch, length, heads, head_dim].
    tq, tk, tv = (torch.from_numpy(np.array(x)).transpose(1, 2).contiguous() for x in (q, k, v))

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

    leaves = [t.clone().requires_grad_(True) for t in (tq, tk, tv)]

    def forward_backward():
        for t in leaves:
            t.grad = None
        F.scaled_dot_product_attention(*leaves, is_causal=True).sum().backward()

    forward(), forward_backward()  # warm-up
    return {
        "threads": torch.get_num_threads(),
        "forward_ms": 1e3 * median_seconds(forward, repeats),
        "forward_backward_ms": 1e3 * median_seconds(forward_backward, repeats),
    }


def peak_memory(length: int, batch: int, heads: int, head_dim: int) -> dict:
    """One blocked causal fwd+bwd at ``length`` in this process: peak RSS, XLA temp, time."""
    shape = (batch, length, heads, head_dim)
    q, k, v = (jax.random.normal(jax.random.key(i), shape, jnp.float32) for i in range(3))
    jax.block_until_ready((q, k, v))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    result = bench_jax(q, k, v, "blocked", repeats=1)
    result.update(
        length=length,
        batch=batch,
        heads=heads,
        head_dim=head_dim,
        inputs_mib=3 * np.prod(shape) * 4 / 2**20,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
        rss_before_mib=rss_before,
        explicit_scores_mib=batch * heads * length * length * 4 / 2**20,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--peak-memory",
        type=int,
        default=None,
        metavar="LENGTH",
        help="measure the blocked path's peak memory at LENGTH in a fresh process",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--out",
        default=None,
        help="JSON path (default benchmarks/results/attention_<platform>.json)",
    )
    args = parser.parse_args()

    if args.peak_memory and args.child:
        print(json.dumps(peak_memory(args.peak_memory, args.batch, args.heads, args.head_dim)))
        return
    if args.peak_memory:
        # A fresh process, so max RSS holds this run alone.
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                "--peak-memory",
                str(args.peak_memory),
                "--batch",
                str(args.batch),
                "--heads",
                str(args.heads),
                "--head-dim",
                str(args.head_dim),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        result = json.loads(child.stdout.strip().splitlines()[-1])
        print(
            f"blocked causal fwd+bwd, {args.batch} x {args.heads} heads x {args.peak_memory} x "
            f"{args.head_dim} float32: {result['forward_backward_ms'] / 1e3:.1f} s (compile "
            f"{result['forward_backward_compile_s']:.1f} s), peak RSS {result['peak_rss_mib']:.0f} "
            "MiB "
            f"(process before the call {result['rss_before_mib']:.0f} MiB), XLA temp "
            f"{result['forward_backward_temp_mib']:.0f} MiB; the explicit path's scores alone: "
            f"{result['explicit_scores_mib']:.0f} MiB"
        )
        out = pathlib.Path(
            args.out
            or pathlib.Path(__file__).parent
            / "results"
            / f"attention_peak_memory_{jax.default_backend()}.json"
        )
        out.write_text(json.dumps(result, indent=2))
        print(f"saved {out}")
        return

    device = jax.devices()[0]
    rows = []
    for length in args.lengths:
        rng = np.random.default_rng(length)
        shape = (args.batch, length, args.heads, args.head_dim)
        q, k, v = (jnp.asarray(rng.standard_normal(shape, dtype=np.float32)) for _ in range(3))
        row = {
            "length": length,
            "batch": args.batch,
            "heads": args.heads,
            "head_dim": args.head_dim,
        }
        for implementation in ("xla", "explicit", "blocked"):
            for key, value in bench_jax(q, k, v, implementation, args.repeats).items():
                row[f"attnjax_{implementation}_{key}"] = value
        for key, value in bench_torch(q, k, v, args.repeats).items():
            row[f"torch_{key}"] = value
        rows.append(row)

    header = (
        f"{'L':>6} | {'fwd ms: fused':>13} {'explicit':>9} {'blocked':>8} {'torch':>8} | "
        f"{'fwd+bwd ms: fused':>17} {'explicit':>9} {'blocked':>8} {'torch':>8} | "
        f"{'XLA temp MiB: fused':>19} {'explicit':>9} {'blocked':>8}"
    )
    print(
        f"float32 causal attention, batch {args.batch}, heads {args.heads}, head_dim "
        f"{args.head_dim}, on {device.device_kind}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['length']:>6} | {r['attnjax_xla_forward_ms']:>13.2f} "
            f"{r['attnjax_explicit_forward_ms']:>9.2f} "
            f"{r['attnjax_blocked_forward_ms']:>8.2f} {r['torch_forward_ms']:>8.2f} | "
            f"{r['attnjax_xla_forward_backward_ms']:>17.2f} "
            f"{r['attnjax_explicit_forward_backward_ms']:>9.2f} "
            f"{r['attnjax_blocked_forward_backward_ms']:>8.2f} "
            f"{r['torch_forward_backward_ms']:>8.2f} | "
            f"{r['attnjax_xla_forward_backward_temp_mib']:>19.1f} "
            f"{r['attnjax_explicit_forward_backward_temp_mib']:>9.1f} "
            f"{r['attnjax_blocked_forward_backward_temp_mib']:>8.1f}"
        )

    out = pathlib.Path(
        args.out or pathlib.Path(__file__).parent / "results" / f"attention_{device.platform}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "machine": platform.machine(),
        "devices": jax.local_device_count(),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
