"""The VQGAN rows' 3x3 convolutions one by one: XLA against PyTorch, forward and backward.

    python benchmarks/conv_layers.py [--batch 16] [--repeats 10]

The shapes are those of ``compare_torch.py``'s VQGAN rows (taming's Encoder/Decoder at 32 px,
ch 64, ch_mult (1, 2, 2)). For each: XLA's forward, input gradient and kernel gradient (each
jitted alone, NHWC/HWIO), the three in one program as a train step runs them (XLA schedules and
fuses them together: the one program, not the sum, is what compares with torch), and torch's
forward and forward+backward (NCHW, its default CPU
backends, then with NNPACK off and with oneDNN off, which shows which of its kernels wins).
Prints a table and writes ``benchmarks/results/conv_layers_<platform>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import jax
import numpy as np
import torch
from jax import lax
from timing import median_seconds

# (height = width, c_in, c_out, how many the autoencoder has)
SHAPES = [
    (32, 64, 64, 9),
    (32, 128, 64, 1),
    (32, 128, 128, 1),
    (16, 64, 128, 1),
    (16, 128, 128, 10),
    (8, 128, 128, 18),
]


def _conv(x, w):
    return lax.conv_general_dilated(
        x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def xla_times(x, w, repeats):
    forward = jax.jit(_conv)
    input_grad = jax.jit(lambda x, w: jax.grad(lambda x: _conv(x, w).sum())(x))
    kernel_grad = jax.jit(lambda x, w: jax.grad(lambda w: _conv(x, w).sum())(w))

    @jax.jit
    def both(x, w, d_out):  # the output and both gradients, a cotangent from outside as in a step
        y, pullback = jax.vjp(_conv, x, w)
        return y, pullback(d_out)

    d_out = np.ones(jax.eval_shape(_conv, x, w).shape, x.dtype)
    out = {}
    for name, fn in (
        ("fwd", forward),
        ("dx", input_grad),
        ("dw", kernel_grad),
        ("fwd_bwd", lambda x, w: both(x, w, d_out)),
    ):
        jax.block_until_ready(fn(x, w))
        out[name] = 1e3 * median_seconds(lambda: jax.block_until_ready(fn(x, w)), repeats)
    return out


def torch_times(x, w, repeats):
    tx = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))).requires_grad_(True)
    tw = torch.from_numpy(np.ascontiguousarray(w.transpose(3, 2, 0, 1))).requires_grad_(True)

    def forward():
        with torch.no_grad():
            torch.nn.functional.conv2d(tx, tw, padding=1)

    def forward_backward():
        tx.grad = tw.grad = None
        torch.nn.functional.conv2d(tx, tw, padding=1).sum().backward()

    out = {}
    for backend, context in (
        ("", torch.backends.mkldnn.flags(enabled=True)),
        ("no_nnpack_", torch.backends.nnpack.flags(enabled=False)),
        ("no_onednn_", torch.backends.mkldnn.flags(enabled=False)),
    ):
        with context:
            for name, fn in (("fwd", forward), ("fwd_bwd", forward_backward)):
                fn()
                out[backend + name] = 1e3 * median_seconds(fn, repeats)
    return out


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count())
    rng = np.random.default_rng(0)
    rows = []
    print(
        "| maps | c_in -> c_out | count | GFLOP fwd | XLA fwd / dx / dw ms | XLA sum "
        "| XLA fwd+bwd, one program | torch fwd+bwd | no NNPACK | no oneDNN | torch / XLA |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size, c_in, c_out, count in SHAPES:
        x = rng.standard_normal((args.batch, size, size, c_in)).astype(np.float32)
        w = (rng.standard_normal((3, 3, c_in, c_out)) / np.sqrt(9 * c_in)).astype(np.float32)
        xla, ref = xla_times(x, w, args.repeats), torch_times(x, w, args.repeats)
        total = xla["fwd"] + xla["dx"] + xla["dw"]
        gflop = 2 * args.batch * size * size * c_in * c_out * 9 / 1e9
        rows.append(
            dict(
                size=size,
                c_in=c_in,
                c_out=c_out,
                count=count,
                gflop_forward=gflop,
                xla_ms=xla,
                torch_ms=ref,
                xla_total_ms=total,
            )
        )
        print(
            f"| {args.batch}x{size}x{size} | {c_in} -> {c_out} | {count} | {gflop:.2f} | "
            f"{xla['fwd']:.1f} / "
            f"{xla['dx']:.1f} / {xla['dw']:.1f} | {total:.1f} | {xla['fwd_bwd']:.1f} "
            f"| {ref['fwd_bwd']:.1f} | {ref['no_nnpack_fwd_bwd']:.1f} "
            f"| {ref['no_onednn_fwd_bwd']:.1f} | {ref['fwd_bwd'] / xla['fwd_bwd']:.2f} |",
            flush=True,
        )
    weighted = (
        sum(r["count"] * r["xla_ms"]["fwd_bwd"] for r in rows),
        sum(r["count"] * r["torch_ms"]["fwd_bwd"] for r in rows),
    )
    print(
        f"\nweighted by count, forward and backward in one program each: XLA {weighted[0]:.0f} ms, "
        f"torch {weighted[1]:.0f} ms per step of "
        "3x3 convs"
    )
    out = pathlib.Path(
        args.out
        or pathlib.Path(__file__).parent / "results" / f"conv_layers_{jax.default_backend()}.json"
    )
    out.write_text(
        json.dumps(
            {
                "batch": args.batch,
                "rows": rows,
                "weighted_ms": {"xla": weighted[0], "torch": weighted[1]},
            },
            indent=2,
        )
    )
    print(f"saved {out}")


if __name__ == "__main__":
    main()
