"""Sampling speed of the transformer prior: KV cache vs full recompute vs taming's PyTorch loop.

One small GPT (random weights, converted so all three run the same network) generates ``L``
tokens after a one-token prefix (``block_size = L``) with temperature 1 and top-k, for every
sequence length ``L`` in {16, 64, 256} and batch in {1, 16, 64}:

* ``cached``: ``attnjax.models.sampling.sample``, one jit program, key/value cache, one token per
  ``lax.scan`` step.
* ``recompute``: ``attnjax.models.sampling.sample_recompute``, one jit program that runs the full
  causal pass over the fixed-size ``[batch, L]`` buffer for every token.
* ``taming``: ``taming.modules.transformer.mingpt.sample`` (PyTorch, eager, ``torch.no_grad``,
  ``--torch_threads`` intra-op threads, default 1), which re-runs the model on the growing
  prefix for every token.

Compile time (``lower().compile()``) is reported apart from the steady state (best of a few
calls of the compiled program, repeated for 1 s or 20 calls; the best call is the one least
disturbed by other load on a shared machine). Prints a table and writes
``benchmarks/results/sampling.json``.

    .venv/bin/python benchmarks/sampling.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from taming.modules.transformer import mingpt  # noqa: E402

from attnjax.convert.taming import gpt_from_taming
from attnjax.models import sampling

MODEL = dict(vocab_size=128, n_layer=2, n_head=4, n_embd=64)
TOP_K = 32
RESULTS = pathlib.Path(__file__).parent / "results" / "sampling.json"


def _best_seconds(fn, min_seconds=1.0, max_repeats=20):
    """Best wall time of ``fn()`` over calls repeated until ``min_seconds`` or ``max_repeats``."""
    best, total, repeats = float("inf"), 0.0, 0
    while repeats < max_repeats and (repeats < 1 or total < min_seconds):
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, total, repeats = min(best, elapsed), total + elapsed, repeats + 1
    return best


def _models(length):
    torch.manual_seed(0)
    torch_model = mingpt.GPT(block_size=length, **MODEL).eval()
    model, variables = gpt_from_taming(torch_model.state_dict(), n_head=MODEL["n_head"])
    return torch_model, model, variables["params"]


def run(lengths, batches):
    rows = []
    for length in lengths:
        torch_model, model, params = _models(length)
        for batch in batches:
            prefix = jnp.zeros((batch, 1), jnp.int32)
            rng = jax.random.key(0)
            tokens = batch * length
            row = {"length": length, "batch": batch}
            for name, sampler in (
                ("cached", sampling.sample),
                ("recompute", sampling.sample_recompute),
            ):
                program = jax.jit(
                    lambda p, x, r, sampler=sampler: sampler(model, p, x, r, length, top_k=TOP_K)
                )
                start = time.perf_counter()
                compiled = program.lower(params, prefix, rng).compile()
                row[f"{name}_compile_s"] = time.perf_counter() - start
                steady = _best_seconds(lambda: compiled(params, prefix, rng).block_until_ready())
                row[f"{name}_tokens_per_s"] = tokens / steady
            torch_prefix = torch.zeros((batch, 1), dtype=torch.long)
            with torch.no_grad():
                mingpt.sample(torch_model, torch_prefix, 2, sample=True, top_k=TOP_K)  # warm-up
                steady = _best_seconds(
                    lambda: mingpt.sample(
                        torch_model, torch_prefix, length, sample=True, top_k=TOP_K
                    )
                )
            row["taming_tokens_per_s"] = tokens / steady
            row["cached_over_recompute"] = (
                row["cached_tokens_per_s"] / row["recompute_tokens_per_s"]
            )
            row["cached_over_taming"] = row["cached_tokens_per_s"] / row["taming_tokens_per_s"]
            rows.append(row)
            print(_format_row(row), flush=True)
    return rows


_HEADER = (
    f"{'length':>6} {'batch':>5} | {'cached tok/s':>12} {'recompute tok/s':>15} "
    f"{'taming tok/s':>12} | "
    f"{'cached/recomp':>13} {'cached/taming':>13} | {'compile s (cached, recomp)':>26}"
)


def _format_row(row):
    return (
        f"{row['length']:>6} {row['batch']:>5} | {row['cached_tokens_per_s']:>12.0f} "
        f"{row['recompute_tokens_per_s']:>15.0f} {row['taming_tokens_per_s']:>12.0f} | "
        f"{row['cached_over_recompute']:>12.1f}x {row['cached_over_taming']:>12.1f}x | "
        f"{row['cached_compile_s']:>12.2f} {row['recompute_compile_s']:>13.2f}"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="length 16 and 64, batch 1 and 16 only"
    )
    parser.add_argument("--output", type=pathlib.Path, default=RESULTS)
    parser.add_argument(
        "--torch_threads",
        type=int,
        default=1,
        help="PyTorch intra-op threads; with 2 on 2 shared, busy cores its OpenMP "
        "spin-waiting made the loop ~20x slower than with 1",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    lengths, batches = ((16, 64), (1, 16)) if args.quick else ((16, 64, 256), (1, 16, 64))
    print(
        f"GPT {MODEL}, top_k={TOP_K}, jax {jax.__version__} on {jax.devices()[0].platform}, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads"
    )
    print(_HEADER)
    start = time.perf_counter()
    rows = run(lengths, batches)
    total = time.perf_counter() - start
    at_256 = [row["cached_over_recompute"] for row in rows if row["length"] == 256]
    if at_256:
        print(
            f"cached vs full recompute at length 256: {min(at_256):.1f}x (worst batch) .. "
            f"{max(at_256):.1f}x (best batch)"
        )
    print(f"total {total:.0f} s")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "model": MODEL,
                "top_k": TOP_K,
                "prefix_length": 1,
                "jax": jax.__version__,
                "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(),
                "device": jax.devices()[0].device_kind,
                "cpu_count": os.cpu_count(),
                "python": sys.version.split()[0],
                "machine": platform.machine(),
                "total_seconds": total,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
