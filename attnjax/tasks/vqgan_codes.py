"""A trained VQGAN's codes of a dataset split, the prior's data, cached on disk.

The VQGAN run's dataset (its ``config.data``: same source, size, crop and normalisation) is
encoded once to token grids, flattened in raster order, and cached as ``.npz`` (the prior puts
the cache next to the VQGAN, ``<vqgan_workdir>/codes/``, unless ``config.codes_cache_dir`` says
otherwise). The cache key hashes the VQGAN workdir, its checkpoint step, its parameters and the
data settings, so a retrained VQGAN is encoded afresh. ``shifts = s`` also encodes every image
shifted by each ``(dy, dx)`` in ``[-s, s]^2`` (zero fill): (2s + 1)^2 code sequences per image.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import io
import json
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from attnjax import data, storage
from attnjax.tasks import vqgan as vqgan_task
from attnjax.train import checkpoint


class TrainedVQGAN(NamedTuple):
    """A trained VQGAN as the prior needs it."""

    workdir: str
    config: Any  # the VQGAN run's config
    model: nn.Module  # its VQGAN module (``encode``, ``decode_indices``)
    variables: dict  # {"params": ...} (+ any collections the module reads)
    step: int
    grid_shape: tuple  # the token grid (h, w)


@functools.lru_cache(maxsize=4)
def load_vqgan(workdir: str, step: int | None = None) -> TrainedVQGAN:
    """The VQGAN trained in ``workdir`` (cached per process: the prior's steps reuse it)."""
    if not workdir or not storage.isdir(storage.join(workdir, "checkpoints")):
        raise FileNotFoundError(
            f"config.vqgan_workdir={workdir!r} holds no checkpoints: train the VQGAN first "
            "(python train.py --config configs/vqgan_digits.py --workdir <dir>)"
        )
    vq_config, loaded = checkpoint.load(workdir, step=step, variables=vqgan_task.VARIABLE_FIELDS)
    if vq_config.task != "vqgan":
        raise ValueError(
            f"config.vqgan_workdir={workdir!r} holds a {vq_config.task!r} run, expected a "
            "'vqgan' run"
        )
    model, variables = vqgan_task.inference_model(vq_config, loaded)
    step = checkpoint.latest_step(workdir) if step is None else step
    size = vq_config.data.image_size or model.resolution  # image_size 0: the native size
    return TrainedVQGAN(workdir, vq_config, model, variables, step, model.token_grid(size, size))


def _params_digest(tree) -> str:
    digest = hashlib.sha1()
    for path, leaf in sorted(flax.traverse_util.flatten_dict(tree, sep="/").items()):
        digest.update(path.encode())
        digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return digest.hexdigest()


def _shift(images: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """``[..., H, W, C]`` moved by ``(dy, dx)`` pixels, zero fill."""
    height, width = images.shape[-3:-1]
    pad = max(abs(dy), abs(dx))
    padded = np.pad(images, [(0, 0)] * (images.ndim - 3) + [(pad, pad), (pad, pad), (0, 0)])
    return padded[..., pad - dy : pad - dy + height, pad - dx : pad - dx + width, :]


def load_images(data_config, split: str, shifts: int):
    """Normalised images ``[N * (2 shifts + 1)^2, H, W, C]`` and labels of a split, each image as
    the eval pipeline reads it."""
    images, labels = data.eval_images(data_config, split)
    offsets = [(dy, dx) for dy in range(-shifts, shifts + 1) for dx in range(-shifts, shifts + 1)]
    images = np.asarray(images)
    # Image by image, each image's shifts in a row: [N, offsets, H, W, C] -> [N * offsets, ...].
    shifted = np.stack([_shift(images, dy, dx) for dy, dx in offsets], axis=1)
    labels = np.repeat(labels.astype(np.int32), len(offsets))
    return data.normalize(shifted.reshape(-1, *images.shape[1:]), data_config), labels


def _encode_indices(model, variables, images):
    """``[b, H, W, C]`` -> the VQGAN's token grid ``[b, h, w]``."""
    return model.apply(variables, images, method=type(model).encode)[1]


def encode_split(
    vqgan: TrainedVQGAN, split: str, *, shifts: int = 0, cache_dir: str, batch_size: int = 256
):
    """Codes ``int32 [N, h * w]`` (raster order) and labels ``int32 [N]`` of one split, cached."""
    data_config = vqgan.config.data
    key = json.dumps(
        {
            "vqgan_workdir": storage.absolute(vqgan.workdir),
            "step": int(vqgan.step),
            "params": _params_digest(vqgan.variables),
            "data": {
                k: data_config.get(k)
                for k in (
                    *("name", "image_size", "image_key", "label_key", "mean", "std"),
                    *("eval_crop", "crop_fraction", "channels", "holdout_fraction", "holdout_seed"),
                )
            },
            "split": split,
            "shifts": shifts,
        },
        sort_keys=True,
        default=str,
    )
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    path = storage.join(cache_dir, f"{split}-shift{shifts}-{digest}.npz")
    if storage.exists(path):
        with np.load(io.BytesIO(storage.read_bytes(path))) as cached:
            logging.info("prior: codes of %s/%s from the cache %s", data_config.name, split, path)
            return cached["codes"], cached["labels"]
    images, labels = load_images(data_config, split, shifts)
    # Each batch split over this process's devices (train.py makes one per CPU core): a CPU
    # device runs on one core. The model is a closure, not a static argument: a VQGAN built from
    # a config holds lists (unhashable).
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("batch",))
    batch_size = -(-batch_size // mesh.size) * mesh.size
    encode = jax.jit(functools.partial(_encode_indices, vqgan.model))
    # Both placed explicitly: jit refuses numpy inputs with a sharding in a multi-process run.
    variables = jax.device_put(vqgan.variables, NamedSharding(mesh, P()))
    split_batch = NamedSharding(mesh, P("batch"))
    codes, pending = [], collections.deque()

    def fetch_oldest():
        indices, count = pending.popleft()
        codes.append(np.asarray(indices)[:count].reshape(count, -1))

    for start in tqdm(
        range(0, len(images), batch_size),
        desc=f"encoding {split} to codes",
        unit="batch",
        leave=False,
    ):
        chunk = images[start : start + batch_size]
        padded = np.concatenate(
            [chunk, np.zeros((batch_size - len(chunk),) + chunk.shape[1:], chunk.dtype)]
        )  # one shape, one compilation
        pending.append((encode(variables, jax.device_put(padded, split_batch)), len(chunk)))
        # A few batches in flight: the next one's transfer overlaps this one's encoding.
        if len(pending) > 2:
            fetch_oldest()
    while pending:
        fetch_oldest()
    codes = np.concatenate(codes).astype(np.int32)
    storage.makedirs(cache_dir)
    # Written whole: a killed run leaves no bad cache, and every process of a multi-process run,
    # which all encode the same split, writes the same bytes.
    buffer = io.BytesIO()
    np.savez(buffer, codes=codes, labels=labels, key=key)
    storage.write_atomic(path, buffer.getvalue())
    logging.info(
        "prior: encoded %d %s images to codes %s -> %s", len(codes), split, codes.shape, path
    )
    return codes, labels


def first_codes(vqgan: TrainedVQGAN, number: int, split: str | None = None):
    """The first ``number`` images of a split (default: the VQGAN's eval split) as completion
    material: ``(images [n, H, W, C] normalised, codes int32 [n, h, w], labels int32 [n])``."""
    images, labels = load_images(vqgan.config.data, split or vqgan.config.data.eval_split, 0)
    if not 1 <= number <= len(images):
        raise ValueError(
            f"first_codes: number must be in [1, {len(images)}] (the images of the "
            f"split), got {number}"
        )
    images, labels = images[:number], labels[:number]
    codes = jax.jit(functools.partial(_encode_indices, vqgan.model, vqgan.variables))(images)
    return images, np.asarray(codes, np.int32), labels
