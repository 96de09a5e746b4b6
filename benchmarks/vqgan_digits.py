"""VQGAN on the digits: codebook options, GAN and perceptual terms, and how the
reconstructions classify. Produces the README's VQGAN numbers.

    python benchmarks/vqgan_digits.py --steps 800 --vit_workdir runs/vit_digits \\
        [--variants plain,l2_reseed]

Each variant is ``configs/vqgan_digits.py`` with a few overrides, trained with the real loop in
``runs/bench_vqgan/<variant>``; the table reports held-out PSNR (pixels in [0, 1]), codebook
usage and perplexity on the 360 test digits, training steps/s (wall clock: on a shared machine
it is inflated) and, given a trained digits ViT (``configs/vit_digits.py``), the accuracy of
that classifier on the reconstructions. Results go to ``benchmarks/results/vqgan_digits.json``.
"""

import argparse
import json
import os
import pathlib
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp
import numpy as np
from absl import logging

import configs
from attnjax import data
from attnjax.tasks import classification, train_and_evaluate, vqgan
from attnjax.train import checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]
NO_OPTIONS = dict(l2_normalize=False, usage_decay=0.0, ema_decay=0.0, lookup_dim=0)
VARIANTS = {
    # taming's quantizer (VectorQuantizer2, legacy=False) with nothing against collapse
    "plain": dict(quantizer=NO_OPTIONS, reseed_threshold=0.0),
    "l2": dict(quantizer=dict(NO_OPTIONS, l2_normalize=True), reseed_threshold=0.0),
    "reseed": dict(quantizer=dict(NO_OPTIONS, usage_decay=0.95), reseed_threshold=0.03),
    "lookup8": dict(quantizer=dict(NO_OPTIONS, lookup_dim=8), reseed_threshold=0.0),
    "l2_lookup8": dict(
        quantizer=dict(NO_OPTIONS, l2_normalize=True, lookup_dim=8), reseed_threshold=0.0
    ),
    "ema": dict(quantizer=dict(NO_OPTIONS, ema_decay=0.95), reseed_threshold=0.0),
    "l2_reseed": dict(),  # the config's default
    "l2_reseed_gan": dict(loss=dict(disc_weight=0.8, disc_start_fraction=0.5)),
}


def configure(name, steps):
    config = configs.load("vqgan_digits")
    overrides = VARIANTS[name]
    config.num_train_steps = steps
    config.eval_every = config.checkpoint_every = steps
    config.quiet = True
    if "quantizer" in overrides:
        config.model.quantizer.update(overrides["quantizer"])
    if "reseed_threshold" in overrides:
        config.reseed_threshold = overrides["reseed_threshold"]
    if "loss" in overrides:
        config.loss.disc_weight = overrides["loss"]["disc_weight"]
        config.loss.disc_start = int(steps * overrides["loss"]["disc_start_fraction"])
    return config


def reconstruction_accuracy(workdir, vit_workdir):
    """Accuracy of the digits ViT on the VQGAN's reconstructions of the test split."""
    vit_config, predict = classification.make_predict(vit_workdir)
    run_config, variables = checkpoint.load(workdir, variables=vqgan.VARIABLE_FIELDS)
    model, variables = vqgan.inference_model(run_config, variables)
    source = data.load_source(
        run_config.data.name, run_config.data.eval_split, run_config.data.data_dir
    )
    size = run_config.data.image_size
    images = np.stack(
        [data.resize(np.asarray(source[i]["image"]), size) for i in range(len(source))]
    )
    labels = np.array([int(source[i]["label"]) for i in range(len(source))])
    rec, _ = model.apply(variables, jnp.asarray(data.normalize(images, run_config.data)))
    pixels = np.clip(data.denormalize(np.asarray(rec), run_config.data), 0, 1)
    if vit_config.data.image_size not in (0, size):
        raise ValueError(
            f"the ViT expects {vit_config.data.image_size}x{vit_config.data.image_size} images, "
            f"the VQGAN makes {size}x{size}"
        )
    vit_in = data.normalize(pixels, vit_config.data)
    original = data.normalize(images, vit_config.data)
    accuracy = lambda a: float(
        np.mean(np.argmax(np.asarray(predict(jnp.asarray(a))), -1) == labels)
    )
    return accuracy(vit_in), accuracy(original)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--vit_workdir", default="")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench_vqgan"))
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)
    rows = []
    for name in args.variants.split(","):
        config = configure(name, args.steps)
        workdir = os.path.join(args.out, name)
        start = time.perf_counter()
        result = train_and_evaluate(config, workdir)
        row = {
            "variant": name,
            "steps": args.steps,
            "wall_s": time.perf_counter() - start,
            **{
                k: result[k]
                for k in ("eval/psnr", "eval/codebook_usage", "eval/perplexity", "steps_per_sec")
            },
        }
        if args.vit_workdir:
            row["vit_accuracy_on_reconstructions"], row["vit_accuracy_on_originals"] = (
                reconstruction_accuracy(workdir, args.vit_workdir)
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    path = ROOT / "benchmarks" / "results" / "vqgan_digits.json"
    path.parent.mkdir(exist_ok=True)
    # Rows of earlier invocations are kept unless this one re-ran the same variant and steps.
    previous = json.loads(path.read_text()) if path.exists() else []
    done = {(r["variant"], r["steps"]) for r in rows}
    rows = [r for r in previous if (r["variant"], r["steps"]) not in done] + rows
    path.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
