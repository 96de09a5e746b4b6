"""Sample digits (or any images) from a trained prior run, and write them as a PNG.

    python -m attnjax.inference.generate --workdir runs/demo/prior  # every class, a row each
    python -m attnjax.inference.generate --workdir runs/demo/prior --class 3 --number 16 \\
        --temperature 0.8
    python -m attnjax.inference.generate --workdir runs/demo/prior --grid 4x8  # a wider grid
    python -m attnjax.inference.generate --workdir runs/demo/prior --complete 8 --rows 2
    python -m attnjax.inference.generate --workdir runs/prior_3b --class 207 --mesh model=8

Three modes (``attnjax.models.sampling``): plain class-conditional sampling of the trained code
grid; ``--grid HxW``, a grid at least the trained one sampled with taming's sliding window; and
``--complete N``, the first ``N`` held-out images of the VQGAN's dataset encoded, their first
``--rows`` code rows kept and the rest sampled given their class (PNG rows: originals, the kept rows
with the rest grey, completions). ``--temperature``, ``--top_k``, ``--top_p`` and ``--guidance``
default to the run's ``config.sampling``. The PNG goes to ``--out`` (default
``<workdir>/sample.png``, ``grid_HxW.png`` or ``completion.png``) and is never overwritten without
``--force``.

``--mesh model=N`` (or ``data=D,model=N``) samples on a mesh of that many devices: the prior's
parameters laid out by its partition rules (heads, MLP units and vocabulary split over ``model``,
Megatron's layout) and each key/value cache split by heads (``on_mesh``), the rows over ``data``;
the tokens are one device's. ``model`` must divide the heads, the MLP's units and the vocabulary
(a one-line error names the parameter it does not). In Python: ``with on_mesh(mesh):
sampling.sample(model, place_params(params, mesh), ...)``.

``--save-stats OUT.npz`` also writes the samples' FID statistics in pytorch-fid's format (never
over an existing file), on ``--inception W.npz`` (``--dims``, default 2048) or on the pre-logits
of ``--classifier RUN`` (a domain FID)::

    python -m attnjax.inference.generate --workdir runs/demo/prior --number 100 \\
        --save-stats samples.npz --inception inception.npz
    python -m attnjax.fid --inception inception.npz samples.npz tfds:digits:test
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
from typing import Any, NamedTuple

if __name__ == "__main__":
    from attnjax import huge_pages

    # First, as train.py: glibc reads its tunables only when a process starts.
    huge_pages.restart_with_huge_pages()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from attnjax import data, storage  # noqa: E402
from attnjax.data.images import save_image_grid  # noqa: E402
from attnjax.metrics import sources  # noqa: E402
from attnjax.metrics.features import inception_extractor, measure  # noqa: E402
from attnjax.metrics.statistics import save_statistics  # noqa: E402
from attnjax.models import gpt, sampling  # noqa: E402
from attnjax.parallel import sharding  # noqa: E402
from attnjax.tasks import classification, image_metrics  # noqa: E402
from attnjax.tasks import prior as prior_task  # noqa: E402
from attnjax.tasks import vqgan as vqgan_task  # noqa: E402
from attnjax.train import checkpoint, collector, compilation_cache  # noqa: E402


class TrainedPrior(NamedTuple):
    config: Any
    model: gpt.GPT
    params: Any
    vqgan: prior_task.TrainedVQGAN
    mesh: Mesh | None = None  # where its parameters lie and its samplers run; None: one device


def load_prior(workdir: str, step: int | None = None, mesh: Mesh | None = None) -> TrainedPrior:
    """The prior trained in ``workdir`` and the VQGAN whose codes it models; with ``mesh``, its
    parameters placed there (``place_params``), where ``sample_codes`` and
    ``complete_test_images`` then sample (``on_mesh``)."""
    if checkpoint.latest_step(workdir) is None:
        raise ValueError(f"--workdir {workdir!r} holds no checkpoint (train a prior run first)")
    config, params = checkpoint.load(workdir, step=step)
    if config.task != "prior":
        raise ValueError(
            f"--workdir {workdir!r} holds a {config.task!r} run, expected a 'prior' run"
        )
    vqgan = prior_task.load_vqgan(config.vqgan_workdir, config.get("vqgan_step"))
    if mesh is not None:
        params = place_params(params, mesh)
    return TrainedPrior(config, prior_task.create_model(config), params, vqgan, mesh)


def place_params(params, mesh: Mesh):
    """The prior's parameters laid out on ``mesh`` by its partition rules
    (``prior.SHARDING_RULES``): over a ``model`` axis, q/k/v by heads, the MLP by its units, the
    embedding and head by the vocabulary."""
    shardings = sharding.tree_shardings(params, mesh, prior_task.SHARDING_RULES)
    return jax.device_put(params, shardings)


def sampling_axis_rules(mesh: Mesh) -> tuple:
    """Flax's logical axis rules for sampling on ``mesh``: the activations' (rows over the batch
    axes) and the key/value caches' heads over the axis the rules split q/k/v's heads over, so
    that each device keeps the heads it computes."""
    heads = sharding.LOGICAL_AXIS_RULES["heads"]
    heads = heads if heads in mesh.axis_names else None
    return (*sharding.activation_axis_rules(mesh), ("heads", heads))


@contextlib.contextmanager
def on_mesh(mesh: Mesh | None):
    """The samplers called inside run on ``mesh`` (``jax.set_mesh``) under
    ``sampling_axis_rules``; their parameters come from ``place_params``. None: as they are."""
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh), nn.logical_axis_rules(sampling_axis_rules(mesh)):
        yield


def parse_mesh(text: str) -> Mesh:
    """``"model=2"``, ``"data=2,model=2"`` -> a mesh over the first that many devices (all of
    them where a size is -1)."""
    sizes = {}
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\w+)=(-1|\d+)\s*", part)
        if not match:
            raise ValueError(f"--mesh must be axis=size pairs (e.g. data=2,model=2), got {text!r}")
        sizes[match[1]] = int(match[2])
    count = math.prod(sizes.values())
    if count > jax.device_count():
        raise ValueError(f"--mesh {text} needs {count} devices, there are {jax.device_count()}")
    devices = jax.devices() if count < 0 else jax.devices()[:count]
    return sharding.make_mesh(sizes, devices)


def sampling_settings(
    run: TrainedPrior, *, temperature=None, top_k=None, top_p=None, guidance=None
) -> dict:
    """Keyword arguments of ``attnjax.models.sampling``'s samplers: the given values, else the
    run's."""
    config = run.config.sampling
    trained_guidance = prior_task.sampling_guidance(run.config)
    if guidance is not None and not prior_task.trained_with_null_class(run.config):
        raise ValueError(
            f"--guidance {guidance}: this prior was trained without a null class "
            "(config.class_dropout = 0), so it has no unconditional model to guide with"
        )
    settings = dict(
        temperature=config.temperature if temperature is None else temperature,
        top_k=config.get("top_k") if top_k is None else top_k,
        top_p=config.get("top_p") if top_p is None else top_p,
        guidance=trained_guidance if guidance is None else guidance,
        num_codes=run.vqgan.model.n_embed,
    )
    sampling.SamplingSettings(**settings).check(run.model.vocab_size)
    return settings


