"""Every quantizer kind on the digits, one table: the demo's chain (ViT -> VQGAN -> prior ->
classified samples) run once per tokenizer, with the same step budget for every row.

    python benchmarks/quantizers.py [--vqgan_steps N] [--prior_steps N] [--rows vq,fsq]

Each row is ``configs/vqgan_digits.py`` with ``model.quantizer`` overrides (nothing else), then
``configs/prior_digits.py`` on its codes (their own step budgets unless ``--*_steps`` is given; the
budget, batch sizes, learning rates and dropout are recorded with each row); runs live in
``runs/bench_quantizers/<row>/`` and a finished stage is reused. The digits ViT
(``configs/vit_digits.py``) is trained once and judges the reconstructions of the 360 held-out
digits and the prior's class-conditional samples. The table: held-out PSNR (pixels in [0, 1]),
codebook usage and perplexity on the test split, ViT accuracy on reconstructions, the prior's
held-out bits per token, the fraction of samples the ViT assigns to their conditioning class, and
the training wall time of both stages (wall clock on a shared machine). Each row's numbers are kept
in ``<workdir>/<row>/result.json`` (reused when the step budget matches), so rows may run in
separate processes at once; every process rewrites
``benchmarks/results/quantizers_digits.{json,md}`` from all finished rows.
"""

import argparse
import json
import os
import pathlib
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

import configs  # noqa: E402
import demo  # noqa: E402
from attnjax.tasks import classification  # noqa: E402
from attnjax.tasks import prior as prior_task  # noqa: E402

ROWS = {
    "vq": {},  # the digits config as it is: cosine codes + dead-code re-seeding
    "vq+rotation": dict(rotation_trick=True),
    "fsq": dict(kind="fsq"),
    "lfq": dict(kind="lfq"),
    "simvq": dict(kind="simvq"),
    "simvq+rotation": dict(kind="simvq", rotation_trick=True),
}
RESULTS = ROOT / "benchmarks" / "results"


def configs_for(row, vqgan_steps, prior_steps, workdir):
    vqgan_config = configs.load("vqgan_digits")
    vqgan_config.model.quantizer.update(ROWS[row])
    vqgan_config.num_train_steps = vqgan_steps = vqgan_steps or vqgan_config.num_train_steps
    vqgan_config.eval_every = vqgan_config.checkpoint_every = vqgan_steps
    prior_config = configs.load("prior_digits")
    prior_config.num_train_steps = prior_steps = prior_steps or prior_config.num_train_steps
    prior_config.eval_every = prior_config.checkpoint_every = prior_steps
    prior_config.vqgan_workdir = os.path.join(workdir, "vqgan")
    return vqgan_config, prior_config


def recipe(args) -> dict:
    """What a row's numbers depend on besides the quantizer: reused rows must match it."""
    vqgan_config, prior_config = configs_for("vq", args.vqgan_steps, args.prior_steps, "")
    return {
        "vqgan_steps": vqgan_config.num_train_steps,
        "prior_steps": prior_config.num_train_steps,
        "vqgan_batch_size": vqgan_config.batch_size,
        "vqgan_learning_rate": vqgan_config.learning_rate,
        "prior_batch_size": prior_config.batch_size,
        "prior_learning_rate": prior_config.learning_rate,
        "prior_dropout": prior_config.model.resid_pdrop,
    }


def run_row(row, args, vit_config, predict):
    workdir = os.path.join(args.workdir, row)
    vqgan_config, prior_config = configs_for(row, args.vqgan_steps, args.prior_steps, workdir)
    vq_stage = demo.run_stage("vqgan", vqgan_config, os.path.join(workdir, "vqgan"), {})
    prior_stage = demo.run_stage("prior", prior_config, os.path.join(workdir, "prior"), {})
    vqgan = prior_task.load_vqgan(os.path.join(workdir, "vqgan"))
    sample_accuracy, _ = demo.sample_and_classify(
        prior_config,
        os.path.join(workdir, "prior"),
        vit_config,
        predict,
        args.samples_per_class,
        os.path.join(workdir, "samples.png"),
    )
    vq_metrics, prior_metrics = vq_stage["metrics"], prior_stage["metrics"]
    return {
        "quantizer": dict(vqgan_config.model.quantizer.to_dict(), n_embed=vqgan.model.n_embed),
        "psnr": vq_metrics["eval/psnr"],
        "codebook_usage": vq_metrics["eval/codebook_usage"],
        "perplexity": vq_metrics["eval/perplexity"],
        "vit_accuracy_on_reconstructions": demo.reconstruction_accuracy(vqgan, vit_config, predict),
        "prior_bits_per_token": prior_metrics["eval/bits_per_token"],
        "sample_class_accuracy": sample_accuracy,
        "vqgan_seconds": vq_stage["train_seconds"],
        "prior_seconds": prior_stage["train_seconds"],
    }


