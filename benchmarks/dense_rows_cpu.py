"""Dense layers with their leading axes merged (``attnjax.ops.dense``) against the plain product,
on CPU: forward + backward of whole models, both programs in one process, timed in alternating
rounds.

    python benchmarks/dense_rows_cpu.py [--rows vit_ti16,vit_b16,gpt] [--rounds 6] [--repeats 1]

The plain program is the same model traced with the merge off (``MERGE_MIN_ELEMENTS`` beyond any
input, so every Dense takes ``lax.dot_general`` as written); both compute the same loss and
gradients (checked: within 1e-5 of the largest magnitude of each gradient, but for gradients that
are zero up to rounding, such as the attention's key bias). Per row: each program's fusions and
the copies XLA:CPU made of an operand transposed for a kernel's gradient, compile seconds and the
median step of each round. Writes benchmarks/results/dense_rows_cpu.{json,md} with the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import alternating_ms

from attnjax.models import gpt, vit
from attnjax.ops import dense
from attnjax.ops.platform import cpu_cores, processor

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


@contextlib.contextmanager
def merge(on: bool):
    """Programs traced inside merge their Dense layers' rows where ``attnjax.ops.dense`` would,
    or (``on=False``) nowhere."""
    threshold = dense.MERGE_MIN_ELEMENTS
    dense.MERGE_MIN_ELEMENTS = threshold if on else float("inf")
    try:
        yield
    finally:
        dense.MERGE_MIN_ELEMENTS = threshold


def vit_row(variant: str, batch: int):
    model = vit.create_vit(variant, num_classes=10, image_size=224)
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(batch, 224, 224, 3)), jnp.float32)
    labels = jnp.arange(batch) % 10
    params = jax.jit(lambda k: model.init(k, images[:1])["params"])(jax.random.key(0))
    # A nonzero head (timm's is zero at first), so every layer gets a gradient to compare.
    params["head"]["kernel"] = 0.02 * jax.random.normal(jax.random.key(1), (model.width, 10))

    def loss(params):
        logits = model.apply({"params": params}, images)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    return f"ViT {variant} 224 px, batch {batch}", loss, params


def gpt_row(layers=8, width=256, length=256, batch=16, vocab=1024):
    model = gpt.GPT(vocab_size=vocab, block_size=length, n_layer=layers, n_embd=width)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (batch, length + 1)))
    params = jax.jit(lambda k: model.init(k, tokens[:1, :-1])["params"])(jax.random.key(0))

    def loss(params):
        logits = model.apply({"params": params}, tokens[:, :-1])
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
        return -jnp.mean(picked)

    return f"GPT {layers} layers x {width}, length {length}, batch {batch}", loss, params


ROWS = {
    "vit_ti16": lambda: vit_row("Ti/16", 8),
    "vit_b16": lambda: vit_row("B/16", 8),
    "gpt": gpt_row,
}


def transposed_copies(text: str) -> int:
    """Fusions or copies whose output is a 2-D array with more columns than rows of 512 or more:
    an operand laid out as [features, batch * tokens] for a kernel's gradient."""
    found = re.findall(r"= f32\[(\d+),(\d+)\]\S* (?:fusion|copy|transpose)\(", text)
    return sum(1 for a, b in found if int(b) >= 512 and int(b) > int(a))


def measure(name: str, rounds: int, repeats: int) -> dict:
    description, loss, params = ROWS[name]()
    programs, result = {}, {"workload": description}
    for label, on in (("plain", False), ("rows", True)):
        with merge(on):
            start = time.perf_counter()
            programs[label] = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
            result[f"{label}_compile_s"] = time.perf_counter() - start
        text = programs[label].as_text()
        result[f"{label}_fusions"] = text.count(" fusion(")
        result[f"{label}_transposed_copies"] = transposed_copies(text)
    outputs = {label: program(params) for label, program in programs.items()}
    worst = 0.0
    for a, b in zip(*(jax.tree.leaves(outputs[k][1]) for k in ("plain", "rows"))):
        scale = float(jnp.max(jnp.abs(a)))
        if scale > 1e-6:  # zero up to rounding otherwise
            worst = max(worst, float(jnp.max(jnp.abs(a - b))) / scale)
    result["max_gradient_difference"] = worst
    for program in programs.values():
        jax.block_until_ready(program(params))
    calls = {
        label: lambda program=program: jax.block_until_ready(program(params))
        for label, program in programs.items()
    }
    for label, ms in alternating_ms(calls, rounds, repeats).items():
        result[f"{label}_ms"] = ms
    plain, rows = (np.median(result[f"{k}_ms"]) for k in ("plain", "rows"))
    result["speedup"] = float(plain / rows)
    result["rounds_rows_faster"] = sum(r < p for p, r in zip(result["plain_ms"], result["rows_ms"]))
    return result


def table(results: dict, machine: dict) -> str:
    lines = [
        f"Machine: {machine['processor']}, {machine['cores']} cores, one device; jax "
        f"{machine['jax']}; {machine['rounds']} rounds alternating, a round's step the median of "
        f"{machine['repeats']}.",
        "",
        "| workload | fusions, plain / rows | transposed copies, plain / rows | compile s, plain / "
        "rows | step ms, plain | step ms, rows | plain / rows (medians) | rounds rows faster |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        lines.append(
            f"| {r['workload']} | {r['plain_fusions']} / {r['rows_fusions']} | "
            f"{r['plain_transposed_copies']} / {r['rows_transposed_copies']} | "
            f"{r['plain_compile_s']:.1f} / {r['rows_compile_s']:.1f} | "
            f"{', '.join(f'{x:.0f}' for x in r['plain_ms'])} | "
            f"{', '.join(f'{x:.0f}' for x in r['rows_ms'])} | {r['speedup']:.3f}x | "
            f"{r['rounds_rows_faster']} of {len(r['rows_ms'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "dense_rows_cpu.json"))
    args = parser.parse_args()
    if jax.default_backend() != "cpu":
        sys.exit("dense_rows_cpu: a CPU benchmark; run it with JAX_PLATFORMS=cpu")
    results = {}
    for name in args.rows.split(","):
        results[name] = measure(name, args.rounds, args.repeats)
        print(name, json.dumps(results[name]), flush=True)
    machine = dict(
        processor=processor(),
        cores=cpu_cores(),
        jax=jax.__version__,
        rounds=args.rounds,
        repeats=args.repeats,
    )
    out = pathlib.Path(args.out)
    out.write_text(json.dumps({"machine": machine, "rows": results}, indent=2) + "\n")
    text = table(results, machine)
    out.with_suffix(".md").write_text(
        "# Dense layers over merged rows against the plain product, CPU\n\n" + text + "\n"
    )
    print(text)


if __name__ == "__main__":
    main()
