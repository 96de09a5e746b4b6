"""The largest per-device training batch that fits a target, found by compiling the train step.

    JAX_PLATFORMS=cpu python benchmarks/largest_batch.py --config configs/vit_imagenet.py \\
        --target gpu:h100:8 --name vit_b16_224 --set data.image_size=224 --set model.image_size=224

For each of remat off/on and FSDP off/on (``--variants``), the config's train step is compiled
for the target (``attnjax.compile.programs``, what ``python -m attnjax.compile`` compiles) at two
per-device batches (``--probes``), then at the batch where the line through the two largest
compiled batches reaches the chip's memory, rounded down to ``--multiple``, until a batch fits
and the next multiple does not: the memory per device is close to affine in the batch, but not
everywhere (remat with FSDP), so every figure in a row is a compiled one.
Predictions from compiled programs, nothing runs. Appends rows to
``benchmarks/results/largest_batch.json`` and rewrites ``largest_batch.md``.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import pathlib
import sys
import time

import configs
from attnjax import tasks
from attnjax.compile import programs, targets

RESULTS = pathlib.Path(__file__).parent / "results"
GIB = 1 << 30
VARIANTS = {
    "plain": {},
    "remat": {"model.remat": True},
    "fsdp": {"mesh.data": 1, "mesh.fsdp": -1},
    "remat+fsdp": {"model.remat": True, "mesh.data": 1, "mesh.fsdp": -1},
}


def load_config(path: str, settings: list[str]):
    config = configs.load(path)
    for setting in settings:
        key, _, text = setting.partition("=")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        _set(config, key, value)
    return config


def _set(config, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for name in parents:
        config = config[name]
    if leaf not in config:
        raise ValueError(f"--set {dotted}: the config has no field {leaf!r}")
    config[leaf] = value


def train_bytes(config, task, target, per_device: int) -> tuple[int | None, float]:
    """(bytes per device of the train step at ``per_device`` examples a device, or None when
    the compiler refused it for memory; compile seconds)."""
    config = config.copy_and_resolve_references()
    config.batch_size = per_device * len(target.devices)
    config.eval_batch_size = config.batch_size
    start = time.perf_counter()
    try:
        _, (program,) = programs.compile_programs(config, task, target, only=("train",))
    except programs.DoesNotFit:
        return None, time.perf_counter() - start
    return program.bytes_per_device, time.perf_counter() - start


def largest(config, task, target, multiple: int, probes: tuple[int, int]) -> dict:
    memory = target.memory_per_device
    measured, seconds = {}, 0.0
    fits_at, fails_at = None, None
    pending = list(probes)
    while True:
        batch = pending.pop(0) if pending else _next(measured, memory, multiple, fits_at, fails_at)
        used, took = train_bytes(config, task, target, batch)
        seconds += took
        measured[batch] = used
        ok = used is not None and used <= memory
        print(f"  per-device batch {batch}: {_gib(used)} GiB, fits {ok} ({took:.0f} s)", flush=True)
        if ok:
            fits_at = batch if fits_at is None else max(fits_at, batch)
        else:
            fails_at = batch if fails_at is None else min(fails_at, batch)
        if pending:
            continue
        if fits_at is not None and fails_at is not None and fails_at - fits_at <= multiple:
            break
        if fails_at is not None and fails_at <= multiple:
            fits_at = 0
            break
    return {
        "largest": fits_at,
        "bytes_at_largest": measured.get(fits_at),
        "next_multiple": fails_at,
        "bytes_at_next": measured.get(fails_at),
        "probes": {str(k): v for k, v in measured.items()},
        "compile_seconds": seconds,
    }


def _next(measured: dict, memory: int, multiple: int, fits_at, fails_at) -> int:
    """The multiple of ``multiple`` where the line through the largest batch that fits and the
    smallest that does not (else the two largest compiled batches) reaches ``memory``, strictly
    between the two; halfway between them where the line points past the one that does not
    (the compiler refused it: no bytes to fit), twice the fitting one where the line does not
    rise (XLA's rematerialisation near the limit can make a larger batch take less memory)."""
    low_end = fits_at + multiple if fits_at is not None else multiple
    high_end = fails_at - multiple if fails_at is not None else 1 << 30
    guess = None
    points = sorted((b, m) for b, m in measured.items() if m is not None)
    if measured.get(fits_at) is not None and measured.get(fails_at) is not None:
        points = [(fits_at, measured[fits_at]), (fails_at, measured[fails_at])]
    if len(points) >= 2:
        (b1, m1), (b2, m2) = points[-2], points[-1]
        slope = (m2 - m1) / (b2 - b1)
        if slope > 0:
            guess = int((memory - (m2 - slope * b2)) / slope) // multiple * multiple
    # No rising line, or one past a batch the compiler refused (no bytes to fit): double or halve.
    if guess is None or (fails_at is not None and guess > high_end):
        if fails_at is None:
            guess = 2 * (fits_at or 0) // multiple * multiple
        else:
            guess = (low_end + high_end) // 2 // multiple * multiple
    return min(max(guess, low_end), high_end)


def _gib(value) -> str:
    return "refused" if value is None else f"{value / GIB:.2f}"


def ordered(rows) -> list:
    return sorted(rows, key=lambda r: (r["name"], r["target"], list(VARIANTS).index(r["variant"])))


def commands(rows) -> str:
    """The commands behind the rows, one per (name, target, probes), for the results file."""
    lines = {}
    for r in ordered(rows):
        settings = "".join(f" --set {s!r}" if " " in s else f" --set {s}" for s in r["settings"])
        probes = ",".join(list(r["probes"])[:2])
        head = f"--config {r['config']} --target {r['target']} --name {r['name']}{settings}"
        lines.setdefault((head, probes), []).append(r["variant"])
    return "\n".join(
        f"- `python benchmarks/largest_batch.py {head}"
        + ("" if variants == list(VARIANTS) else f" --variants {','.join(variants)}")
        + f" --probes {probes}`"
        for (head, probes), variants in lines.items()
    )


def markdown(rows) -> str:
    return (
        f"# Largest batches\n\n{NOTE}\n\n{table(ordered(rows))}\n\n"
        f"Commands (GPU targets with `JAX_PLATFORMS=cpu` in the environment of `make test-cuda`):"
        f"\n\n{commands(rows)}\n"
    )


def table(rows) -> str:
    lines = [
        "| name | target | variant | largest per-device batch | GiB per device there | next "
        "multiple | GiB there | device GiB | compiles, s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['target']} | {r['variant']} | {r['largest']} "
            f"| {_gib(r.get('bytes_at_largest'))} | {r.get('next_multiple')} "
            f"| {_gib(r.get('bytes_at_next'))} | {r['device_memory_bytes'] / GIB:.2f} "
            f"| {len(r['probes'])}, {r['compile_seconds']:.0f} |"
        )
    return "\n".join(lines)


NOTE = """Predictions from programs compiled for compile-only devices on a CPU machine
(`benchmarks/largest_batch.py`; JSON: [largest_batch.json](largest_batch.json)). The train step's
memory per device (arguments + outputs - donated + temporaries, as `python -m attnjax.compile`
reports it) against the chip's memory; the largest per-device batch that fits, in multiples of
the row's step, and the compiled figure of the next multiple, which does not. fsdp: the mesh
`data=1, fsdp=-1` (parameters and optimiser state split over every device)."""


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--name", required=True, help="the row's name, e.g. vit_b16_224")
    parser.add_argument("--set", action="append", default=[], help="config field=value")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--multiple", type=int, default=8)
    parser.add_argument("--probes", default="8,32", help="two per-device batches to fit a line")
    args = parser.parse_args()
    target = targets.parse(args.target)
    probes = tuple(int(x) for x in args.probes.split(","))
    out = RESULTS / "largest_batch.json"
    rows = json.loads(out.read_text()) if out.exists() else []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            sys.exit(f"--variants: {variant!r} is not one of {sorted(VARIANTS)}")
        settings = [*args.set, *(f"{k}={v}" for k, v in VARIANTS[variant].items())]
        config = load_config(args.config, settings)
        task = tasks.get_task(config.task)
        print(f"{args.name} on {args.target}, {variant}:", flush=True)
        found = largest(config, task, target, args.multiple, probes)
        row = dict(
            name=args.name,
            config=args.config,
            settings=args.set,
            target=args.target,
            variant=variant,
            device_memory_bytes=target.memory_per_device,
            date=datetime.date.today().isoformat(),
            **found,
        )
        rows = [r for r in rows if (r["name"], r["target"], r["variant"]) != (
            row["name"], row["target"], row["variant"])]  # fmt: skip
        rows.append(row)
        out.write_text(json.dumps(rows, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(rows))
        print(table([row]), flush=True)


if __name__ == "__main__":
    main()
