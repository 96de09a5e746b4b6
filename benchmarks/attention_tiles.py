"""The blocked attention's CPU tiles by how many cores a device has: 128 x 128 against queries of
512 over keys of 256, causal forward + backward, on one XLA CPU device and on one per core
(train.py's CPU default, the batch or, for a batch of 1, the heads split over the devices).

    python benchmarks/attention_tiles.py [--rounds 3] [--repeats 5]

Each device count runs in a fresh process (XLA fixes it when its backend starts); within it the
two tilings alternate for ``--rounds`` rounds, each the median of ``--repeats`` steps. Prints a
table and writes benchmarks/results/attention_tiles.{json,md} with the machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

from attnjax import huge_pages

if __name__ == "__main__":
    # As train.py starts; the measuring processes inherit the tunables.
    huge_pages.restart_with_huge_pages()

from attnjax.ops.platform import cpu_cores, processor  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SHAPES = [(1, 1024), (4, 1024), (1, 2048), (1, 4096)]  # (batch, tokens); 8 heads of 64
TILES = {"128x128": (128, 128), "512x256": (512, 256)}


def worker(devices: int, rounds: int, repeats: int) -> list[dict]:
    """In a fresh process: per shape, each tiling's median step per round, in ms."""
    from torch_vs_jax import Jax, use_devices

    use_devices(devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from timing import alternating_ms

    from attnjax.ops import blocked_attention

    rows = []
    for batch, length in SHAPES:
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((batch, length, 8, 64), dtype=np.float32) for _ in range(3))
        steps = {}
        for name, (query_block, key_block) in TILES.items():

            def grads(_, q, k, v, query_block=query_block, key_block=key_block):
                def loss(q, k, v):
                    out = blocked_attention.blocked_dot_product_attention(
                        q, k, v, is_causal=True, query_block=query_block, key_block=key_block
                    )
                    return jnp.sum(out * jnp.cos(out))

                return jax.grad(loss, (0, 1, 2))(q, k, v)

            split = (0, 0, 0) if batch % devices == 0 and batch > 1 else (2, 2, 2)
            steps[name] = Jax(grads, (), q, k, v, split=split)
            steps[name]()
        ms = alternating_ms(steps, rounds, repeats)
        rows.append(
            dict(
                devices=steps["128x128"].devices,
                batch=batch,
                tokens=length,
                ms={name: statistics.median(t) for name, t in ms.items()},
                rounds=ms,
            )
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.rounds, args.repeats)))
        return
    rows = []
    for devices in (1, cpu_cores()):
        command = [sys.executable, __file__, "--worker", str(devices)]
        command += ["--rounds", str(args.rounds), "--repeats", str(args.repeats)]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        rows += json.loads(done.stdout.splitlines()[-1])
    machine = dict(cpu=processor(), cores=cpu_cores())
    (RESULTS / "attention_tiles.json").write_text(
        json.dumps({"machine": machine, "rows": rows}, indent=2)
    )
    lines = [
        "# The blocked attention's CPU tiles by cores per device "
        "(`python benchmarks/attention_tiles.py`)",
        "",
        f"{machine['cpu']}, {machine['cores']} cores, huge pages as train.py starts; causal "
        f"forward + backward, 8 heads of 64, float32; median over {args.rounds} alternating "
        f"rounds of the median of {args.repeats} steps, ms.",
        "",
        "| devices | batch x tokens | 128 x 128 | 512 x 256 | 512 x 256 / 128 x 128 |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        small, tall = r["ms"]["128x128"], r["ms"]["512x256"]
        lines.append(
            f"| {r['devices']} | {r['batch']} x {r['tokens']} | {small:.1f} | {tall:.1f} "
            f"| {tall / small:.2f} |"
        )
    (RESULTS / "attention_tiles.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
