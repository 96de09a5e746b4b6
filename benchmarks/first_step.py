"""Time to the first training step: process start -> first step done (imports, config, data,
initialisation, compilation, the step), for ``train.py`` against the PyTorch reference doing the
same first step eagerly (timm's ViT, taming's VQGAN and GPT; benchmarks/first_step_torch.py).

    python benchmarks/first_step.py [--rows vit_digits,vqgan_digits,prior_digits,vit_b16]

Each attnjax row runs four times in fresh processes: cold (an empty ``$XDG_CACHE_HOME``: no
compiled program and no CPU kernel choice cached, a machine's first run), warm (the same cache
directory, a new workdir: a repeated or resumed run, its steps loaded as compiled), changed (a
config that differs only in ``log_every``: the same programs under a new key, compiled and kept
again) and that changed config once more (warm again). The time is measured from here, from the
moment the process is started to the line the loop prints after the first step; the process is
then stopped. Where the time goes is read from train.py's own line and from ``-X importtime``.
ViT-B/16 at 224 px reads a folder of random 256 px JPEGs (``folder:`` source), batch 8.
Writes benchmarks/results/first_step.{json,md} with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from attnjax.ops.platform import cpu_cores, processor, processor_details

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FIRST_STEP = re.compile(
    r"first step done(?: ([\d.]+) s after the process started)?(?: \(([^)]*)\))?: (.*)"
)
B16_BATCH = 8
KINDS = {"cold": "cold", "warm": "warm", "changed": "changed", "changed_again": "changed, again"}
CHANGE = "--config.log_every=7"  # read by the loop, by no program

ROWS = {  # name: (description, train.py flags, torch batch)
    "vit_digits": ("ViT digits (4 x 64, 16 tokens), batch 64", ["configs/vit_digits.py"], 64),
    "vqgan_digits": ("VQGAN digits (16 px, 4x4 codes), batch 32", ["configs/vqgan_digits.py"], 32),
    "prior_digits": ("GPT prior, digit codes (4 x 128), batch 64", ["configs/prior_digits.py"], 64),
    "vit_b16": (
        f"ViT-B/16 at 224 px, batch {B16_BATCH}",
        [
            "configs/vit_folder.py",
            *("--config.model.width=768", "--config.model.num_heads=12"),
            "--config.model.mlp_dim=3072",
            "--config.data.image_size=224",
            f"--config.batch_size={B16_BATCH}",
            f"--config.eval_batch_size={B16_BATCH}",
        ],
        B16_BATCH,
    ),
}  # fmt: skip


def timed_until_first_step(command: list[str], env: dict) -> tuple[float, str]:
    """Seconds from starting ``command`` to its ``first step done`` line, and the line; the
    process is stopped there."""
    start = time.perf_counter()
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output = []
    try:
        for line in process.stdout:
            output.append(line)
            if line.startswith("first step done"):
                return time.perf_counter() - start, line.strip()
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    raise RuntimeError(f"{command[1]} ended without a first step:\n{''.join(output[-30:])}")


def jax_command(flags: list[str], workdir: str, data_dir: str, folder: str, vqgan: str):
    config, *rest = flags
    extra = [f"--config.data.data_dir={data_dir}"] if "digits" in config else []
    if "prior" in config:
        extra = [f"--config.vqgan_workdir={vqgan}"]
    if "folder" in config:
        extra = [f"--config.data.name=folder:{folder}"]
    return [
        *(sys.executable, "train.py", "--config", config, "--workdir", workdir),
        *rest,
        *extra,
        "--config.num_train_steps=100",
    ]


def environment(cache_home: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.pop("ATTNJAX_CPU_AUTOTUNE", None)
    # A CPU machine's run: no TPU runtime to probe (libtpu is in the dev environment for
    # compiling TPU programs, not for running). Temporary files (TFDS leaves empty directories
    # behind) under the cache's folder, which goes with the benchmark's own directory.
    temporary = os.path.join(cache_home, "tmp")
    os.makedirs(temporary, exist_ok=True)
    return dict(
        env,
        XDG_CACHE_HOME=cache_home,
        TMPDIR=temporary,
        TF_CPP_MIN_LOG_LEVEL="2",
        JAX_PLATFORMS="cpu",
    )


def prepare(directory: pathlib.Path) -> tuple[str, str, str]:
    """The digits TFDS directory, a trained (one step) digits VQGAN for the prior, and a folder
    of random JPEGs for ViT-B/16: made before any timing, the same for every row."""
    from PIL import Image

    from attnjax import data

    data_dir = directory / "tfds"
    tempfile.tempdir = str(directory)  # TFDS's preparation directories, gone with it
    try:
        data.load_source("digits", "train", str(data_dir))
    finally:
        tempfile.tempdir = None
    vqgan = directory / "vqgan"
    subprocess.run(
        [
            *(sys.executable, "train.py", "--config", "configs/vqgan_digits.py"),
            *("--workdir", str(vqgan), f"--config.data.data_dir={data_dir}"),
            "--config.num_train_steps=1",
        ],
        cwd=ROOT,
        env=environment(str(directory / "setup_cache")),
        check=True,
        capture_output=True,
    )
    folder = directory / "images"
    rng = np.random.default_rng(0)
    for index in range(4 * B16_BATCH):
        label = folder / f"class_{index % 2}"
        label.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(label / f"{index:03d}.jpg", quality=90)
    return str(data_dir), str(vqgan), str(folder)


def import_seconds(env: dict) -> float:
    """Seconds to start Python and import what train.py imports (the floor of every row)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import train"], cwd=ROOT, env=env, check=True)
    return time.perf_counter() - start


