"""Which attention kernel each platform's program carries, read from the programs themselves.

    python benchmarks/attention_kernels.py [--compile-tpu v5e:1x1]

For each shape (ViT-B/16's 197 tokens, and 1k, 4k, 16k causal) and dtype, traces one forward +
backward of ``attnjax.ops.attention.dot_product_attention`` on this host, lowers it for cpu,
cuda and tpu, and names what each lowered program holds: ``splash`` (a Pallas TPU custom call),
``cudnn`` (cuDNN's fused attention custom calls), ``blocked`` (a loop over tiles), or ``xla`` /
``explicit`` (one fusion-friendly graph; which of the two is the rule's word, checked to hold no
kernel call and no loop). With ``--compile-tpu`` the TPU programs are also compiled by libtpu for
that topology's compile-only devices: a tile that overflows VMEM or a program that overflows HBM
fails there; their temporary memory is reported.

CUDA programs carry cuDNN only where the jax CUDA plugin is installed (``make test-cuda``'s
``.venv-gpu``): run this with that environment's Python for the full table. Nothing here runs
on an accelerator: these are the programs as compiled, not timings.

Writes ``benchmarks/results/attention_kernels.{md,json}``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CPU column is the fixed rule, the same on every machine; with the timing on, the CPU paths
# between 64 and 1023 tokens would be whichever this machine ran fastest.
os.environ.setdefault("ATTNJAX_CPU_AUTOTUNE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from attnjax.ops import attention  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
# (name, batch, length, heads, head_dim, causal)
SHAPES = [
    ("ViT-B/16", 8, 197, 12, 64, False),
    ("1k causal", 4, 1024, 8, 128, True),
    ("4k causal", 1, 4096, 8, 128, True),
    ("16k causal", 1, 16384, 8, 128, True),
]
PLATFORMS = ("cpu", "cuda", "tpu")


def carried(text: str, chosen: str) -> str:
    """The kernel a lowered program holds."""
    if "tpu_custom_call" in text:
        return "splash"
    if re.search(r"@__cudnn\$fmha", text):
        return "cudnn"
    if "stablehlo.while" in text:
        return "blocked"
    if chosen not in ("xla", "explicit"):
        raise AssertionError(
            f"the rule chose {chosen!r}, the program holds neither kernel nor loop"
        )
    return chosen


def fwd_bwd(is_causal: bool):
    def loss(q, k, v):
        out = attention.dot_product_attention(q, k, v, is_causal=is_causal)
        return jnp.sum(out.astype(jnp.float32))

    return jax.grad(loss, (0, 1, 2))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-tpu", default=None, help="e.g. v5e:1x1 (needs libtpu)")
    args = parser.parse_args()
    cuda_plugin = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    device = None
    if args.compile_tpu:
        from attnjax.compile import targets

        device = targets.parse(f"tpu:{args.compile_tpu}").devices[0]
    rows = []
    for name, batch, length, heads, depth, causal in SHAPES:
        for dtype in (jnp.bfloat16, jnp.float32):
            x = jax.ShapeDtypeStruct((batch, length, heads, depth), dtype)
            choices = attention.platform_choices(x, x, x, None, causal)
            traced = jax.jit(fwd_bwd(causal)).trace(x, x, x)
            row = {
                "shape": name,
                "batch x tokens x heads x head_dim": f"{batch} x {length} x {heads} x {depth}",
                "dtype": jnp.dtype(dtype).name,
            }
            for platform in PLATFORMS:
                text = traced.lower(lowering_platforms=(platform,)).as_text()
                row[platform] = carried(text, choices[platform])
            if device is not None:
                sharding = jax.sharding.SingleDeviceSharding(device)
                on_tpu = jax.ShapeDtypeStruct(x.shape, dtype, sharding=sharding)
                start = time.perf_counter()
                compiled = jax.jit(fwd_bwd(causal)).lower(on_tpu, on_tpu, on_tpu).compile()
                row["tpu compile s"] = round(time.perf_counter() - start, 1)
                row["tpu temp MiB"] = round(
                    compiled.memory_analysis().temp_size_in_bytes / 2**20, 1
                )
            rows.append(row)
            print(row, flush=True)
    header = list(rows[0])
    lines = [
        "# Which attention kernel each platform's program carries",
        "",
        "`python benchmarks/attention_kernels.py"
        + (f" --compile-tpu {args.compile_tpu}`" if args.compile_tpu else "`")
        + f" (jax {jax.__version__}; CUDA plugin {'installed' if cuda_plugin else 'absent'}):",
        "one trace on this CPU host per row, forward + backward of `dot_product_attention`, "
        "lowered for each platform. Predictions from the programs, not timings.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(r.get(h, "")) for h in header) + " |" for r in rows),
    ]
    if args.compile_tpu:
        lines += [
            "",
            f"TPU programs compiled by libtpu for one chip of `{args.compile_tpu}` (compile-only "
            "device); temporaries are XLA's buffers besides arguments and outputs.",
        ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "attention_kernels.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "attention_kernels.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
