"""Seconds to an initial train state on the device: computed there (``task.create_train_state``
on the default device) against computed on the host's CPU and then placed
(``attnjax.train.loop.initial_state``, what the training loop does), for the GPU check's ViT-B/16,
f16 VQGAN and prior configs. Each path runs in a fresh process with no compilation cache, so
both include their compiles.

    python benchmarks/gpu/initial_state.py [--out DIR] [--dry-run]  # DIR/initial_state.json

On a machine whose default device is the CPU both paths are the same computation.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
PATHS = ("on_device", "on_host_cpu")
ROWS = ("vit", "vqgan", "prior")


def measure(row: str, path: str, dry_run: bool) -> dict:
    """In this process: the seconds from the task's state being asked for to its arrays placed on
    the first device and ready."""
    sys.path.insert(0, str(HERE.parents[1]))  # attnjax and configs of this checkout
    sys.path.append(str(HERE.parent))  # timing.py, behind every installed module
    import jax
    import measure as parts

    from attnjax import tasks
    from attnjax.train import loop

    mode = parts._mode(dry_run)
    if row == "prior":
        config, n_embed, _ = parts.prior_config(dry_run)
        batch_size = parts.PRIOR[mode]["batch"]
        high = {"codes": n_embed, "label": config.num_classes}
    else:
        name, sizes = (
            ("vit_imagenet", parts.VIT) if row == "vit" else ("vqgan_imagenet_f16", parts.VQGAN)
        )
        config = parts._config(name, sizes[mode]["overrides"])
        batch_size, high = config.batch_size, {"label": config.get("num_classes", 1000)}
    task = tasks.get_task(config.task)
    model = task.create_model(config)
    batch = parts._synthetic_batch(task.abstract_batch(config, batch_size), high)
    device = jax.devices()[0]
    start = time.perf_counter()
    rng = jax.random.PRNGKey(config.seed)
    if path == "on_device":
        state = task.create_train_state(rng, config, model, batch)
    else:
        state = loop.initial_state(task, config, model, batch, rng)
    state = jax.block_until_ready(jax.device_put(state, device))
    seconds = time.perf_counter() - start
    leaves = jax.tree.leaves(state)
    return {
        "seconds": seconds,
        "device": f"{device} ({device.device_kind})",
        "jax": jax.__version__,
        "host_cpus": os.cpu_count(),
        "arrays": len(leaves),
        "parameters": int(sum(x.size for x in jax.tree.leaves(state.params))),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # row,path: measure in this process
    args = parser.parse_args()
    if args.one:
        row, path = args.one.split(",")
        print(json.dumps(measure(row, path, args.dry_run)))
        return 0
    results = {}
    for row in ROWS:
        for path in PATHS:
            command = [sys.executable, __file__, "--one", f"{row},{path}"]
            done = subprocess.run(command + ["--dry-run"] * args.dry_run, cwd=HERE.parents[1],
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
            if done.returncode:
                results[f"{row}/{path}"] = {"error": done.stderr.strip().splitlines()[-1:]}
            else:
                results[f"{row}/{path}"] = json.loads(done.stdout.strip().splitlines()[-1])
            print(row, path, results[f"{row}/{path}"], flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "initial_state.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
