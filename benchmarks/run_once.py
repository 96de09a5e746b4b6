"""Programs a run calls once, compiled with XLA's defaults or with ``xla_cpu.run_once_options``
(LLVM's optimisation off, the loop emitters where jaxlib has them, one code-generation part): a
model's initialisation, compile seconds and its one run, from small models to ViT-B/16. Where the
run-once options stop paying is ``xla_cpu.RUN_ONCE_MAX_ELEMENTS``.

    python benchmarks/run_once.py [--rounds 2] [--models prior_digits,vit_digits,...]

Each (model, options) pair compiles in a fresh process (no cache of any kind, nothing else
compiling), the two option sets alternating, ``--rounds`` times; the table shows the medians.
Writes benchmarks/results/run_once.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

from attnjax.ops.platform import processor_details

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]
MODELS = ["prior_digits", "vit_digits", "vqgan_digits", "Ti/16", "S/16", "B/16"]
OPTIONS = ["default", "run_once"]


def _init(name: str):
    """``(init(key, x) -> params, x)`` for a model of the table."""
    import jax.numpy as jnp

    from attnjax.models import gpt, vit

    if name == "prior_digits":  # configs/prior_digits.py's GPT over the 4x4 codes
        model = gpt.GPT(vocab_size=522, block_size=16, n_layer=4, n_head=4, n_embd=128)
        return model.init, jnp.zeros((1, 16), jnp.int32)
    if name in ("vit_digits", "vqgan_digits"):
        import configs
        from attnjax import tasks

        config = configs.load(name)
        task = tasks.get_task(config.task)
        model = task.create_model(config)
        model = model["autoencoder"] if isinstance(model, dict) else model
        size = config.data.image_size
        return model.init, jnp.zeros((1, size, size, config.data.get("channels", 1)))
    return vit.create_vit(name, num_classes=1000).init, jnp.zeros((1, 224, 224, 3))


def worker(name: str, options: str) -> dict:
    """In a fresh process: one model's initialisation compiled under one option set."""
    import time

    import jax

    from attnjax import xla_cpu

    init, x = _init(name)
    lowered = jax.jit(lambda key, x: init(key, x)["params"]).lower(jax.random.key(0), x)
    elements = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(lowered.out_info))
    compiler_options = xla_cpu.run_once_options(0) if options == "run_once" else None
    start = time.perf_counter()
    compiled = lowered.compile(compiler_options=compiler_options)
    compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(compiled(jax.random.key(0), x))
    run_seconds = time.perf_counter() - start
    return dict(elements=elements, compile=compile_seconds, run=run_seconds)


def fresh_process(script: str, *args: str) -> dict:
    """The JSON that ``script`` prints last, run with ``args`` in a fresh process on the CPU
    without JAX's compilation cache."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    command = [sys.executable, script, *args]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    runs: dict = {}
    for round_index in range(args.rounds):
        for name in args.models.split(","):
            order = OPTIONS if round_index % 2 == 0 else OPTIONS[::-1]
            for options in order:
                result = fresh_process(__file__, "--worker", name, options)
                runs.setdefault(name, {}).setdefault(options, []).append(result)
                print(name, options, result, flush=True)
    rows = []
    for name, by_options in runs.items():
        row = dict(model=name, elements=by_options["default"][0]["elements"])
        for options, results in by_options.items():
            for part in ("compile", "run"):
                row[f"{options}_{part}"] = float(np.median([r[part] for r in results]))
        row["saved"] = (row["default_compile"] + row["default_run"]) - (
            row["run_once_compile"] + row["run_once_run"]
        )
        rows.append(row)
    import jax

    machine = dict(processor=processor_details(), jax=jax.__version__, rounds=args.rounds)
    (RESULTS / "run_once.json").write_text(json.dumps(dict(machine=machine, rows=rows), indent=2))
    lines = [
        "# Run-once programs: XLA's defaults against `xla_cpu.run_once_options`",
        "",
        f"`python benchmarks/run_once.py` ([run_once.json](run_once.json)): a model's "
        "initialisation compiled in a fresh process under each option set, then run once; "
        f"medians of {args.rounds} rounds, the option sets alternating. AMD EPYC, 2 cores "
        f"({machine['processor']}), jax {machine['jax']}. Saved: default compile + run minus "
        "run-once compile + run.",
        "",
        "| model | output elements | default: compile s | run s | run-once: compile s | run s "
        "| saved s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['elements']:,} | {r['default_compile']:.2f} | "
            f"{r['default_run']:.2f} | {r['run_once_compile']:.2f} | {r['run_once_run']:.2f} | "
            f"{r['saved']:+.2f} |"
        )
    (RESULTS / "run_once.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
