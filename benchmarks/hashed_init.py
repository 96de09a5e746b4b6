"""A model's initialisation as written against ``hashed_init.hashed_together`` (its Threefry
hashes batched): tracing and lowering, compiling and the one run, under XLA's defaults and under
``xla_cpu.run_once_options`` (what a run compiles its initialisation with up to
``RUN_ONCE_MAX_ELEMENTS``), and whether they give the same bits. Three sides: plain (as
written), alone (batched, each draw over ``LARGEST_BATCHED`` elements hashed alone) and batched
(those stacked by shape, ``LARGEST_STACKED``: the library's setting).

    python benchmarks/hashed_init.py [--rounds 2] [--models prior_digits,vit_digits,...]
        [--name hashed_init]

Each (model, options, side) compiles in a fresh process without any cache, the sides in turn,
reversed every other round, ``--rounds`` times; the table shows the medians. The models are
run_once.py's. Writes benchmarks/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib

import numpy as np
from run_once import MODELS, _init, fresh_process

from attnjax.ops.platform import processor, processor_details

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]
OPTIONS = ["default", "run_once"]
SIDES = ["plain", "alone", "batched"]


def worker(name: str, options: str, side: str) -> dict:
    """In a fresh process: one model's initialisation, one option set, one side."""
    import time

    import jax

    from attnjax import xla_cpu
    from attnjax.train import hashed_init

    init, x = _init(name)
    fn = lambda key, x: init(key, x)["params"]  # noqa: E731
    if side == "alone":
        hashed_init.LARGEST_STACKED = 0
    fn = hashed_init.hashed_together(fn) if side != "plain" else fn
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
        loops=compiled.as_text().count(" while("),
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
    parser.add_argument("--name", default="hashed_init")
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
        group = {}
        for side in SIDES:
            results = by_side[side]
            row = dict(model=name, options=options, side=side, loops=results[0]["loops"])
            for part in ("lower", "compile", "run"):
                row[part] = float(np.median([r[part] for r in results]))
            row["total"] = row["lower"] + row["compile"] + row["run"]
            row["bits"] = sorted({r["bits"] for r in results})
            group[side] = row
        for row in group.values():
            row["same_bits"] = row["bits"] == group["plain"]["bits"] and len(row["bits"]) == 1
            row["saved"] = group["plain"]["total"] - row["total"]
        rows.extend(group.values())
    import jax

    machine = dict(
        processor=processor_details(),
        name=processor(),
        jax=jax.__version__,
        rounds=args.rounds,
    )
    (RESULTS / f"{args.name}.json").write_text(
        json.dumps(dict(machine=machine, rows=rows), indent=2)
    )
    lines = [
        "# A model's initialisation with its hashes batched (`train.hashed_init`)",
        "",
        f"`python benchmarks/hashed_init.py` ([{args.name}.json]({args.name}.json)): a model's "
        "initialisation traced and lowered, compiled and run once in a fresh process, as "
        "written (plain), through `hashed_init.hashed_together` with each draw of more than "
        "`LARGEST_BATCHED` elements hashed alone (alone), and with those stacked by shape "
        "(batched, the library's setting), under XLA's default options and under "
        "`xla_cpu.run_once_options`; loops: the compiled program's while loops (on a CPU, one "
        "per hash call, two for a stacked one); medians of "
        f"{args.rounds} rounds, the sides' order reversed every other round. {machine['name']}, "
        f"2 cores ({machine['processor']}), jax {machine['jax']}, no compilation cache. Saved: "
        "plain minus the side, lowering + compile + run.",
        "",
        "| model | options | side | loops | lower s | compile s | run s | same bits | saved s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['options']} | {r['side']} | {r['loops']} | {r['lower']:.2f} | "
            f"{r['compile']:.2f} | {r['run']:.2f} | {'yes' if r['same_bits'] else 'NO'} | "
            f"{r['saved']:+.2f} |"
        )
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
