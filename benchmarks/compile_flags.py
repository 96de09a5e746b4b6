"""Compile time of the suite's programs under XLA's CPU flags: which flags the suite sets.

    python benchmarks/compile_flags.py [--repeats 2] [--json benchmarks/results/compile_flags.json]
                                       [--sets '{"name": "--xla_flag=value ...", ...}']

Each flag set runs in fresh processes (no compilation cache): the tiny VQGAN task's train step
(autoencoder + PatchGAN), the digits ViT's train step and the parameter gradient of a small
GPT. It prints XLA's compile seconds, traced and lowered beforehand (the fastest of the
repeats, wall and the process's CPU: the suite's two workers are bound by CPU, and XLA compiles
parts of a program on several threads), and the values the programs compute, which must agree
to float32 rounding for a flag to be acceptable in the suite. ``--sets`` measures other flag sets
instead of the suite's candidates (``$XLA_FLAGS`` of each: attnjax's own flags are added where a
set does not name them).
"""

import argparse
import json
import os
import subprocess
import sys

from attnjax import compat
from attnjax.ops.platform import processor

FLAG_SETS = {
    "default": "",
    "-O0": "--xla_backend_optimization_level=0",
}
SUITE = ["--xla_backend_optimization_level=0", *compat.xla_cpu_loop_emitter_flags()]
if compat.xla_cpu_loop_emitter_flags():  # gone from jaxlib 0.11.1 on
    FLAG_SETS["-O0, loop emitters"] = " ".join(SUITE)
# LLVM code generation in one part instead of parts compiled on a thread pool: less CPU in all.
FLAG_SETS["+ one codegen part"] = " ".join([*SUITE, "--xla_cpu_parallel_codegen_split_count=1"])

PROGRAMS = r"""
import functools, json, time
import jax, jax.numpy as jnp, numpy as np
import configs
from attnjax.models.gpt import GPT
from attnjax.tasks import classification, vqgan

def compiled(step, *args):
    lowered = jax.jit(step).lower(*args)
    start, cpu = time.perf_counter(), time.process_time()
    program = lowered.compile()
    return program, (time.perf_counter() - start, time.process_time() - cpu)

out = {}
config = configs.load("vqgan_digits")
config.model.ddconfig.update(ch_mult=(1,), num_res_blocks=1)
config.loss.update(disc_start=2, disc_weight=0.5)
model = vqgan.create_model(config)
batch = {"image": np.random.default_rng(1).uniform(-1, 1, (16, 16, 16, 1)).astype(np.float32)}
state = vqgan.create_train_state(jax.random.key(0), config, model, batch)
step = functools.partial(vqgan.train_step, config=config, model=model)
program, seconds = compiled(step, state, batch, jax.random.key(1))
out["vqgan train step"] = (seconds, float(program(state, batch, jax.random.key(1))[1]["loss"]))

config = configs.load("vit_digits")
model = classification.create_model(config)
batch = {
    "image": np.random.default_rng(1).uniform(-1, 1, (32, 16, 16, 1)).astype(np.float32),
    "label": (np.arange(32) % 10).astype(np.int32),
}
state = classification.create_train_state(jax.random.key(0), config, model, batch)
step = functools.partial(classification.train_step, config=config, model=model)
program, seconds = compiled(step, state, batch, jax.random.key(1))
out["vit train step"] = (seconds, float(program(state, batch, jax.random.key(1))[1]["loss"]))

gpt = GPT(vocab_size=64, block_size=128, n_layer=2, n_head=4, n_embd=64)
tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 128)), jnp.int32)
params = jax.jit(gpt.init)(jax.random.key(0), tokens)
grad = jax.grad(lambda p, x: jnp.mean(gpt.apply(p, x) ** 2))
program, seconds = compiled(grad, params, tokens)
norm = sum(float(jnp.sum(g**2)) for g in jax.tree.leaves(program(params, tokens))) ** 0.5
out["gpt gradient"] = (seconds, norm)
print(json.dumps(out))
"""


def measure(flags: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, ATTNJAX_CPU_AUTOTUNE="0")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(
        [sys.executable, "-c", PROGRAMS], env=env, cwd=root, capture_output=True, text=True
    )
    if run.returncode:
        raise SystemExit(f"compile_flags.py: {flags!r} failed:\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per flag set")
    parser.add_argument("--json", help="write the table here too")
    parser.add_argument("--sets", help="flag sets as JSON, name -> $XLA_FLAGS (default: above)")
    args = parser.parse_args(argv)
    sets = json.loads(args.sets) if args.sets else FLAG_SETS
    results = {}
    for name, flags in sets.items():
        runs = [measure(flags) for _ in range(args.repeats)]
        results[name] = {
            program: {
                "compile_seconds": min(run[program][0][0] for run in runs),
                "compile_cpu_seconds": min(run[program][0][1] for run in runs),
                "value": runs[0][program][1],
            }
            for program in runs[0]
        }
        print(f"{name}: done", file=sys.stderr)
    print(f"Processor: {processor()} ({os.cpu_count()} cores), fastest of {args.repeats} processes")
    print("| program | " + " | ".join(sets) + " |")
    print("|---|" + "---|" * len(sets))
    for program in next(iter(results.values())):
        cells = [
            f"{results[name][program]['compile_seconds']:.2f} s, "
            f"CPU {results[name][program]['compile_cpu_seconds']:.2f} s "
            f"({results[name][program]['value']:.6g})"
            for name in sets
        ]
        print(f"| {program} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"flags": sets, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
