"""Fit tables for models larger than one device: per tensor-parallel degree, the largest
per-device batch whose train step fits the chip, its memory, FLOPs and collective bytes, and the
layout the figures choose. Programs compiled for compile-only devices; nothing runs.

    python benchmarks/fit_tables.py                      # every row of ROWS
    python benchmarks/fit_tables.py --only vit_22b --models 1,2

Each row compiles a config's train step (``attnjax.compile.programs``, what ``python -m
attnjax.compile`` compiles) on the mesh ``fsdp = devices / model, model`` for ``model`` in 1, 2,
4, 8, at per-device batches (the batch is split over ``fsdp`` and repeated over ``model``) of
powers of two: 1 and 2 fit a line of memory against the batch, the power of two under the line's
crossing of the chip's memory is compiled, then doubled or halved until one fits and twice it
does not. GPU targets compile in the CUDA plugin's environment (``.venv-gpu``, ``make
test-cuda``) with ``JAX_PLATFORMS=cpu``.

The choice between layouts is a prediction from the compiled programs, two lower bounds on a
step's time: the FLOPs of its products at 40% of the chips' bf16 peak, and the bytes its
collectives return per device (``attnjax.compile.collectives``) over the chip's published
interconnect bandwidth. The layout with the most examples per second under the larger of the two
is chosen, the smaller ``model`` on a tie within 5%. Writes ``benchmarks/results/fit_tables.json``
(merged by row and ``model``) and ``fit_tables.md``.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
GIB = 1 << 30
MODELS = (1, 2, 4, 8)
GOOD_MFU = 0.4
# Per-chip interconnect bandwidth, bytes/s, as published: TPU "interchip interconnect BW"
# (cloud.google.com/tpu/docs/v5p: 4,800 Gbps; /v5e: 1,600 Gbps), NVLink for H100 SXM (NVIDIA
# datasheet: 900 GB/s). Both count every link of the chip in both directions: time from them is
# a lower bound.
INTERCONNECT = {"tpu:v5p": 4800e9 / 8, "tpu:v5e": 1600e9 / 8, "gpu:h100": 900e9}
# (row name, config, target, the largest batch to try per device)
ROWS = (
    ("vit_22b", "configs/vit_22b.py", "tpu:v5p:4x4x4", 256),
    ("prior_3b", "configs/prior_3b.py", "tpu:v5e:4x4", 256),
    ("prior_3b", "configs/prior_3b.py", "gpu:h100:8", 256),
)


def compile_train(config_path: str, target_name: str, model: int, per_device: int) -> dict:
    """One train step compiled (in this process) -> its record, or ``{"fits": False}`` where the
    compiler refused it for memory."""
    sys.path.insert(0, str(ROOT))
    import configs
    from attnjax import tasks
    from attnjax.compile import programs, targets
    from attnjax.ops import autotune

    autotune.set_enabled(False)
    target = targets.parse(target_name)
    devices = len(target.devices)
    config = configs.load(str(ROOT / config_path))
    config.mesh = {"data": 1, "fsdp": devices // model, "model": model}
    config.batch_size = per_device * devices // model
    config.eval_batch_size = config.batch_size
    task = tasks.get_task(config.task)
    start = time.perf_counter()
    try:
        _, (program,) = programs.compile_programs(config, task, target, only=("train",))
    except programs.DoesNotFit as refused:
        return {"fits": False, "refused": str(refused).splitlines()[0][:200],
                "compile_seconds": time.perf_counter() - start}  # fmt: skip
    moved = dict(program.collective_bytes)
    return {
        "fits": program.bytes_per_device <= target.memory_per_device,
        "per_device_batch": per_device,
        "global_batch": config.batch_size,
        "bytes_per_device": program.bytes_per_device,
        "argument_bytes": program.argument_bytes,
        "temp_bytes": program.temp_bytes,
        "device_memory_bytes": target.memory_per_device,
        "peak_flops_per_device": target.peak_per_device,
        "devices": devices,
        "flops_per_step": program.flops,
        "flops_loops_counted_once": program.has_loops,
        "collective_bytes_per_device": moved,
        "compile_seconds": time.perf_counter() - start,
    }


def _measure(config_path: str, target: str, model: int, per_device: int) -> dict:
    """``compile_train`` in a process of its own (a fresh set of compile-only devices; the CUDA
    plugin's environment for GPU targets)."""
    python = sys.executable
    env = {**os.environ, "ATTNJAX_EXECUTABLE_CACHE": "off"}
    if target.startswith("gpu:"):
        python = str(ROOT / ".venv-gpu" / "bin" / "python")
        env["JAX_PLATFORMS"] = "cpu"
    argv = [python, __file__, "--one", json.dumps([config_path, target, model, per_device])]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"{argv}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def largest(config_path: str, target: str, model: int, ceiling: int, progress) -> dict:
    """The largest power-of-two per-device batch that fits (see the module docstring)."""
    tried = {}

    def attempt(batch):
        if batch not in tried:
            tried[batch] = _measure(config_path, target, model, batch)
            progress(model, batch, tried[batch])
        return tried[batch]

    ones = attempt(1)
    twos = attempt(2) if ones["fits"] else {"fits": False}
    if not ones["fits"]:
        return {"largest": 0, "at_largest": None, "next": ones, "tried": sorted(tried)}
    batch = 2 if twos["fits"] else 1
    if twos["fits"]:
        slope = twos["bytes_per_device"] - ones["bytes_per_device"]
        room = ones["device_memory_bytes"] - ones["bytes_per_device"]
        guess = 1 + room / slope if slope > 0 else ceiling
        while batch * 2 <= min(guess, ceiling):
            batch *= 2
    while not attempt(batch)["fits"]:
        batch //= 2
    while batch * 2 <= ceiling and attempt(batch * 2)["fits"]:
        batch *= 2
    above = tried.get(batch * 2)
    return {"largest": batch, "at_largest": tried[batch], "next": above, "tried": sorted(tried)}


def predicted(record: dict, target: str) -> dict:
    """Lower bounds on a step's seconds from compute and from communication, and the examples
    per second the larger allows."""
    at = record["at_largest"]
    if not at:
        return {}
    compute = at["flops_per_step"] / (at["devices"] * at["peak_flops_per_device"] * GOOD_MFU)
    moved = sum(
        v for k, v in at["collective_bytes_per_device"].items() if k != "unknown_trip_loops"
    )
    bandwidth = INTERCONNECT[":".join(target.split(":")[:2])]
    comm = moved / bandwidth
    return {
        "compute_seconds_at_40pct_mfu": compute,
        "collective_seconds_at_link_bandwidth": comm,
        "examples_per_second": at["global_batch"] / max(compute, comm),
    }


def choose(records: list) -> dict | None:
    fitting = [r for r in records if r.get("examples_per_second")]
    if not fitting:
        return None
    best = max(r["examples_per_second"] for r in fitting)
    return min((r for r in fitting if r["examples_per_second"] >= 0.95 * best),
               key=lambda r: r["model"])  # fmt: skip


def markdown(rows: list) -> str:
    lines = [
        "# Fit tables: the largest models, per tensor-parallel degree",
        "",
        "Predictions from train steps compiled for compile-only devices on a CPU machine",
        "(`python benchmarks/fit_tables.py`; method in its docstring; JSON:",
        "[fit_tables.json](fit_tables.json)). Mesh `fsdp = devices / model, model`; batch per",
        "device = the global batch / fsdp. GiB: the train step's memory per device (arguments +",
        "outputs - donated + temporaries). Collectives: GiB each device receives per step, by kind",
        "(AG all-gather, AR all-reduce, RS reduce-scatter, CP collective-permute, A2A all-to-all).",
        "Seconds: lower bounds, products at 40% of the bf16 peak and collectives at the published",
        "interconnect bandwidth; examples/s from the larger. `*`: the layout chosen.",
        "",
        "| row | target | model | per-device batch | global batch | GiB / device of | 2x batch "
        "| PFLOP / step | AG | AR | RS | CP | A2A | compute s | collective s | examples/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    short = {"all-gather": "AG", "all-reduce": "AR", "reduce-scatter": "RS"}
    short.update({"collective-permute": "CP", "all-to-all": "A2A"})
    for row in rows:
        chosen = choose(row["records"])
        for r in row["records"]:
            at, above = r["at_largest"], r["next"]
            mark = "*" if r is chosen else ""
            if not at:
                refusal = (above or {}).get("refused", "does not fit")
                lines.append(f"| {row['name']} | {row['target']} | {r['model']} | 0 (batch 1 "
                             f"does not fit: {refusal}) |" + " |" * 12)  # fmt: skip
                continue
            if above is None:
                over = "not tried"
            elif above.get("bytes_per_device"):
                over = f"{above['bytes_per_device'] / GIB:.1f}"
            else:
                over = "refused"
            moved = at["collective_bytes_per_device"]
            cells = [f"{moved.get(kind, 0) / GIB:.1f}" for kind in short]
            at_most = "" if above else ">= "  # the search's ceiling, not the chip's memory
            lines.append(
                f"| {row['name']} | {row['target']} | {mark}{r['model']} | {at_most}{r['largest']} "
                f"| {at['global_batch']} | {at['bytes_per_device'] / GIB:.1f} of "
                f"{at['device_memory_bytes'] / GIB:.0f} | {over} "
                f"| {at['flops_per_step'] / 1e15:.2f} | "
                + " | ".join(cells)
                + f" | {r['compute_seconds_at_40pct_mfu']:.2f} "
                f"| {r['collective_seconds_at_link_bandwidth']:.2f} "
                f"| {r['examples_per_second']:,.0f} |"
            )
    return "\n".join(lines) + "\n"


def _save(out: pathlib.Path, row: dict) -> None:
    """``row`` into the JSON and the table, read again under a lock: invocations for different
    rows may run side by side."""
    order = [(name, target) for name, _, target, _ in ROWS]
    with open(pathlib.Path(tempfile.gettempdir()) / "attnjax-fit_tables.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = json.loads(out.read_text()) if out.exists() else []
        key = (row["name"], row["target"])
        rows = [r for r in current if (r["name"], r["target"]) != key] + [row]
        rows.sort(
            key=lambda r: (
                order.index(r_key) if (r_key := (r["name"], r["target"])) in order else len(order)
            )
        )
        out.write_text(json.dumps(rows, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(rows))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(compile_train(*json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default="", help="row names, comma-separated")
    parser.add_argument("--target", default="", help="only the rows of this target")
    parser.add_argument("--models", default=",".join(map(str, MODELS)))
    parser.add_argument("--table", action="store_true", help="only rewrite the .md from the JSON")
    args = parser.parse_args()
    if args.table:
        out = RESULTS / "fit_tables.json"
        out.with_suffix(".md").write_text(markdown(json.loads(out.read_text())))
        return
    models = [int(m) for m in args.models.split(",")]
    rows = [r for r in ROWS if not args.only or r[0] in args.only.split(",")]
    rows = [r for r in rows if not args.target or r[2] == args.target]
    out = RESULTS / "fit_tables.json"
    saved = json.loads(out.read_text()) if out.exists() else []
    start, cells, done = time.perf_counter(), len(rows) * len(models), 0
    for name, config_path, target, ceiling in rows:

        def progress(model, batch, record):
            gib = record.get("bytes_per_device")
            size = f"{gib / GIB:.1f} GiB" if gib else "refused"
            elapsed = time.perf_counter() - start
            print(f"  {name} {target} model {model}: batch {batch}/device {size}, fits "
                  f"{record['fits']} ({record['compile_seconds']:.0f} s; {elapsed / 60:.1f} "
                  f"min so far)", flush=True)  # fmt: skip

        row = next((r for r in saved if (r["name"], r["target"]) == (name, target)), None)
        if row is None:
            row = {"name": name, "config": config_path, "target": target, "records": []}
            saved.append(row)
        for model in models:
            record = {"model": model, **largest(config_path, target, model, ceiling, progress)}
            record.update(predicted(record, target))
            record["date"] = datetime.date.today().isoformat()
            row["records"] = sorted(
                [r for r in row["records"] if r["model"] != model] + [record],
                key=lambda r: r["model"],
            )
            _save(out, row)
            done += 1
            rate = (time.perf_counter() - start) / done
            eta = rate * (cells - done) / 60
            print(f"{name} {target} model {model}: largest {record['largest']}/device; "
                  f"{done}/{cells} done, ETA {eta:.0f} min", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
