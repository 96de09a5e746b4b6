"""The exact GELU written with erf (attnjax.ops.activations) against jax.nn.gelu's erfc form, alone
and inside the train steps of compare_torch.py whose blocks hold one, with PyTorch beside them.

    python benchmarks/gelu.py [--rows vit_cifar_train,vit_ti16_train,gpt_train] [--rounds 4]

Alone: forward, and forward plus the input's gradient, of each form on one device's share of
a ViT cifar hidden layer and of a ViT-B/16 one, beside torch's GELU. In the steps: each row is
built twice, its models' GELU bound to each form, and both steps are kept compiled in one
process and timed in turn (``--rounds`` times the median of ``--repeats`` calls), then torch's
step, so a slow spell of the machine falls on all three. XLA's temporary bytes of each step are
from its compiled program. Writes benchmarks/results/gelu_<platform>.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import tempfile

from attnjax import huge_pages

if __name__ == "__main__":
    huge_pages.restart_with_huge_pages()  # as compare_torch.py runs its rows

import compare_torch  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from timing import alternating_ms  # noqa: E402

from attnjax.models import gpt, transformer, vit_blocks  # noqa: E402
from attnjax.ops.activations import gelu  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
FORMS = {"erf": gelu, "erfc": lambda x: jax.nn.gelu(x, approximate=False)}
# One device's share of the hidden layer: ViT cifar's train step (batch 128 over 2 devices) and
# ViT-B/16's (batch 8 over 2).
SHAPES = {"ViT cifar hidden": (64, 65, 512), "ViT-B/16 hidden": (4, 197, 3072)}


@contextlib.contextmanager
def bound(form):
    """The models' GELU is ``form`` while steps are built, traced and compiled."""
    saved = vit_blocks.gelu, gpt.gelu, transformer._ACTIVATIONS["gelu"]
    vit_blocks.gelu = gpt.gelu = transformer._ACTIVATIONS["gelu"] = form
    try:
        yield
    finally:
        vit_blocks.gelu, gpt.gelu, transformer._ACTIVATIONS["gelu"] = saved


def alone(rounds, repeats):
    rows = []
    for name, shape in SHAPES.items():
        x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
        xj, calls = jnp.asarray(x), {}
        for form, f in FORMS.items():
            forward = jax.jit(f)
            grad = jax.jit(jax.grad(lambda x, f=f: jnp.sum(f(x))))
            calls[f"{form} forward"] = lambda f=forward, xj=xj: f(xj).block_until_ready()
            calls[f"{form} forward+grad"] = lambda g=grad, xj=xj: g(xj).block_until_ready()
        xt = torch.tensor(x, requires_grad=True)

        def torch_forward():
            with torch.no_grad():
                torch.nn.functional.gelu(xt)

        def torch_grad():
            xt.grad = None
            torch.nn.functional.gelu(xt).sum().backward()

        calls["torch forward"], calls["torch forward+grad"] = torch_forward, torch_grad
        for call in calls.values():
            call()
        ms = alternating_ms(calls, rounds, repeats)
        medians = {k: float(np.median(v)) for k, v in ms.items()}
        rows.append(dict(shape=name, dims=shape, ms=medians))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def in_steps(names, rounds, repeats, directory):
    rows = []
    for name in names:
        calls, temp = {}, {}
        for form, f in FORMS.items():
            with bound(f):
                description, step, torch_step = compare_torch.rows(False, directory)[name]()
                step()
            calls[form], temp[form] = step, step.temp_mib
        calls["torch"] = torch_step
        torch_step()
        ms = alternating_ms(calls, rounds, repeats)
        rows.append(dict(row=name, workload=description, ms=ms, temp_mib=temp))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def table(record) -> str:
    m = record["machine"]
    lines = [
        "# The exact GELU with erf against erfc (`python benchmarks/gelu.py`)",
        "",
        f"{m['cpu']}, {m['cores']} cores; jax {m['jax']} with `{m['xla_flags']}` on "
        f"{m['jax_device_count']} device(s), glibc tunables `{m['glibc_tunables']}`; torch "
        f"{m['torch']} on {m['torch_threads']} threads. Median ms of {record['repeats']} calls, "
        f"taken in turn {record['rounds']} times (each round's median listed in the steps).",
        "",
        "| GELU alone | erf fwd | erfc fwd | torch fwd | erf fwd+grad | erfc fwd+grad "
        "| torch fwd+grad |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in record["alone"]:
        ms = r["ms"]
        cells = [f"{ms[f'{s} {k}']:.2f}" for k in ("forward", "forward+grad") for s in FORMS]
        cells.insert(2, f"{ms['torch forward']:.2f}")
        cells.append(f"{ms['torch forward+grad']:.2f}")
        dims = "x".join(map(str, r["dims"]))
        lines.append(f"| {r['shape']} {dims} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| train step | erf ms | erfc ms | erfc / erf | torch ms | torch / erf | torch / erfc "
        "| temp MiB erf | temp MiB erfc |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["steps"]:
        med = {k: float(np.median(v)) for k, v in r["ms"].items()}
        rounds = {k: ", ".join(f"{x:.0f}" for x in v) for k, v in r["ms"].items()}
        lines.append(
            f"| {r['workload']} | {rounds['erf']} | {rounds['erfc']} "
            f"| {med['erfc'] / med['erf']:.3f} | {rounds['torch']} "
            f"| {med['torch'] / med['erf']:.2f} | {med['torch'] / med['erfc']:.2f} "
            f"| {r['temp_mib']['erf']:.0f} | {r['temp_mib']['erfc']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="vit_cifar_train,vit_ti16_train,gpt_train")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--name", default=None, help="results file stem (default gelu_<platform>)")
    compare_torch.add_cpu_devices_flag(parser)
    args = parser.parse_args()
    compare_torch.use_devices(args.cpu_devices)
    torch.set_num_threads(os.cpu_count())
    record = dict(machine=compare_torch.machine(), rounds=args.rounds, repeats=args.repeats)
    record["alone"] = alone(args.rounds, 20)
    with tempfile.TemporaryDirectory() as directory:
        names = [n for n in args.rows.split(",") if n]
        record["steps"] = in_steps(names, args.rounds, args.repeats, directory)
    stem = args.name or f"gelu_{jax.default_backend()}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(record, indent=2))
    (RESULTS / f"{stem}.md").write_text(table(record))
    print(table(record))


if __name__ == "__main__":
    main()
