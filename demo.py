"""The whole pipeline on the embedded digits (``make demo``): ViT, VQGAN, prior, new digits.

Stages, each a ``train.py`` run in its own workdir under ``--workdir`` (default ``runs/demo``):

1. ``vit``: the digits classifier (``configs/vit_digits.py``), the judge of everything below.
2. ``vqgan``: 16x16 digits <-> 4x4 code grids (``configs/vqgan_digits.py``).
3. ``prior``: a class-conditional GPT over the codes (``configs/prior_digits.py``).

Then ``--samples_per_class`` digits of every class are sampled (the config's temperature and
top-k), decoded by the VQGAN and classified by the ViT. ``--completions`` held-out digits are
completed from the top half of their codes given their class (taming's image completion), and
one grid twice as wide as the trained one is sampled with the sliding window. One table reports
the ViT's test accuracy, the VQGAN's PSNR, codebook usage and the ViT's accuracy on its
reconstructions, the prior's bits per token, the fractions of samples and of completions
classified as their class, the domain FIDs (on the ViT's pre-logits: the samples, the
reconstructions and, as the floor, training digits, each against the test digits, with the
number of images on each side), and the wall time of each stage; ``<workdir>/samples.png`` shows
the samples (a row per class), ``completions.png`` originals, their kept rows and completions
(a row each), ``sliding_window.png`` the wide sample, and ``<workdir>/summary.json`` holds
the numbers.

A stage whose workdir already holds its final checkpoint is reused, not retrained; an
interrupted stage resumes from its last checkpoint.

    .venv/bin/python demo.py [--workdir runs/demo] [--samples_per_class 50] [--completions 100]
                             [--train_steps N]   (N steps per stage: a quick check, not the table)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

if __name__ == "__main__":
    from attnjax import huge_pages

    # First: glibc reads its tunables only when a process starts.
    huge_pages.restart_with_huge_pages()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import logging  # noqa: E402

import configs
from attnjax import data
from attnjax.data.images import save_image_grid
from attnjax.inference import generate
from attnjax.metrics import sources
from attnjax.metrics.features import frechet_distance_between, measure
from attnjax.ops import autotune
from attnjax.parallel import data_parallel
from attnjax.tasks import classification as classification_task
from attnjax.tasks import prior as prior_task
from attnjax.tasks import train_and_evaluate
from attnjax.tasks.classification import PRE_LOGITS
from attnjax.train import checkpoint, collector, compilation_cache, report

# The domain FIDs of the table: its rows, in order (the feature network is the digits ViT).
DOMAIN_FIDS = (
    ("samples", "samples"),
    ("reconstructions", "reconstructions"),
    ("train_digits", "train digits (floor)"),
)

STAGES = (
    ("vit", "vit_digits"),
    ("vqgan", "vqgan_digits"),
    ("prior", "prior_digits"),
)


def last_eval(workdir: str) -> dict:
    """The metrics of the run's last evaluation, from its ``metrics.jsonl``."""
    merged: dict = {}
    for record in report.read_metrics(workdir):
        if any(key.startswith("eval/") for key in record):
            merged = {**record}
    return merged


def run_stage(name: str, config, workdir: str, previous: dict) -> dict:
    """Trains ``config`` in ``workdir`` unless its final checkpoint is there -> the stage record."""
    done = checkpoint.latest_step(workdir)
    if done is not None and done >= config.num_train_steps:
        logging.info("stage %s: reusing %s (step %d)", name, workdir, done)
        print(f"[{name}] finished run found in {workdir} (step {done}): reused, not retrained")
        seconds = previous.get("stages", {}).get(name, {}).get("train_seconds")
        return {
            "workdir": workdir,
            "reused": True,
            "train_seconds": seconds,
            "metrics": last_eval(workdir),
        }
    print(f"[{name}] training in {workdir}" + (f" (resuming from step {done})" if done else ""))
    start = time.perf_counter()
    metrics = train_and_evaluate(config, workdir)
    return {
        "workdir": workdir,
        "reused": False,
        "train_seconds": time.perf_counter() - start,
        "metrics": {**last_eval(workdir), **metrics},
    }


