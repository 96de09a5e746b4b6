"""What a set of XLA flags does to the wait for the first step: ``first_step.py``'s rows started
under ``$XLA_FLAGS`` ``--a`` against ``--b`` (the user's flags: they win over attnjax's own), each
setting with its own caches (compiled programs, CPU kernel choices, the prior's VQGAN codes), cold
(empty) and then warm twice, the settings alternating in rounds.

    python benchmarks/first_step_flags.py \\
        --a='--xla_cpu_enable_concurrency_optimized_scheduler=true' \\
        --b='--xla_cpu_enable_concurrency_optimized_scheduler=false' \\
        [--rows vit_b16,vqgan_digits] [--rounds 2] --name scheduler

Seconds from the process's start to the loop's ``first step done`` line, as first_step.py times
them. Writes benchmarks/results/first_step_flags_<name>.{json,md} with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile

import first_step

from attnjax.ops.platform import cpu_cores, processor, processor_details

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
KINDS = ("cold", "warm", "warm again")


def starts(name: str, flags: str, directory: pathlib.Path, inputs, tag: str) -> list[float]:
    """Seconds to the first step of ``name`` under ``flags``: cold, warm, warm again."""
    _, config_flags, _ = first_step.ROWS[name]
    data_dir, vqgan, folder = inputs
    env = first_step.environment(str(directory / f"cache_{tag}"))
    env["XLA_FLAGS"] = flags
    seconds = []
    for index in range(len(KINDS)):
        workdir = str(directory / f"run_{tag}_{index}")
        command = first_step.jax_command(config_flags, workdir, data_dir, folder, vqgan)
        if "prior" in name:  # the VQGAN's codes encoded cold, then read, per setting
            command.append(f"--config.codes_cache_dir={directory / f'codes_{tag}'}")
        seconds.append(round(first_step.timed_until_first_step(command, env)[0], 2))
    return seconds


def table(result: dict) -> str:
    flags = result["flags"]
    lines = [
        f"Machine: {result['machine']['processor']} ({result['machine']['details']}), "
        f"{result['machine']['cores']} cores. `$XLA_FLAGS` a: `{flags['a']}`; b: `{flags['b']}`"
        " (attnjax's own flags added to either where it does not set them).",
        "",
        "| workload | start | a (s), each round | b (s), each round | a / b (medians) |",
        "|---|---|---|---|---|",
    ]
    for name, runs in result["rows"].items():
        for index, kind in enumerate(KINDS):
            a = [r[index] for r in runs["a"]]
            b = [r[index] for r in runs["b"]]
            ratio = statistics.median(a) / statistics.median(b)
            lines.append(
                f"| {first_step.ROWS[name][0]} | {kind} | {', '.join(f'{x:.1f}' for x in a)} | "
                f"{', '.join(f'{x:.1f}' for x in b)} | {ratio:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--a", default="", help="$XLA_FLAGS of the first setting (--a=...)")
    parser.add_argument("--b", required=True, help="$XLA_FLAGS of the second setting (--b=...)")
    parser.add_argument("--rows", default="vit_b16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", required=True, help="the results' file name suffix")
    args = parser.parse_args()
    names = args.rows.split(",")
    unknown = sorted(set(names) - set(first_step.ROWS))
    if unknown:
        parser.error(
            f"--rows: unknown rows {unknown}; expected names from {sorted(first_step.ROWS)}"
        )
    machine = dict(processor=processor(), details=processor_details(), cores=cpu_cores())
    result = dict(machine=machine, flags={"a": args.a, "b": args.b}, rows={})
    with tempfile.TemporaryDirectory() as directory:
        directory = pathlib.Path(directory)
        inputs = first_step.prepare(directory)
        for name in names:
            runs = result["rows"][name] = {"a": [], "b": []}
            for round_ in range(args.rounds):
                for which in "ab" if round_ % 2 == 0 else "ba":
                    flags = getattr(args, which)
                    tag = f"{name}_{which}_{round_}"
                    runs[which].append(starts(name, flags, directory, inputs, tag))
                    print(f"{name} {which} round {round_}: {runs[which][-1]}", flush=True)
    text = table(result)
    print("\n" + text)
    out = RESULTS / f"first_step_flags_{args.name}.json"
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(f"# First steps under two sets of XLA flags\n\n{text}\n")
    print(f"saved {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    os.chdir(first_step.ROOT)
    main()