def _prefixes(run: TrainedPrior, labels, batch: int, guidance):
    codebook_size, num_classes = run.vqgan.model.n_embed, run.config.num_classes
    prefix = gpt.prefix_tokens(labels if num_classes else None, codebook_size, num_classes, batch)
    null = None if guidance is None else gpt.null_tokens(codebook_size, num_classes, batch)
    return prefix, null


def sample_codes(
    run: TrainedPrior, labels, rng, *, number: int | None = None, grid_shape=None, **settings
):
    """Codes ``[batch, H, W]`` of class ``labels [batch]`` (or ``number`` unconditional ones);
    ``grid_shape`` larger than the trained grid samples with the sliding window."""
    batch = number if labels is None else len(labels)
    prefix, null = _prefixes(run, labels, batch, settings.get("guidance"))
    with on_mesh(run.mesh):
        return sampling.sample_window(
            run.model,
            run.params,
            prefix,
            rng,
            grid_shape or run.vqgan.grid_shape,
            run.vqgan.grid_shape,
            null_prefix=null,
            **settings,
        )


def decode(run: TrainedPrior, codes) -> np.ndarray:
    """Codes ``[batch, h, w]`` -> pixels ``[batch, H, W, C]`` (in [0, 1] for a good VQGAN)."""
    # Through the host: codes sampled on a mesh live on its devices, the VQGAN on one.
    decoded = vqgan_task.compiled_method(run.vqgan.model, "decode_indices")(
        run.vqgan.variables, jnp.asarray(np.asarray(codes), jnp.int32)
    )
    return data.denormalize(np.asarray(decoded), run.vqgan.config.data)