def finished_rows(args) -> dict:
    """Every row whose ``result.json`` was made with this recipe, in table order."""
    rows, wanted = {}, recipe(args)
    for row in ROWS:
        path = pathlib.Path(args.workdir) / row / "result.json"
        if path.exists():
            result = json.loads(path.read_text())
            if all(result.get(key) == value for key, value in wanted.items()):
                rows[row] = result
    return rows


def markdown(results) -> str:
    lines = [
        f"Digits, {results['vqgan_steps']} VQGAN steps of {results.get('vqgan_batch_size', '?')} "
        f"and {results['prior_steps']} prior steps of {results.get('prior_batch_size', '?')} "
        "per row, "
        f"{results['samples_per_class']} samples per class; {results['machine']}.",
        "",
        "| tokenizer | PSNR (dB) | usage | perplexity | ViT acc. on rec. | prior bits/token "
        "| samples of their class | wall time VQGAN + prior (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, r in results["rows"].items():
        seconds = (
            "n/a"
            if r["vqgan_seconds"] is None or r["prior_seconds"] is None
            else f"{r['vqgan_seconds']:.0f} + {r['prior_seconds']:.0f}"
        )
        lines.append(
            f"| {row} | {r['psnr']:.2f} | {r['codebook_usage']:.3f} | {r['perplexity']:.1f} "
            f"| {r['vit_accuracy_on_reconstructions']:.3f} | {r['prior_bits_per_token']:.3f} "
            f"| {r['sample_class_accuracy']:.3f} | {seconds} |"
        )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vqgan_steps", type=int, default=None, help="default: the config's")
    parser.add_argument("--prior_steps", type=int, default=None, help="default: the config's")
    parser.add_argument("--samples_per_class", type=int, default=50)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--workdir", default="runs/bench_quantizers")
    parser.add_argument(
        "--vit_workdir", default="", help="a trained digits ViT ('': <workdir>/vit)"
    )
    args = parser.parse_args()
    rows = args.rows.split(",")
    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        raise ValueError(f"--rows: unknown rows {unknown}; expected a subset of {list(ROWS)}")

    vit_config = configs.load("vit_digits")
    vit_workdir = args.vit_workdir or os.path.join(args.workdir, "vit")
    vit_stage = demo.run_stage("vit", vit_config, vit_workdir, {})
    _, predict = classification.make_predict(vit_workdir)
    results = {
        **recipe(args),
        "samples_per_class": args.samples_per_class,
        "vit_test_accuracy": vit_stage["metrics"]["eval/accuracy"],
        "machine": (
            f"{jax.devices()[0].device_kind}, {os.cpu_count()} cores "
            f"({platform.processor() or 'cpu'})"
        ),
        "rows": {},
    }
    json_path, md_path = RESULTS / "quantizers_digits.json", RESULTS / "quantizers_digits.md"
    for row in rows:
        if row not in finished_rows(args):
            start = time.perf_counter()
            result = dict(run_row(row, args, vit_config, predict), **recipe(args))
            (pathlib.Path(args.workdir) / row / "result.json").write_text(
                json.dumps(result, indent=2)
            )
            print(f"[{row}] done in {time.perf_counter() - start:.0f} s: {result}", flush=True)
        results["rows"] = finished_rows(args)
        json_path.write_text(json.dumps(results, indent=2))
        md_path.write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
