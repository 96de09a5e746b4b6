"""A model's initialisation as written against ``hashed_init.hashed_together`` (its Threefry
hashes batched): tracing and lowering, compiling and the one run, under XLA's defaults and under
``xla_cpu.run_once_options`` (what a run compiles its initialisation with up to
``RUN_ONCE_MAX_ELEMENTS``), and whether the two give the same bits.

    python benchmarks/hashed_init.py [--rounds 2] [--models prior_digits,vit_digits,...]

Each (model, options, side) compiles in a fresh process without any cache, the sides
alternating, ``--rounds`` times; the table shows the medians. The models are run_once.py's.
Writes benchmarks/results/hashed_init.{json,md}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib

import numpy as np
from run_once import MODELS, _init, fresh_process

from attnjax.ops.platform import processor_details

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]
OPTIONS = ["default", "run_once"]
SIDES = ["plain", "batched"]


def worker(name: str, options: str, side: str) -> dict:
    """In a fresh process: one model's initialisation, one option set, one side."""
    import time

    import jax

    from attnjax import xla_cpu
    from attnjax.train import hashed_init

    init, x = _init(name)
    fn = lambda key, x: init(key, x)["params"]  # noqa: E731
    fn = hashed_init.hashed_together(fn) if side == "batched" else fn
    start = time.perf_counter()
    lowered = jax.jit(fn).lower(jax.random.key(0), x)
    lower_seconds = time.perf_counter() - start
    compiler_options = xla_cpu.run_once_options(0) if options == "run_once" else None
    start = time.perf_counter()
    compiled = lowered.compile(compiler_options=compiler_options)
    compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(jax.random.key(0), x))
    run_seconds = time.perf_counter() - start
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(out):
        digest.update(np.asarray(leaf).tobytes())
    return dict(
        loops=lowered.as_text().count("stablehlo.while"),
        lower=lower_seconds,
        compile=compile_seconds,
        run=run_seconds,
        bits=digest.hexdigest()[:16],
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    runs: dict = {}
    for round_index in range(args.rounds):
        for name in args.models.split(","):
            for options in OPTIONS:
                for side in SIDES if round_index % 2 == 0 else SIDES[::-1]:
                    result = fresh_process(__file__, "--worker", name, options, side)
                    runs.setdefault((name, options), {}).setdefault(side, []).append(result)
                    print(name, options, side, result, flush=True)
    rows = []
    for (name, options), by_side in runs.items():
        row = dict(model=name, options=options)
        for side, results in by_side.items():
            row[f"{side}_loops"] = results[0]["loops"]
            for part in ("lower", "compile", "run"):
                row[f"{side}_{part}"] = float(np.median([r[part] for r in results]))
            row[f"{side}_bits"] = sorted({r["bits"] for r in results})
        row["same_bits"] = row["plain_bits"] == row["batched_bits"] and len(row["plain_bits"]) == 1
        total = {s: sum(row[f"{s}_{p}"] for p in ("lower", "compile", "run")) for s in SIDES}
        row["saved"] = total["plain"] - total["batched"]
        rows.append(row)
    import jax

    machine = dict(processor=processor_details(), jax=jax.__version__, rounds=args.rounds)
    (RESULTS / "hashed_init.json").write_text(
        json.dumps(dict(machine=machine, rows=rows), indent=2)
    )
    lines = [
        "# A model's initialisation with its hashes batched (`train.hashed_init`)",
        "",
        "`python benchmarks/hashed_init.py` ([hashed_init.json](hashed_init.json)): a model's "
        "initialisation traced and lowered, compiled and run once in a fresh process, as "
        "written (plain) and through `hashed_init.hashed_together` (batched), under XLA's "
        "default options and under `xla_cpu.run_once_options`; loops: the lowered program's "
        f"while loops (one per hash call on a CPU); medians of {args.rounds} rounds, the sides "
        f"alternating. AMD EPYC, 2 cores ({machine['processor']}), jax {machine['jax']}, no "
        "compilation cache. Saved: plain minus batched, lowering + compile + run.",
        "",
        "| model | options | loops | lower s | compile s | run s | batched: loops | lower s "
        "| compile s | run s | same bits | saved s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['options']} | {r['plain_loops']} | {r['plain_lower']:.2f} | "
            f"{r['plain_compile']:.2f} | {r['plain_run']:.2f} | {r['batched_loops']} | "
            f"{r['batched_lower']:.2f} | {r['batched_compile']:.2f} | {r['batched_run']:.2f} | "
            f"{'yes' if r['same_bits'] else 'NO'} | {r['saved']:+.2f} |"
        )
    (RESULTS / "hashed_init.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
