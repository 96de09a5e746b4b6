"""Matrix products on CPU devices: XLA's own (Eigen) against YNNPACK's, beside PyTorch, at the
shapes attnjax's training rows multiply.

    python benchmarks/dot_paths.py [--devices 1] [--dense] [--rounds 15] [--out ...json]

train.py runs one XLA CPU device per core. ``--devices 1`` (the default) pins the process to one
core, with one XLA device and one torch thread. ``--devices N`` pins nothing: N XLA devices, each
multiplying its own M rows of an ``[N * M, K]`` operand by the same ``[K, N]`` one (data
parallelism, as train.py splits a batch), against torch on N threads multiplying all the rows.
Every product is compiled three times in the same process, with per-program compiler options:
YNNPACK for reductions only (what ``attnjax/xla_cpu.py`` sets: products stay XLA's), for
reductions and the products XLA leaves on their own (XLA's default handling of products), and
for reductions and every product. The sides are called in turn, ``--rounds`` times; a cell is
the median. The shapes are ``[M, K] @ [K, N]`` per device, the forward products of
compare_torch.py's rows on one of two devices and the weight gradients (``x^T @ dy``) of two of
them. ``--dense`` measures Dense layers instead, each in the three forms a data-parallel step
multiplies: the forward ``x @ W``, the input gradient ``dy @ W^T`` and the weight gradient
``x^T @ dy`` over each device's rows, summed over the devices, as XLA is given them (the
transposes are contracting dimensions, not copies). Writes the JSON and a Markdown table with
the machine beside it.
"""

from __future__ import annotations

import argparse
import os


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--devices", type=int, default=1, help="XLA devices (1: pinned to one core)"
    )
    parser.add_argument(
        "--dense",
        action="store_true",
        help="DENSE_LAYERS' forward, input-gradient and weight-gradient products, not SHAPES",
    )
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--out", default=None, help="default: results/dot_paths_cpu[_dense][_<N>_devices].json"
    )
    return parser.parse_args()


# Parsed before jax starts: XLA takes the device count then.
ARGS = parse_args() if __name__ == "__main__" else None
DEVICES = ARGS.devices if ARGS else 1
if ARGS:
    if DEVICES == 1:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
    )

import json  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from timing import alternating_ms  # noqa: E402

from attnjax.ops.platform import processor, processor_details  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
# Per-program values of xla_cpu_experimental_ynn_fusion_type (DebugOptions' enum names).
PATHS = {
    "XLA": "LIBRARY_FUSION_TYPE_REDUCE",
    "YNNPACK alone": "LIBRARY_FUSION_TYPE_REDUCE,LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "YNNPACK": "LIBRARY_FUSION_TYPE_REDUCE,LIBRARY_FUSION_TYPE_DOT",
}
SHAPES = {  # name: (M, K, N)
    "ViT cifar qkv (64 images x 65 tokens)": (4160, 256, 768),
    "ViT cifar fc1": (4160, 256, 512),
    "ViT cifar fc2": (4160, 512, 256),
    "ViT cifar fc1 weight gradient": (256, 4160, 512),
    "GPT 8x256 fc1 (8 x 256 tokens)": (2048, 256, 1024),
    "GPT 8x256 fc2": (2048, 1024, 256),
    "ViT-B/16 qkv (4 images x 197 tokens)": (788, 768, 2304),
    "ViT-B/16 fc1": (788, 768, 3072),
    "ViT-B/16 fc2": (788, 3072, 768),
    "ViT-B/16 fc1 weight gradient": (768, 788, 3072),
    "square 2048 x 1024 x 1024": (2048, 1024, 1024),
}
# --dense: Dense layers of compare_torch.py's rows, (rows a device, in, out), each in FORMS' forms.
DENSE_LAYERS = {
    "ViT-B/16 fc1": (788, 768, 3072),
    "ViT-B/16 fc2": (788, 3072, 768),
    "ViT-B/16 query": (788, 768, 768),
    "ViT cifar fc1": (4160, 256, 512),
    "GPT 8x256 fc1": (2048, 256, 1024),
}


# A Dense layer's three products as a data-parallel step computes them, for rows split over the
# devices: (operand shapes from (M rows a device, K in, N out), the contracting dimensions, whether
# the second operand is split too, the NumPy / torch product).
FORMS = {
    "forward": (lambda m, k, n: ((m, k), (k, n)), ((1,), (0,)), False, lambda a, b: a @ b),
    "input gradient": (lambda m, k, n: ((m, n), (k, n)), ((1,), (1,)), False, lambda a, b: a @ b.T),
    # Each device's rows give a partial sum, which XLA then adds over the devices.
    "weight gradient": (lambda m, k, n: ((m, k), (m, n)), ((0,), (0,)), True, lambda a, b: a.T @ b),
}


