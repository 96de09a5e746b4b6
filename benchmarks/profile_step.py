"""Where the time of a compiled step goes: the rows of ``compare_torch.py``, op by op.

    python benchmarks/profile_step.py [--rows vqgan_autoencoder,mha] [--steps 3] [--top 12]

For each row it compiles attnjax's step, times it, and traces ``--steps`` steps with
``jax.profiler``; every traced XLA operation is matched to its instruction in the compiled HLO
and put in a class by what it computes (``convolution``, ``dot``, ``transpose/copy``,
``elementwise/reduce``, ``other``). Prints, per row: the step time, XLA's FLOP count
(``cost_analysis``) and the achieved GFLOP/s against this machine's float32 matmul rate
(a 2048^3 ``jnp.dot``, measured first), the time per class, and the most expensive operations
with their shapes and the source operation they came from. Tracing slows a step down, so the
classes are shares of the traced time; the coverage printed beside them (traced time over step
time times devices) says how much of the step the trace matched: convolutions that XLA runs on
its worker threads can fall outside it, and a row's shares then leave them out. Rows run as in
``compare_torch.py``: split over one CPU device per core (``--cpu-devices``), the traced time
then summing every device's operations.
JSON in ``benchmarks/results/profile_<platform>.json``.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import pathlib
import re
import tempfile
import time

import compare_torch
import jax
import jax.numpy as jnp
import numpy as np
from timing import median_seconds

_INSTRUCTION = re.compile(r"^(?:ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\(")


def matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    a = jnp.asarray(np.random.default_rng(0).standard_normal((size, size), dtype=np.float32))
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(a, a))
    return 2 * size**3 / median_seconds(lambda: jax.block_until_ready(dot(a, a)), repeats) / 1e9


def hlo_instructions(hlo_text: str) -> dict[str, dict]:
    """Instruction name -> shape, opcode, the opcodes of a fusion's body, and the source op."""
    computations, current = {}, None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            words = line.split()
            current = (words[1] if words[0] == "ENTRY" else words[0]).lstrip("%")
            computations[current] = []
        elif current is not None and line.strip() not in ("", "}"):
            computations[current].append(line.strip())
    instructions = {}
    for lines in computations.values():
        for line in lines:
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            name, shape, opcode = match.groups()
            called = re.search(r"calls=%?([\w.\-]+)", line)
            body = computations.get(called.group(1), []) if called else []
            inner = {m.group(3) for m in map(_INSTRUCTION.match, body) if m}
            source = re.search(r'op_name="([^"]+)"', line) or next(
                (s for s in (re.search(r'op_name="([^"]+)"', b) for b in body) if s), None
            )
            instructions[name] = dict(
                shape=shape, opcode=opcode, inner=inner, source=source.group(1) if source else ""
            )
    return instructions


def op_class(instruction: dict) -> str:
    ops = instruction["inner"] | {instruction["opcode"]}
    if "convolution" in ops:
        return "convolution"
    if "dot" in ops:
        return "dot"
    if ops & {"transpose", "copy"} and not ops & {
        "exponential",
        "reduce",
        "multiply",
        "add",
        "divide",
    }:
        return "transpose/copy"
    if ops & {
        "fusion",
        "add",
        "multiply",
        "reduce",
        "exponential",
        "divide",
        "subtract",
        "maximum",
        "select",
    }:
        return "elementwise/reduce"
    return "other"


def profile_row(name: str, table: dict, steps: int, top: int) -> dict:
    description, jax_step, _ = table[name]()
    jax_step()
    step_ms = 1e3 * median_seconds(jax_step, 5)
    cost = jax_step.compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    # Cost analysis counts one device's share of a program split over several.
    flops = float(cost.get("flops", 0.0)) * jax_step.devices if cost else 0.0
    instructions = hlo_instructions(jax_step.compiled.as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(steps):
            jax_step()
        jax.profiler.stop_trace()
        trace = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[
            -1
        ]
        with gzip.open(trace) as f:
            events = json.load(f)["traceEvents"]
    per_op = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event.get("name") in instructions:
            per_op[event["name"]] += event["dur"] / 1e3 / steps
    classes = collections.Counter()
    for op, ms in per_op.items():
        classes[op_class(instructions[op])] += ms
    traced = sum(per_op.values())
    return {
        "row": name,
        "workload": description,
        "devices": jax_step.devices,
        "step_ms": step_ms,
        "gflop": flops / 1e9,
        "gflops_per_s": flops / 1e9 / (step_ms / 1e3),
        "traced_ms": traced,
        # Operations that run on XLA's worker threads (convolutions) are not all matched to an
        # instruction: a low coverage says the class shares leave them out.
        "coverage": traced / (step_ms * jax_step.devices),
        "classes": {k: {"ms": v, "share": v / traced} for k, v in classes.most_common()},
        "top": [
            dict(
                op=op,
                ms=ms,
                share=ms / traced,
                cls=op_class(instructions[op]),
                shape=instructions[op]["shape"],
                source=instructions[op]["source"],
            )
            for op, ms in per_op.most_common(top)
        ],
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rows", default="vqgan_autoencoder,vqgan_gan_step,vit_cifar_train,gpt_train,mha"
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", default=None)
    compare_torch.add_cpu_devices_flag(parser)
    args = parser.parse_args()
    compare_torch.use_devices(args.cpu_devices)
    peak = matmul_gflops()
    print(
        f"float32 matmul 2048^3: {peak:.0f} GFLOP/s ({jax.devices()[0].device_kind}, "
        f"{os.cpu_count()} cores)"
    )
    results = []
    with tempfile.TemporaryDirectory() as directory:
        table = compare_torch.rows(False, directory)
        unknown = sorted(set(args.rows.split(",")) - set(table))
        if unknown:
            raise ValueError(f"--rows: unknown rows {unknown}; expected names from {sorted(table)}")
        for name in args.rows.split(","):
            r = profile_row(name, table, args.steps, args.top)
            results.append(r)
            print(
                f"\n## {r['workload']} ({r['devices']} device(s)): {r['step_ms']:.1f} ms, "
                f"{r['gflop']:.1f} GFLOP, "
                f"{r['gflops_per_s']:.0f} GFLOP/s ({100 * r['gflops_per_s'] / peak:.0f}% of matmul)"
            )
            print(
                f"traced: {r['traced_ms']:.1f} ms of operations per step, "
                f"{100 * r['coverage']:.0f}% of the step's time on {r['devices']} device(s)"
            )
            print("| class | traced ms | share |\n|---|---|---|")
            for cls, v in r["classes"].items():
                print(f"| {cls} | {v['ms']:.1f} | {100 * v['share']:.0f}% |")
            print("| op | class | ms | share | shape | from |\n|---|---|---|---|---|---|")
            for t in r["top"]:
                print(
                    f"| {t['op']} | {t['cls']} | {t['ms']:.1f} | {100 * t['share']:.1f}% | "
                    f"{t['shape']} | "
                    f"{t['source'][-60:]} |"
                )
    out = pathlib.Path(
        args.out
        or pathlib.Path(__file__).parent / "results" / f"profile_{jax.default_backend()}.json"
    )
    out.write_text(
        json.dumps(
            {"matmul_gflops": peak, "time": time.strftime("%Y-%m-%d %H:%M"), "rows": results},
            indent=2,
        )
    )
    print(f"\nsaved {out}")


if __name__ == "__main__":
    main()