def stages(line: str) -> dict:
    """``{"tracing", "lowering", "compiling", "loading"}`` seconds from the loop's first-step
    line (loading: the kept executables read and loaded)."""
    match = FIRST_STEP.match(line)
    parts = (match.group(2) or "").split(", ") if match else []
    found = {k: float(v.removesuffix(" s")) for k, v in (p.split(" ", 1) for p in parts if p)}
    loaded = re.search(r"compiled programs loaded in ([\d.]+) s", line)
    found["loading"] = float(loaded.group(1)) if loaded else 0.0
    return found


def row(name: str, directory: pathlib.Path, inputs) -> dict:
    description, flags, batch = ROWS[name]
    data_dir, vqgan, folder = inputs
    cache_home = str(directory / f"cache_{name}")
    result = dict(name=name, description=description)
    # changed: the warm start with a config that differs only where no program reads it (a new
    # key for the kept programs, the same programs); changed_again: that config once more.
    for kind in KINDS:
        workdir = str(directory / f"run_{name}_{kind}")
        changed = [CHANGE] if kind.startswith("changed") else []
        command = jax_command([*flags, *changed], workdir, data_dir, folder, vqgan)
        env = environment(cache_home)
        seconds, line = timed_until_first_step(command, env)
        result[f"attnjax_{kind}"] = round(seconds, 2)
        result[f"attnjax_{kind}_line"] = line
        result[f"attnjax_{kind}_stages"] = stages(line)
        print(f"{name} attnjax {kind}: {seconds:.1f} s  ({line})", flush=True)
    torch_command = [sys.executable, "benchmarks/first_step_torch.py", name, str(batch)]
    seconds, line = timed_until_first_step(torch_command, environment(cache_home))
    result["torch"] = round(seconds, 2)
    result["torch_line"] = line
    print(f"{name} torch: {seconds:.1f} s", flush=True)
    return result


def table(rows: list[dict], machine: dict) -> str:
    lines = [
        f"Machine: {machine['processor']} ({machine.get('details', '')}), {machine['cores']} "
        "cores; "
        f"jax {machine['jax']}, torch {machine['torch']}; load average "
        f"{machine['load_before']} before, {machine['load_after']} after.",
        "",
        f"Starting Python and importing train.py's modules: {machine['import_seconds']:.1f} s "
        "(part of every attnjax time below).",
        "",
        "| workload | attnjax cold (s) | attnjax warm (s) | cold / warm | PyTorch eager (s) | "
        "cold / PyTorch | warm / PyTorch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['description']} | {r['attnjax_cold']:.1f} | {r['attnjax_warm']:.1f} | "
            f"{r['attnjax_cold'] / r['attnjax_warm']:.2f} | "
            f"{r['torch']:.1f} | {r['attnjax_cold'] / r['torch']:.2f} | "
            f"{r['attnjax_warm'] / r['torch']:.2f} |"
        )
    lines += [
        "",
        "Warm: the initial parameters read as kept values, the run's keys, the optimiser's "
        "initial state and the train step loaded as compiled (attnjax/train/executables.py), "
        "on a thread that starts loading the programs the cold run listed before the run reads "
        "its data; nothing traced, lowered or compiled before the first step. Changed: the "
        f"warm start with `{CHANGE}`, a config no program reads differently: its programs "
        "are traced, lowered and compiled again (past JAX's cache, whose copies XLA:CPU could "
        "not serialise again) and kept; changed, again: the same config once more, warm.",
        "",
        "Where each start's time goes (seconds; JAX's own timings of its stages, summed over the "
        "process up to the first step; loading: the time the run waited for kept executables to be "
        "read and loaded, beyond what the thread had loaded meanwhile; imports as "
        "above; the rest is the config, data pipeline, "
        "initial state, workdir and the step itself; CPU kernel choices timed while a program "
        "is traced compile inside the tracing, and a start without a kept train step compiles it "
        "on a thread while the initial state's programs compile beside it, so there the stages "
        "overlap and the rest can come out below zero):",
        "",
        "| workload | start | total | imports | tracing | lowering | compiling | loading | rest |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for kind, label in KINDS.items():
            if f"attnjax_{kind}" not in r:
                continue
            total, parts = r[f"attnjax_{kind}"], r.get(f"attnjax_{kind}_stages", {})
            names = ("tracing", "lowering", "compiling", "loading")
            spent = [parts.get(k, float("nan")) for k in names]
            rest = total - machine["import_seconds"] - sum(spent)
            lines.append(
                f"| {r['description']} | {label} | {total:.1f} | {machine['import_seconds']:.1f} | "
                + " | ".join(f"{x:.1f}" for x in spent)
                + f" | {rest:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--out", default=str(RESULTS / "first_step.json"))
    args = parser.parse_args()
    import importlib.metadata

    machine = dict(
        processor=processor(),
        details=processor_details(),
        cores=cpu_cores(),
        jax=importlib.metadata.version("jax"),
        torch=importlib.metadata.version("torch"),
        load_before=" ".join(f"{x:.2f}" for x in os.getloadavg()),
    )
    with tempfile.TemporaryDirectory() as directory:
        directory = pathlib.Path(directory)
        inputs = prepare(directory)
        env = environment(str(directory / "imports"))
        machine["import_seconds"] = round(min(import_seconds(env) for _ in range(3)), 2)
        rows = [row(name, directory, inputs) for name in args.rows.split(",")]
    machine["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    text = table(rows, machine)
    print("\n" + text)
    out = pathlib.Path(args.out)
    out.write_text(json.dumps(dict(machine=machine, rows=rows), indent=2))
    out.with_suffix(".md").write_text(f"# Time to the first training step\n\n{text}\n")
    print(f"saved {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