def measure(m: int, k: int, n: int, rounds: int, form: str = "forward") -> dict:
    shapes, contracting, both_split, product = FORMS[form]
    (rows_a, cols_a), (rows_b, cols_b) = shapes(m, k, n)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((rows_a * DEVICES, cols_a), dtype=np.float32)
    b = rng.standard_normal((rows_b * (DEVICES if both_split else 1), cols_b), dtype=np.float32)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("rows",))
    P = jax.sharding.PartitionSpec
    xa = jax.device_put(a, jax.sharding.NamedSharding(mesh, P("rows")))
    xb = jax.device_put(b, jax.sharding.NamedSharding(mesh, P("rows" if both_split else None)))
    dims = (contracting, ((), ()))
    lowered = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims)).lower(xa, xb)
    programs = {
        path: lowered.compile({"xla_cpu_experimental_ynn_fusion_type": kinds})
        for path, kinds in PATHS.items()
    }
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    calls = {path: (lambda p=p: p(xa, xb).block_until_ready()) for path, p in programs.items()}
    calls["torch"] = lambda: product(ta, tb)
    ms = alternating_ms(calls, rounds + 1, 1)  # the first round warms up
    reference = product(a.astype(np.float64), b.astype(np.float64))
    scale = np.abs(reference).max()
    outputs = {path: np.asarray(p(xa, xb)) for path, p in programs.items()}
    outputs["torch"] = product(ta, tb).numpy()
    return {
        "shape": [m, k, n],
        "form": form,
        "ms": {side: float(np.median(times[1:])) for side, times in ms.items()},
        "max_error_over_scale": {
            side: float(np.abs(out - reference).max() / scale) for side, out in outputs.items()
        },
        "uses_ynnpack": {path: "ynn" in p.as_text() for path, p in programs.items()},
    }


def table(rows: dict, machine: str, dense: bool = False) -> str:
    where = (
        "one core, one XLA device, one torch thread"
        if DEVICES == 1
        else f"{DEVICES} XLA devices of M rows each, torch on {DEVICES} threads over all rows, "
        "nothing pinned"
    )
    lines = [
        f"# Matrix products on {DEVICES} CPU device(s): XLA's own, YNNPACK's, PyTorch's",
        "",
        f"`python benchmarks/dot_paths.py --devices {DEVICES}{' --dense' if dense else ''}`: "
        f"{machine}; {where}; "
        f"jax {jax.__version__}, torch {torch.__version__}; median of the rounds, ms. YNNPACK "
        "alone: the products XLA leaves unfused (its default); YNNPACK: every product.",
        "",
        "| product | M x K x N | XLA | YNNPACK alone | YNNPACK | torch | XLA / YNNPACK alone | "
        "XLA / torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        ms = row["ms"]
        shape = " x ".join(str(d) for d in row["shape"])
        lines.append(
            f"| {name} | {shape} | {ms['XLA']:.2f} | {ms['YNNPACK alone']:.2f} | "
            f"{ms['YNNPACK']:.2f} | {ms['torch']:.2f} | {ms['XLA'] / ms['YNNPACK alone']:.2f} | "
            f"{ms['XLA'] / ms['torch']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    torch.set_num_threads(DEVICES)
    if ARGS.dense:
        work = {
            f"{name}, {form}": (*shape, form)
            for name, shape in DENSE_LAYERS.items()
            for form in FORMS
        }
    else:
        work = {name: (*shape, "forward") for name, shape in SHAPES.items()}
    rows = {}
    for name, (m, k, n, form) in work.items():
        rows[name] = row = measure(m, k, n, ARGS.rounds, form)
        # XLA's own path never takes YNNPACK; the products YNNPACK takes depend on their form.
        assert not row["uses_ynnpack"]["XLA"], row
        print(name, {side: round(ms, 2) for side, ms in row["ms"].items()}, flush=True)
    machine = f"{processor()} ({processor_details()})"
    suffix = ("_dense" if ARGS.dense else "") + ("" if DEVICES == 1 else f"_{DEVICES}_devices")
    out = pathlib.Path(ARGS.out or RESULTS / f"dot_paths_cpu{suffix}.json")
    out.write_text(
        json.dumps(
            {"machine": machine, "devices": DEVICES, "rounds": ARGS.rounds, "rows": rows}, indent=1
        )
    )
    text = table(rows, machine, ARGS.dense)
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
