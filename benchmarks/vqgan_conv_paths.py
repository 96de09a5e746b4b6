"""The VQGAN autoencoder train step on one CPU device with each kernel-gradient path, and torch.

    python benchmarks/vqgan_conv_paths.py [--repeats 9] [--batch 16]

``compare_torch.py``'s ``vqgan_autoencoder`` row (taming's Encoder/Decoder + VQ, 32 px, ch 64,
the same weights on both sides), built three times on one XLA CPU device:

* default: what attnjax runs, every large 3x3 and 1x1 convolution's kernel gradient timed on
  this machine (``attnjax.ops.autotune``, chosen afresh here, not read from the user's cache);
* products forced: every such kernel gradient as ``kh * kw`` matrix products;
* XLA's forced: XLA's own kernel-gradient convolution (the default with
  ``ATTNJAX_CPU_AUTOTUNE=0``);

and torch eager with one thread per core. The four steps alternate (A B C D A B ...), so a
passing load weighs on each alike. Prints a table and writes
``benchmarks/results/vqgan_conv_paths.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile

import jax
import numpy as np
import torch
from rows_vqgan import vqgan_autoencoder
from torch_vs_jax import use_devices

from attnjax.ops import autotune, convolution
from attnjax.ops.platform import cpu_cores, processor

RESULTS = pathlib.Path(__file__).parent / "results"
PATHS = {"default": None, "products forced": "products", "XLA's forced": "xla"}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default=str(RESULTS / "vqgan_conv_paths.json"))
    args = parser.parse_args()
    use_devices(1)
    torch.set_num_threads(cpu_cores())
    load_before = os.getloadavg()
    steps, torch_step = {}, None
    with tempfile.TemporaryDirectory() as directory:
        os.environ[autotune.ENV_CACHE] = os.path.join(directory, "cpu_rules.json")
        autotune.set_enabled(True)
        os.environ[autotune.ENV_SWITCH] = "always"  # every choice met is timed, not only a run's
        for name, path in PATHS.items():
            with convolution.forced_kernel_gradient(path):
                description, steps[name], torch_step = vqgan_autoencoder(args.batch)
            print(f"{name}: compiled in {steps[name].compile_s:.1f} s", flush=True)
        choices = json.loads(pathlib.Path(os.environ[autotune.ENV_CACHE]).read_text())
    steps["torch eager"] = torch_step
    times = autotune.alternating_times(steps, args.repeats)
    ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
    fastest = {name: 1e3 * min(t) for name, t in times.items()}
    result = dict(
        workload=description,
        processor=processor(),
        cores=cpu_cores(),
        jax=jax.__version__,
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        attnjax_devices=jax.device_count(),
        repeats=args.repeats,
        load_average=[load_before, os.getloadavg()],
        median_ms=ms,
        fastest_ms=fastest,
        timed_choices={
            key.split(" | ")[-1]: v["choice"]
            for key, v in choices.items()
            if key.startswith("conv_kernel_gradient")
        },
    )
    text = markdown(result)
    print(text)
    out = pathlib.Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(text)
    print(f"saved {out} and {out.with_suffix('.md')}")


def markdown(result) -> str:
    loads = " / ".join(" ".join(f"{x:.2f}" for x in load) for load in result["load_average"])
    rows = "\n".join(
        f"| {name} | {result['median_ms'][name]:.0f} | {result['fastest_ms'][name]:.0f} |"
        for name in result["median_ms"]
    )
    picks = {}
    for choice in result["timed_choices"].values():
        picks[choice] = picks.get(choice, 0) + 1
    chosen = ", ".join(f"{n} {name}" for name, n in sorted(picks.items()))
    return f"""# VQGAN autoencoder step on one CPU device: the kernel-gradient paths

`python benchmarks/vqgan_conv_paths.py` (JSON: [vqgan_conv_paths.json](vqgan_conv_paths.json)):
{result["workload"]}, {result["processor"]} ({result["cores"]} cores), jax {result["jax"]} on
{result["attnjax_devices"]} XLA CPU device, torch {result["torch"]} with
{result["torch_threads"]} threads; the four steps alternating, {result["repeats"]} calls each;
load average before / after: {loads}.

| step | median ms | fastest ms |
|---|---|---|
{rows}

The default's timed kernel-gradient choices (one per convolution shape): {chosen}.
"""


if __name__ == "__main__":
    main()
