"""What a set of XLA compiler options does to whole steps: ``compare_torch.py``'s attnjax steps
compiled twice in one process, under options ``--a`` and ``--b``, and timed in alternating
rounds, so that the spread between processes on a shared machine (10-60% on a row of the 2-core
VMs) does not decide the comparison.

    python benchmarks/step_options.py --b '{"xla_backend_optimization_level": 1}' \\
        [--a '{}'] [--rows vit_cifar_train,gpt_train] [--rounds 5] [--name llvm_o1]

Options are XLA ``DebugOptions`` fields as ``jax.stages.Lowered.compile`` takes them, set per
program on top of the process's ``$XLA_FLAGS`` (attnjax's, as every command starts). Per row:
each program's compile seconds (wall and the process's CPU; ``b`` compiles second), whether
the two compute the same bits, each round's step (median of 3 calls) and the ratio of the
medians. torch is not run. Writes benchmarks/results/step_options_<name>.{json,md} with the
machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

from attnjax import huge_pages

if __name__ == "__main__":
    huge_pages.restart_with_huge_pages()  # as train.py and compare_torch.py start

import jax  # noqa: E402
import numpy as np  # noqa: E402
from compare_torch import rows  # noqa: E402
from timing import alternating_ms  # noqa: E402
from torch_vs_jax import use_devices  # noqa: E402

from attnjax import xla_cpu  # noqa: E402
from attnjax.ops.platform import cpu_cores, processor, processor_details  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
TRAINING = "sdpa_1024,mha,vit_cifar_train,vit_ti16_train,vqgan_autoencoder,gpt_train"


def measure(step, options: dict, rounds: int) -> dict:
    programs, result = {}, {}
    for label in ("a", "b"):
        # A fresh lowering: JAX hands back the program the row compiled already for the same
        # lowering and options.
        jax.clear_caches()
        lowered = step.undonated.lower(step.state, *step.inputs)
        start, cpu = time.perf_counter(), time.process_time()
        programs[label] = lowered.compile(compiler_options=options[label] or None)
        result[f"{label}_compile_s"] = time.perf_counter() - start
        result[f"{label}_compile_cpu_s"] = time.process_time() - cpu
        # The step's temporary buffers: what each call allocates afresh (and a first call faults
        # in), per device.
        result[f"{label}_temp_mib"] = programs[label].memory_analysis().temp_size_in_bytes / 2**20
    outputs = {k: jax.tree.leaves(p(step.state, *step.inputs)) for k, p in programs.items()}
    result["same_bits"] = all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(outputs["a"], outputs["b"])
    )
    calls = {
        label: lambda program=program: jax.block_until_ready(program(step.state, *step.inputs))
        for label, program in programs.items()
    }
    for label, ms in alternating_ms(calls, rounds, 3).items():
        result[f"{label}_ms"] = ms
    result["a_over_b"] = float(np.median(result["a_ms"]) / np.median(result["b_ms"]))
    return result


def compiler_options(flag: str, text: str) -> dict:
    """``--a``/``--b``'s JSON object, or a one-line error naming the flag and its value."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise SystemExit(
            f"--{flag}={text!r}: expected a JSON object of XLA options, e.g. "
            "'{\"xla_backend_optimization_level\": 1}'"
        )
    return value


def table(results: dict, machine: dict) -> str:
    lines = [
        f"Machine: {machine['processor']}, {machine['cores']} cores, {machine['devices']} CPU "
        f"devices; jax {machine['jax']}; $XLA_FLAGS `{machine['xla_flags']}`; a: "
        f"`{json.dumps(machine['a'])}`, b: `{json.dumps(machine['b'])}`; {machine['rounds']} "
        "rounds alternating, a round's step the median of 3 calls.",
        "",
        "| workload | compile s (CPU s), a | compile s (CPU s), b | temp MiB, a | temp MiB, b | "
        "same bits | step ms, a | step ms, b | a / b (medians) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        lines.append(
            f"| {r['workload']} | {r['a_compile_s']:.2f} ({r['a_compile_cpu_s']:.2f}) | "
            f"{r['b_compile_s']:.2f} ({r['b_compile_cpu_s']:.2f}) | "
            f"{r.get('a_temp_mib', float('nan')):.0f} | {r.get('b_temp_mib', float('nan')):.0f} | "
            f"{'yes' if r['same_bits'] else 'no'} | {', '.join(f'{x:.0f}' for x in r['a_ms'])} | "
            f"{', '.join(f'{x:.0f}' for x in r['b_ms'])} | {r['a_over_b']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--a", default="{}", help="compiler options as JSON (default: none)")
    parser.add_argument("--b", required=True, help="compiler options as JSON")
    parser.add_argument("--rows", default=TRAINING)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--name", required=True, help="the results' file name suffix")
    args = parser.parse_args()
    options = {"a": compiler_options("a", args.a), "b": compiler_options("b", args.b)}
    use_devices(0)  # one XLA device per core, as train.py runs
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        table_rows = rows(False, directory)
        for name in args.rows.split(","):
            if name not in table_rows:
                raise ValueError(
                    f"--rows: unknown row {name!r}; expected one of {list(table_rows)}"
                )
            description, step, _ = table_rows[name]()
            results[name] = {"workload": description, **measure(step, options, args.rounds)}
            print(name, json.dumps(results[name]), flush=True)
    machine = dict(
        processor=f"{processor()} ({processor_details()})",
        cores=cpu_cores(),
        devices=jax.device_count(),
        jax=jax.__version__,
        xla_flags=xla_cpu.in_effect(),
        rounds=args.rounds,
        **options,
    )
    out = RESULTS / f"step_options_{args.name}.json"
    out.write_text(json.dumps(dict(machine=machine, rows=results), indent=2))
    text = table(results, machine)
    title = f"# `benchmarks/step_options.py --name {args.name}`"
    out.with_suffix(".md").write_text(f"{title}\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
