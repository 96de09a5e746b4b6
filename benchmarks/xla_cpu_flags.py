"""XLA:CPU's flags, family by family: which ones attnjax sets for speed (attnjax/xla_cpu.py).

    python benchmarks/xla_cpu_flags.py [--repeats 20] [--json benchmarks/results/xla_cpu_flags.json]

Each flag set runs in a fresh process (no compilation cache, nothing else in ``$XLA_FLAGS``) and
times every operation family attnjax's models are made of, each jitted on its own: a
VQGAN-sized convolution (``[16, 32, 32, 64]`` NHWC by 3x3x64x64) forward, input gradient,
kernel gradient and all three in one program, a wider one at 16x16 with 128 channels, a
matrix product with both gradients, a reduction and an elementwise chain. A cell is the median
of ``--repeats`` calls and the cores the calls kept busy (the process's CPU time over wall
time). "attnjax" is the set ``attnjax.xla_cpu.speed_flags()`` picks for the installed jaxlib;
every set must give the same values to float32 rounding (the last column checks it).
"""

import argparse
import json
import os
import subprocess
import sys

from attnjax import compat
from attnjax.ops.platform import processor

YNN = "--xla_cpu_experimental_ynn_fusion_type="
FLAG_SETS = {
    "default": "",
    "YNNPACK off": YNN,
    "YNNPACK less convolutions": f"{YNN}-individual_convolution",
    "YNNPACK less convolutions, elementwise": f"{YNN}-individual_convolution,-eltwise",
    "YNNPACK reductions only": f"{YNN}reduce",
    "attnjax": " ".join(compat.xla_cpu_speed_flags()),
}

PROGRAMS = r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax import lax

repeats = int(sys.argv[1])
rng = np.random.default_rng(0)

def conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))

def conv_family(prefix, x_shape, w_shape):
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[:3])), jnp.float32)
    g = jnp.asarray(rng.standard_normal(x_shape[:3] + w_shape[3:]), jnp.float32)
    both = lambda x, w: jax.vjp(conv, x, w)[1](g)
    return {
        f"{prefix} forward": (jax.jit(conv), (x, w)),
        f"{prefix} input gradient": (jax.jit(lambda x, w: both(x, w)[0]), (x, w)),
        f"{prefix} kernel gradient": (jax.jit(lambda x, w: both(x, w)[1]), (x, w)),
        f"{prefix} forward + both gradients": (
            jax.jit(lambda x, w: (conv(x, w), *both(x, w))), (x, w)),
    }

programs = {}
programs.update(conv_family("conv 32x32x64", (16, 32, 32, 64), (3, 3, 64, 64)))
programs.update(conv_family("conv 16x16x128", (16, 16, 16, 128), (3, 3, 128, 128)))
a = jnp.asarray(rng.standard_normal((2048, 1024)), jnp.float32)
b = jnp.asarray(rng.standard_normal((1024, 1024)) / 32, jnp.float32)
dot_grads = lambda a, b: jax.vjp(jnp.matmul, a, b)[1](jnp.ones((2048, 1024), jnp.float32))
programs["dot 2048x1024x1024 + both gradients"] = (
    jax.jit(lambda a, b: (a @ b, *dot_grads(a, b))), (a, b))
big = jnp.asarray(rng.standard_normal((4096, 4096)), jnp.float32)
programs["reduction: layer-norm statistics 4096x4096"] = (
    jax.jit(lambda x: (x.mean(-1), x.var(-1), x.sum(0))), (big,))
programs["elementwise: gelu(x) * x + 1, 4096x4096"] = (
    jax.jit(lambda x: jax.nn.gelu(x) * x + 1.0), (big,))

out = {}
for name, (fn, args) in programs.items():
    values = jax.block_until_ready(fn(*args))
    times = []
    cpu = time.process_time()
    wall = time.perf_counter()
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    busy = (time.process_time() - cpu) / (time.perf_counter() - wall)
    checksum = float(sum(jnp.sum(jnp.abs(v)) for v in jax.tree.leaves(values)))
    out[name] = {"ms": 1e3 * float(np.median(times)), "cores_busy": busy, "checksum": checksum}
print(json.dumps(out))
"""


def measure(flags: str, repeats: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    run = subprocess.run(
        [sys.executable, "-c", PROGRAMS, str(repeats)], env=env, capture_output=True, text=True
    )
    if run.returncode:
        raise SystemExit(f"xla_cpu_flags.py: {flags!r} failed:\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per program")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    results = {}
    for name, flags in FLAG_SETS.items():
        results[name] = measure(flags, args.repeats)
        print(f"{name}: done", file=sys.stderr)
    versions = f"jax {compat.version('jax')}, jaxlib {compat.version('jaxlib')}"
    print(f"Processor: {processor()} ({os.cpu_count()} cores), {versions}")
    for name, flags in FLAG_SETS.items():
        print(f"- {name}: `{flags or '(none)'}`")
    print("\nms, median of", args.repeats, "(cores busy)\n")
    print("| program | " + " | ".join(FLAG_SETS) + " | largest relative difference |")
    print("|---|" + "---|" * (len(FLAG_SETS) + 1))
    for program in results["default"]:
        cells = [
            f"{results[n][program]['ms']:.1f} ({results[n][program]['cores_busy']:.2f})"
            for n in FLAG_SETS
        ]
        sums = [results[n][program]["checksum"] for n in FLAG_SETS]
        spread = (max(sums) - min(sums)) / max(abs(s) for s in sums)
        print(f"| {program} | " + " | ".join(cells) + f" | {spread:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            record = {"processor": processor(), "versions": versions, "flags": FLAG_SETS}
            json.dump({**record, "repeats": args.repeats, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