def complete_test_images(run: TrainedPrior, number: int, rows: int, rng, **settings) -> dict:
    """Completion of the first ``number`` held-out images from their first ``rows`` code rows.

    Returns ``originals``, ``kept`` (the reconstruction of the kept rows, the rest grey),
    ``completions`` (pixels ``[number, H, W, C]``) and ``labels [number]``.
    """
    height = run.vqgan.grid_shape[0]
    if not 1 <= rows < height:
        raise ValueError(
            f"--rows must be in [1, {height - 1}] (the code grid has {height} rows), got {rows}"
        )
    images, codes, labels = prior_task.first_codes(run.vqgan, number)
    prefix, null = _prefixes(run, labels, number, settings.get("guidance"))
    with on_mesh(run.mesh):
        completed = sampling.complete(
            run.model, run.params, prefix, codes, rows, rng, null_prefix=null, **settings
        )
    originals = data.denormalize(images, run.vqgan.config.data)
    kept = decode(run, codes)
    kept[:, rows * kept.shape[1] // height :] = 0.5
    return {
        "originals": originals,
        "kept": kept,
        "completions": decode(run, completed),
        "labels": labels,
    }


def parse_grid(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text or "")
    if not match or min(int(match[1]), int(match[2])) < 1:
        raise ValueError(f"--grid must be HxW with positive integers (e.g. 4x8), got {text!r}")
    return int(match[1]), int(match[2])


def run_command(args) -> str:
    """Does what the parsed ``args`` ask; returns the PNG path."""
    if args.number < 1:
        raise ValueError(f"--number must be >= 1, got {args.number}")
    if args.grid and args.complete:
        raise ValueError("--grid and --complete are separate modes: pass one of them")
    grid = parse_grid(args.grid) if args.grid else None
    mesh = parse_mesh(args.mesh) if args.mesh else None
    default_name = (
        "completion.png" if args.complete else f"grid_{args.grid}.png" if grid else "sample.png"
    )
    out = args.out or storage.join(args.workdir, default_name)
    if storage.exists(out) and not args.force:
        raise ValueError(f"{out!r} exists; pass --force to overwrite it (or --out elsewhere)")
    check_statistics_args(args)
    run = load_prior(args.workdir, args.step, mesh)
    num_classes = run.config.num_classes
    if args.class_id is not None and num_classes == 0:
        raise ValueError(f"--class {args.class_id}: this prior is unconditional (num_classes = 0)")
    if args.class_id is not None and not 0 <= args.class_id < num_classes:
        raise ValueError(
            f"--class must be in [0, {num_classes - 1}] for this prior, got {args.class_id}"
        )
    if grid is not None and (
        grid[0] < run.vqgan.grid_shape[0] or grid[1] < run.vqgan.grid_shape[1]
    ):
        raise ValueError(
            f"--grid {args.grid} must be at least the trained grid "
            f"{run.vqgan.grid_shape[0]}x{run.vqgan.grid_shape[1]}"
        )
    settings = sampling_settings(
        run,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        guidance=args.guidance,
    )
    rng = jax.random.key(args.seed)
    scale = run.config.sampling.get("png_scale", 1)
    if args.complete:
        rows = run.vqgan.grid_shape[0] // 2 if args.rows is None else args.rows
        result = complete_test_images(run, args.complete, rows, rng, **settings)
        pictures = np.concatenate([result["originals"], result["kept"], result["completions"]])
        return save_image_grid(pictures, out, nrow=args.complete, scale=scale)
    if num_classes == 0:
        labels, nrow = None, args.number
    elif args.class_id is not None:
        labels, nrow = np.full((args.number,), args.class_id, np.int32), args.number
    else:
        labels, nrow = np.repeat(np.arange(num_classes, dtype=np.int32), args.number), args.number
    codes = sample_codes(run, labels, rng, number=args.number, grid_shape=grid, **settings)
    images = decode(run, codes)
    if args.save_stats:
        save_sample_statistics(images, args)
    return save_image_grid(images, out, nrow=nrow, scale=scale)


def check_statistics_args(args) -> None:
    """``--save-stats`` needs one network and a new ``.npz``: checked before any sampling."""
    if not args.save_stats:
        if args.inception or args.classifier:
            raise ValueError("--inception and --classifier are for --save-stats OUT.npz")
        return
    if not args.save_stats.endswith(".npz"):
        raise ValueError(f"--save-stats {args.save_stats!r} must end in .npz (pytorch-fid's)")
    if os.path.exists(args.save_stats):
        raise ValueError(f"--save-stats {args.save_stats!r} exists; not overwriting it")
    if bool(args.inception) == bool(args.classifier):
        raise ValueError("--save-stats needs one network: --inception W.npz or --classifier RUN")
    if args.complete:
        raise ValueError("--save-stats writes the statistics of samples, not of --complete")
    if args.dims not in image_metrics.INCEPTION_DIMS:
        raise ValueError(f"--dims {args.dims} must be one of {image_metrics.INCEPTION_DIMS}")


def save_sample_statistics(images, args) -> str:
    """pytorch-fid's statistics file (``mu``, ``sigma``) of the samples' features: the
    Inception's ``--dims`` features, or a classification run's pre-logits (a domain FID)."""
    if args.inception:
        extractor, feature = inception_extractor(args.inception, args.dims), str(args.dims)
    else:
        extractor = classification.feature_extractor(args.classifier)
        feature = classification.PRE_LOGITS
    source = sources.ArrayImages(np.clip(images, 0.0, 1.0), "samples")
    (mu, sigma), _ = measure(source, extractor, feature, progress=False)
    return save_statistics(args.save_stats, mu, sigma)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m attnjax.inference.generate", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--workdir", required=True, help="a trained prior run")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument(
        "--class",
        dest="class_id",
        type=int,
        default=None,
        help="class to sample (default: every class, a row each)",
    )
    parser.add_argument("--number", type=int, default=8, help="samples (per class without --class)")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument(
        "--guidance",
        type=float,
        default=None,
        help="classifier-free guidance weight (priors trained with class_dropout)",
    )
    parser.add_argument("--grid", default=None, help="HxW code grid, at least the trained one")
    parser.add_argument(
        "--complete",
        type=int,
        default=0,
        help="complete this many held-out images from their first --rows rows",
    )
    parser.add_argument("--rows", type=int, default=None, help="code rows kept (default: half)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mesh",
        default=None,
        help="sample on a mesh, e.g. model=2 or data=2,model=2 (tensor parallelism over model)",
    )
    parser.add_argument("--out", default=None, help="PNG path (default: in --workdir)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    parser.add_argument(
        "--save-stats", default=None, help="also write the samples' FID statistics to this .npz"
    )
    parser.add_argument("--inception", default=None, help="converted Inception .npz for them")
    parser.add_argument("--dims", type=int, default=2048, help="Inception feature depth")
    parser.add_argument("--classifier", default=None, help="or a classification run (domain)")
    return parser.parse_args(argv)


def main(argv=None):
    compilation_cache.enable()
    collector.raise_thresholds()
    try:
        path = run_command(parse_args(argv))
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"error: {error}")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
