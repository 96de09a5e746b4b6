"""docs/accelerators.md's tables from the compile command's JSON files.

    python benchmarks/accelerator_table.py benchmarks/results/compile/*.json

One row per program of each file (the run: the file's name), its target, batch, GiB per device
against the chip's, fits, GFLOP per example (matrix products), predicted examples/s at peak and
at 40% MFU, the collectives and the compile time. Refused programs get one row with the refusal.
"""

import json
import os
import sys

GIB = float(1 << 30)


def _rate(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def rows(result: dict, run: str) -> list[str]:
    config = run
    memory = result.get("device_memory_bytes")
    if "programs" not in result:
        return [f"| {config} | {result['target']} | | | refused | {result['refused']} | | | |"]
    out = []
    for name, p in result["programs"].items():
        of = f" / {memory / GIB:.2f}" if memory else ""
        counted = p["flops_per_example"] / 1e9 if p["flops_per_example"] else float("nan")
        estimate = p.get("flops_per_example_estimate")
        # A count that misses loop trips: the prediction uses 3 x the eval step's forward.
        flops = f"{estimate / 1e9:.1f} (3 x eval)" if estimate else f"{counted:.1f}"
        collectives = ", ".join(f"{k} {v}" for k, v in p["collectives"].items()) or "none"
        out.append(
            f"| {config} | {result['target']} | {name} {p['examples_per_step']} | "
            f"{p['bytes_per_device'] / GIB:.2f}{of} | {'yes' if p['fits'] else 'no'} | "
            f"{flops} | {_rate(p['examples_per_second_at_peak'])} | "
            f"{_rate(p['examples_per_second_at_40pct_mfu'])} | {collectives} | "
            f"{p['compile_seconds']:.0f} |"
        )
    return out


def main(paths) -> None:
    print(
        "| run | target | program, batch | GiB per device / chip | fits | GFLOP per example "
        "| examples/s at peak | at 40% MFU | collectives | compile s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        with open(path) as f:
            print("\n".join(rows(json.load(f), os.path.basename(path).removesuffix(".json"))))


if __name__ == "__main__":
    main(sys.argv[1:])
