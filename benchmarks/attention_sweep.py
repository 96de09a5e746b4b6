"""What a new attention shape costs on a CPU: 8 random shapes (batch 1-3, 2-8 heads, head dim 32
or 64, 50-1000 tokens, causal or not), each jitted forward and gradient of
``scaled_dot_product_attention`` once, in a fresh process per mode:

* ``timing off``: ``ATTNJAX_CPU_AUTOTUNE=0``, the rule's defaults (the floor);
* ``fresh machine``: the defaults of today, an empty choice cache (a user's first calls);
* ``timing every shape``: ``ATTNJAX_CPU_AUTOTUNE=always``, every new class timed where met (a
  training run's first step meets its classes so; it fills the cache);
* ``filled cache``: the defaults again, on the cache the run before filled.

    python benchmarks/attention_sweep.py [--seed 0]

No persistent compilation cache in any mode: each pays its compilations. Writes
benchmarks/results/attention_sweep.{json,md} with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

from attnjax.ops.platform import cpu_cores, processor

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

SWEEP = r"""
import json, sys, time
start = time.perf_counter()
import jax, jax.numpy as jnp, numpy as np
from attnjax.ops.attention import scaled_dot_product_attention
shapes = json.loads(sys.argv[1])
rng = np.random.default_rng(0)
for batch, heads, length, dim, causal in shapes:
    q, k, v = (jnp.asarray(rng.standard_normal((batch, heads, length, dim)), jnp.float32)
               for _ in range(3))
    attend = lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=causal)
    jax.block_until_ready(jax.jit(attend)(q, k, v))
    loss = lambda q, k, v: jnp.sum(attend(q, k, v) ** 2)
    jax.block_until_ready(jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v))
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def random_shapes(seed: int) -> list[list]:
    rng = np.random.default_rng(seed)
    return [
        [
            int(rng.integers(1, 4)),
            int(rng.integers(2, 9)),
            int(rng.integers(50, 1001)),
            int(rng.choice([32, 64])),
            bool(rng.integers(0, 2)),
        ]
        for _ in range(8)
    ]


def run(shapes, env) -> float:
    out = subprocess.run(
        [sys.executable, "-c", SWEEP, json.dumps(shapes)],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "attention_sweep.json"))
    args = parser.parse_args()
    shapes = random_shapes(args.seed)
    base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    base.pop("ATTNJAX_CPU_AUTOTUNE", None)
    base["JAX_PLATFORMS"] = "cpu"  # a CPU machine: no TPU runtime to probe
    load_before = os.getloadavg()[0]
    seconds = {}
    with tempfile.TemporaryDirectory() as directory:
        fresh = dict(base, ATTNJAX_CPU_AUTOTUNE_CACHE=f"{directory}/fresh.json")
        filled = dict(base, ATTNJAX_CPU_AUTOTUNE_CACHE=f"{directory}/filled.json")
        seconds["timing off"] = run(shapes, dict(base, ATTNJAX_CPU_AUTOTUNE="0"))
        seconds["fresh machine"] = run(shapes, fresh)
        seconds["timing every shape"] = run(shapes, dict(filled, ATTNJAX_CPU_AUTOTUNE="always"))
        seconds["filled cache"] = run(shapes, filled)
    off = seconds["timing off"]
    machine = dict(
        processor=processor(),
        cores=cpu_cores(),
        load_before=round(load_before, 2),
        load_after=round(os.getloadavg()[0], 2),
    )
    lines = [
        f"Machine: {machine['processor']}, {machine['cores']} cores (load average "
        f"{machine['load_before']} before, {machine['load_after']} after).",
        f"Shapes (batch, heads, tokens, head dim, causal): {shapes}",
        "",
        "| mode | seconds | / timing off |",
        "|---|---|---|",
        *(f"| {mode} | {s:.1f} | {s / off:.2f} |" for mode, s in seconds.items()),
    ]
    text = "\n".join(lines)
    print(text)
    out = pathlib.Path(args.out)
    out.write_text(json.dumps(dict(machine=machine, shapes=shapes, seconds=seconds), indent=2))
    out.with_suffix(".md").write_text(f"# A new attention shape's cost on a CPU\n\n{text}\n")


if __name__ == "__main__":
    main()
