"""ViT train steps with their blocks unrolled against ``scan_layers=True`` (one block compiled,
run in a loop), on the devices train.py uses: the wait for a compiled step (tracing, lowering,
compiling) and the step itself, in one process.

    python benchmarks/scan_layers.py [--rows ti16,b16] [--rounds 5] [--repeats 3]

Both models of a row carry one timm reference's weights (``vit_from_timm``, no dropout), so
their first losses must agree to float32 rounding (checked). The train step is compare_torch.py's
(AdamW, the batch split over one XLA device per core, the state replicated), the model called as
the classification task calls it (``train=True`` with a dropout key). The steps are timed in
alternating rounds, a round's step the median of ``--repeats`` calls, so that a slow spell of a
shared machine falls on both. Writes benchmarks/results/scan_layers_<platform>.{json,md} with
the machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from attnjax import huge_pages

if __name__ == "__main__":
    huge_pages.restart_with_huge_pages()  # as train.py and compare_torch.py start

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from compare_torch import machine  # noqa: E402
from rows_transformers import _timm_vit  # noqa: E402
from timing import alternating_ms  # noqa: E402
from torch_vs_jax import add_cpu_devices_flag, jax_train_step, placed, use_devices  # noqa: E402

from attnjax.convert.common import make_torchvision_importable  # noqa: E402
from attnjax.convert.timm import vit_from_timm  # noqa: E402
from attnjax.models import vit  # noqa: E402
from attnjax.ops.platform import processor_details  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ROWS = {"ti16": ("Ti/16", 224, 8), "s16": ("S/16", 224, 8), "b16": ("B/16", 224, 8)}
SIDES = ("unrolled", "scanned")


def measure(variant: str, image_size: int, batch: int, rounds: int, repeats: int) -> dict:
    reference = _timm_vit(vit.variant_config(variant), image_size, 1000).eval()
    rng = np.random.default_rng(0)
    images = rng.standard_normal((batch, image_size, image_size, 3)).astype(np.float32)
    labels = rng.integers(0, 1000, batch)
    result = {"workload": f"ViT {variant} {image_size}px train step (AdamW), batch {batch}"}
    calls, losses = {}, {}
    for side in SIDES:
        model, variables = vit_from_timm(
            reference,
            scan_layers=side == "scanned",
            dropout_rate=0.0,
            attention_dropout_rate=0.0,
        )

        def loss(params, images, labels, model=model):
            # As the classification task's train step calls it: a dropout key (used by no layer
            # at these rates) that the scanned blocks split per block.
            logits = model.apply(
                {"params": params}, images, train=True, rngs={"dropout": jax.random.key(1)}
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        step, state = jax_train_step(loss, variables["params"])
        state, (x, y), _ = placed(state, (images, labels))
        losses[side] = float(jax.jit(loss)(state[0], x, y))
        jitted = jax.jit(step)
        stages, cpu = {}, time.process_time()
        start = time.perf_counter()
        traced = jitted.trace(state, x, y)
        stages["trace_s"] = time.perf_counter() - start
        start = time.perf_counter()
        lowered = traced.lower()
        stages["lower_s"] = time.perf_counter() - start
        start = time.perf_counter()
        compiled = lowered.compile()
        stages["compile_s"] = time.perf_counter() - start
        stages["cpu_s"] = time.process_time() - cpu
        result[side] = stages
        # Not donated: every call starts from the same state, so the rounds time the same work.
        calls[side] = lambda c=compiled, s=state, x=x, y=y: jax.block_until_ready(c(s, x, y))
    relative = abs(losses["scanned"] - losses["unrolled"]) / abs(losses["unrolled"])
    assert relative < 1e-5, f"{variant}: losses {losses} differ by {relative:.1e} (relative)"
    result["losses"] = losses
    ms = alternating_ms(calls, rounds + 1, repeats)  # the first round warms up
    result["ms"] = {side: times[1:] for side, times in ms.items()}
    medians = {side: float(np.median(times[1:])) for side, times in ms.items()}
    result["unrolled_over_scanned"] = medians["unrolled"] / medians["scanned"]
    return result


def table(rows: list[dict], meta: dict, command: str) -> str:
    lines = [
        "# ViT train steps: blocks unrolled against `scan_layers=True`",
        "",
        f"`{command}`: {meta['cpu']} ({meta['cpu_details']}), {meta['jax_device_count']} "
        f"{meta['jax_backend']} "
        f"device(s); jax {meta['jax']}; XLA flags `{meta['xla_flags']}`. Seconds to a compiled "
        "step (tracing / lowering / compiling, and the process's CPU over the three); step ms "
        "per round, alternating; the last column is the ratio of the medians (below 1: the "
        "unrolled blocks step faster).",
        "",
        "| workload | unrolled: s to compiled (CPU) | scanned: s to compiled (CPU) "
        "| step ms, unrolled | step ms, scanned | unrolled / scanned |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = []
        for side in SIDES:
            s = row[side]
            cells.append(
                f"{s['trace_s']:.1f} / {s['lower_s']:.1f} / {s['compile_s']:.1f} ({s['cpu_s']:.1f})"
            )
        steps = [", ".join(f"{t:.0f}" for t in row["ms"][side]) for side in SIDES]
        lines.append(
            f"| {row['workload']} | {cells[0]} | {cells[1]} | {steps[0]} | {steps[1]} "
            f"| {row['unrolled_over_scanned']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="ti16,b16", help=f"of {','.join(ROWS)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    add_cpu_devices_flag(parser)
    args = parser.parse_args()
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; expected some of {list(ROWS)}")
    use_devices(args.cpu_devices)
    make_torchvision_importable()  # timm imports torchvision
    meta = dict(machine(), cpu_details=processor_details())
    rows = []
    for name in names:
        rows.append(measure(*ROWS[name], args.rounds, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    command = "python benchmarks/scan_layers.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
    )
    stem = RESULTS / f"scan_layers_{jax.default_backend()}"
    stem.with_suffix(".json").write_text(json.dumps({"machine": meta, "rows": rows}, indent=2))
    text = table(rows, meta, command)
    stem.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