def shorten(config, steps: int) -> None:
    """``config`` trained ``steps`` steps, evaluated and saved once at the end."""
    config.num_train_steps = steps
    config.eval_every = config.checkpoint_every = steps
    config.log_every = min(config.log_every, steps)
    config.warmup_steps = min(config.warmup_steps, steps // 2)


def vit_inputs(images, vqgan_data, vit_data):
    """VQGAN-space images -> the ViT's normalisation (pixels clipped to [0, 1] on the way)."""
    pixels = np.clip(data.denormalize(np.asarray(images), vqgan_data), 0.0, 1.0)
    return data.normalize(pixels, vit_data)


def classify(predict, images, batch_size=256):
    return np.concatenate(
        [
            np.argmax(np.asarray(predict(jnp.asarray(images[i : i + batch_size]))), -1)
            for i in range(0, len(images), batch_size)
        ]
    )


def reconstruct_test_digits(vqgan):
    """The held-out digits and their VQGAN reconstructions (VQGAN space), and their labels."""
    images, labels = prior_task.load_images(vqgan.config.data, vqgan.config.data.eval_split, 0)
    model = vqgan.model
    reconstruct = jax.jit(
        lambda x: model.apply(
            vqgan.variables,
            model.apply(vqgan.variables, x, method=type(model).encode)[1],
            method=type(model).decode_indices,
        )
    )
    reconstructions = np.concatenate(
        [np.asarray(reconstruct(images[i : i + 120])) for i in range(0, len(images), 120)]
    )
    return images, reconstructions, labels


def reconstruction_accuracy(reconstructions, labels, vqgan_data, vit_config, predict) -> float:
    """ViT accuracy on VQGAN reconstructions of the held-out digits."""
    predicted = classify(predict, vit_inputs(reconstructions, vqgan_data, vit_config.data))
    return float(np.mean(predicted == labels))


def pixels(images, vqgan_data):
    """VQGAN-space images -> pixels clipped to [0, 1], as the ViT judges them."""
    return np.clip(data.denormalize(np.asarray(images), vqgan_data), 0.0, 1.0)


def domain_fids(vit_workdir, vqgan, samples, reconstructions, test_digits) -> dict:
    """FIDs on the digits ViT's pre-logits (a domain FID: no Inception here) -> ``{name:
    {"fid", "n", "n_reference"}}`` for the samples, the reconstructions and, as the floor,
    as many training digits as there are samples, each against the held-out digits."""
    extractor = classification_task.feature_extractor(vit_workdir)
    train_digits, _ = prior_task.load_images(vqgan.config.data, vqgan.config.data.train_split, 0)
    test = sources.ArrayImages(pixels(test_digits, vqgan.config.data), "test digits")
    (mu, sigma), _ = measure(test, extractor, PRE_LOGITS, progress=False)
    test_statistics = sources.Statistics("test digits", mu, sigma)
    sets = {
        "samples": np.clip(samples, 0.0, 1.0),
        "reconstructions": pixels(reconstructions, vqgan.config.data),
        "train_digits": pixels(train_digits[: len(samples)], vqgan.config.data),
    }
    return {
        name: {
            "fid": frechet_distance_between(
                sources.ArrayImages(images, name), test_statistics, extractor, PRE_LOGITS, False
            ),
            "n": len(images),
            "n_reference": len(test),
        }
        for name, images in sets.items()
    }


def sample_and_classify(prior_config, prior_workdir, vit_config, predict, per_class, path):
    """Class-conditional samples, decoded and classified -> (the fraction classified as their
    class, that fraction per class, the samples ``[n, H, W, C]``)."""
    _, params = checkpoint.load(prior_workdir)
    model = prior_task.create_model(prior_config)
    labels, images = prior_task.sample_grid(
        params, prior_config, model, jax.random.key(prior_config.seed + 1), per_class=per_class
    )
    shown = np.concatenate([images[labels == c][:10] for c in range(prior_config.num_classes)])
    save_image_grid(shown, path, nrow=10, scale=4)
    vit_images = data.normalize(np.clip(images, 0.0, 1.0), vit_config.data)
    predicted = classify(predict, vit_images)
    per_class_accuracy = [
        float(np.mean(predicted[labels == c] == c)) for c in range(prior_config.num_classes)
    ]
    return float(np.mean(predicted == labels)), per_class_accuracy, images


def complete_and_classify(prior_workdir, vit_config, predict, number, path, shown=10):
    """Completions of the first ``number`` held-out digits from the top half of their codes:
    the fraction the ViT classifies as the original's class; the first ``shown`` go to ``path``."""
    run = generate.load_prior(prior_workdir)
    rows = run.vqgan.grid_shape[0] // 2
    result = generate.complete_test_images(
        run, number, rows, jax.random.key(run.config.seed + 2), **generate.sampling_settings(run)
    )
    pictures = np.concatenate(
        [result[name][:shown] for name in ("originals", "kept", "completions")]
    )
    save_image_grid(pictures, path, nrow=min(shown, number), scale=4)
    vit_images = data.normalize(np.clip(result["completions"], 0.0, 1.0), vit_config.data)
    return float(np.mean(classify(predict, vit_images) == result["labels"]))


def sliding_window_sample(prior_workdir, path, label=0):
    """One class-``label`` sample on a code grid twice as wide as the trained one -> its shape."""
    run = generate.load_prior(prior_workdir)
    height, width = run.vqgan.grid_shape
    labels = np.array([label], np.int32) if run.config.num_classes else None
    codes = generate.sample_codes(
        run,
        labels,
        jax.random.key(run.config.seed + 3),
        number=1,
        grid_shape=(height, 2 * width),
        **generate.sampling_settings(run),
    )
    save_image_grid(generate.decode(run, codes), path, nrow=1, scale=4)
    return tuple(codes.shape[1:])


def format_summary(summary: dict) -> str:
    rows = [
        ("ViT test accuracy", f"{summary['vit_test_accuracy']:.4f}"),
        ("VQGAN PSNR (dB, held-out)", f"{summary['vqgan_psnr']:.2f}"),
        ("VQGAN codebook usage", f"{summary['vqgan_codebook_usage']:.3f}"),
        (
            "ViT accuracy on VQGAN reconstructions",
            f"{summary['vit_accuracy_on_reconstructions']:.4f}",
        ),
        ("prior bits per token (held-out)", f"{summary['prior_bits_per_token']:.3f}"),
        (
            f"samples classified as their class (n={summary['num_samples']})",
            f"{summary['sample_class_accuracy']:.4f}",
        ),
        (
            f"completions classified as the original's class (n={summary['num_completions']})",
            f"{summary['completion_class_accuracy']:.4f}",
        ),
    ]
    for name, what in DOMAIN_FIDS:
        fid = summary["domain_fid"][name]
        rows.append(
            (
                f"domain FID: {what} vs test (n={fid['n']} vs {fid['n_reference']})",
                f"{fid['fid']:.3f}",
            )
        )
    for name, stage in summary["stages"].items():
        seconds = stage["train_seconds"]
        text = "n/a" if seconds is None else f"{seconds:.1f}"
        rows.append(
            (
                f"wall time: {name}" + (" (reused; from its run)" if stage["reused"] else ""),
                text + " s",
            )
        )
    rows.append(
        ("wall time: sampling, completion, classification, FID", f"{summary['eval_seconds']:.1f} s")
    )
    rows.append(("wall time: this demo run", f"{summary['total_seconds']:.1f} s"))
    width = max(len(name) for name, _ in rows)
    lines = ["", "attnjax demo: ViT + VQGAN + transformer prior on digits", "-" * (width + 14)]
    lines += [f"{name:<{width}}  {value:>11}" for name, value in rows]
    lines.append("-" * (width + 14))
    return "\n".join(lines)


def fixed_kernel_choices() -> None:
    """The CPU kernel choices at their fixed defaults, unless ``$ATTNJAX_CPU_AUTOTUNE`` says
    otherwise: the paths compute the same values to float32 rounding, but a thousand training
    steps carry the difference into the table, and a first step's timing picks between paths a
    few percent apart differently from run to run; the table is to read the same on every run
    (docs/demo.md)."""
    os.environ.setdefault(autotune.ENV_SWITCH, "0")


def main(argv=None):
    compilation_cache.enable()
    collector.raise_thresholds()
    fixed_kernel_choices()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/demo")
    parser.add_argument("--samples_per_class", type=int, default=50)
    parser.add_argument(
        "--completions",
        type=int,
        default=100,
        help="held-out digits completed from the top half of their codes",
    )
    parser.add_argument(
        "--train_steps",
        type=int,
        default=None,
        help="train every stage this many steps instead of its config's: a quick end-to-end "
        "check whose figures mean little",
    )
    args = parser.parse_args(argv)
    if args.train_steps is not None and args.train_steps < 1:
        raise ValueError(f"--train_steps must be >= 1, got {args.train_steps}")
    if args.samples_per_class < 1:
        raise ValueError(f"--samples_per_class must be >= 1, got {args.samples_per_class}")
    if args.completions < 1:
        raise ValueError(f"--completions must be >= 1, got {args.completions}")
    total_start = time.perf_counter()
    os.makedirs(args.workdir, exist_ok=True)
    summary_path = os.path.join(args.workdir, "summary.json")
    previous = (
        json.loads(pathlib.Path(summary_path).read_text()) if os.path.exists(summary_path) else {}
    )

    stage_configs = {name: configs.load(config) for name, config in STAGES}
    if args.train_steps is not None:
        for config in stage_configs.values():
            shorten(config, args.train_steps)
    data_parallel.use_cpu_cores(*stage_configs.values())
    workdirs = {name: os.path.join(args.workdir, name) for name, _ in STAGES}
    stage_configs["prior"].vqgan_workdir = workdirs["vqgan"]
    stages = {
        name: run_stage(name, stage_configs[name], workdirs[name], previous) for name, _ in STAGES
    }

    eval_start = time.perf_counter()
    _, predict = classification_task.make_predict(workdirs["vit"])
    vqgan = prior_task.load_vqgan(workdirs["vqgan"])
    test_digits, reconstructions, test_labels = reconstruct_test_digits(vqgan)
    recon_accuracy = reconstruction_accuracy(
        reconstructions, test_labels, vqgan.config.data, stage_configs["vit"], predict
    )
    samples_path = os.path.join(args.workdir, "samples.png")
    sample_accuracy, per_class, samples = sample_and_classify(
        stage_configs["prior"],
        workdirs["prior"],
        stage_configs["vit"],
        predict,
        args.samples_per_class,
        samples_path,
    )
    completions_path = os.path.join(args.workdir, "completions.png")
    completion_accuracy = complete_and_classify(
        workdirs["prior"], stage_configs["vit"], predict, args.completions, completions_path
    )
    window_path = os.path.join(args.workdir, "sliding_window.png")
    window_grid = sliding_window_sample(workdirs["prior"], window_path)
    fids = domain_fids(workdirs["vit"], vqgan, samples, reconstructions, test_digits)
    summary = {
        "vit_test_accuracy": stages["vit"]["metrics"]["eval/accuracy"],
        "vqgan_psnr": stages["vqgan"]["metrics"]["eval/psnr"],
        "vqgan_codebook_usage": stages["vqgan"]["metrics"]["eval/codebook_usage"],
        "vit_accuracy_on_reconstructions": recon_accuracy,
        "prior_bits_per_token": stages["prior"]["metrics"]["eval/bits_per_token"],
        "sample_class_accuracy": sample_accuracy,
        "sample_class_accuracy_per_class": per_class,
        "num_samples": args.samples_per_class * stage_configs["prior"].num_classes,
        "sampling": stage_configs["prior"].sampling.to_dict(),
        "samples_png": samples_path,
        "completion_class_accuracy": completion_accuracy,
        "num_completions": args.completions,
        "completions_png": completions_path,
        "sliding_window_grid": list(window_grid),
        "sliding_window_png": window_path,
        "domain_fid": fids,
        "stages": {
            name: {k: v for k, v in stage.items() if k != "metrics"}
            for name, stage in stages.items()
        },
        "eval_seconds": time.perf_counter() - eval_start,
        "total_seconds": time.perf_counter() - total_start,
        "device": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
    }
    pathlib.Path(summary_path).write_text(json.dumps(summary, indent=2))
    print(format_summary(summary))
    print(
        f"samples: {samples_path}   completions: {completions_path}   "
        f"sliding window ({window_grid[0]}x{window_grid[1]} codes): {window_path}   "
        f"summary: {summary_path}"
    )
    return summary


if __name__ == "__main__":
    main()
