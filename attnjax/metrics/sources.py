"""Where the images of a metric come from, named as pytorch-fid's command names them, plus TFDS:

- a folder: its image files (pytorch-fid's extensions, not its subfolders), in pytorch-fid's
  order (sorted paths), read as RGB and scaled to [0, 1] as ``ToTensor`` does;
- a ``.npz`` file: precomputed statistics, ``mu`` and ``sigma`` (pytorch-fid's format);
- ``tfds:NAME:SPLIT`` (``tfds:cifar10:test``, ``tfds:mnist:train[:10000]``): the ``image`` of
  every example of a prepared TFDS split, gray images repeated to three channels;
- image files as training reads them (``folder:ROOT``, ``filelist:LISTS``, ``shards:DIR``,
  ``attnjax.data.folder``): every image of both splits (``train``, ``test``), in any folder
  layout, as RGB, each cut to its central square and resized to ``image_size`` (0: kept);
  ``KIND:PATH:SPLIT`` (``folder:photos:test``) reads one split only, split as training splits
  it (``attnjax.data.folder.list_split``): a split folder, or in a class tree or a flat folder
  ``train`` (the kept share) or ``test`` (the share held out by ``holdout_fraction`` and
  ``holdout_seed``, configs/common.py's 0.1 and 0 unless given).

- images in memory (``ArrayImages``): generated samples, reconstructions, a decoded split.

``open_source`` returns ``Statistics`` or an image source (``len`` and ``batches(size)``, each
batch float32 ``[n, H, W, 3]``). Every problem is a ValueError in one line that names the path.
"""

from __future__ import annotations

import os
import pathlib
from typing import Iterator, NamedTuple

import numpy as np

from attnjax.data import folder, pipeline, shards, transforms
from attnjax.data.decode import decode_image
from attnjax.data.sources import file_kind
from attnjax.metrics.statistics import load_statistics

# pytorch-fid's IMAGE_EXTENSIONS; as there, lower-case only.
IMAGE_EXTENSIONS = ("bmp", "jpg", "jpeg", "pgm", "png", "ppm", "tif", "tiff", "webp")


class Statistics(NamedTuple):
    """A statistics file: ``mu [d]`` and ``sigma [d, d]``, float64."""

    path: str
    mu: np.ndarray
    sigma: np.ndarray


def _rgb(image: np.ndarray, where: str) -> np.ndarray:
    if image.ndim == 2:
        image = image[..., None]
    if image.ndim != 3 or image.shape[-1] not in (1, 3):
        raise ValueError(f"{where}: not an image of 1 or 3 channels (shape {image.shape})")
    return np.repeat(image, 3, axis=-1) if image.shape[-1] == 1 else image


def _stack(images: list[np.ndarray], names: list[str], where: str) -> np.ndarray:
    for image, name in zip(images, names):
        if image.shape != images[0].shape:
            raise ValueError(
                f"{where}: {name} is {image.shape[:2]} but {names[0]} is {images[0].shape[:2]}; "
                f"the images of one source must share a size"
            )
    return np.stack(images).astype(np.float32) / 255


class ImageFolder:
    """The image files directly inside ``path``."""

    def __init__(self, path):
        self.path = os.fspath(path)
        folder = pathlib.Path(self.path)
        self.files = sorted(file for ext in IMAGE_EXTENSIONS for file in folder.glob(f"*.{ext}"))
        if not self.files:
            raise ValueError(
                f"{self.path!r}: no image files in this folder "
                f"(looked for *.{{{','.join(IMAGE_EXTENSIONS)}}})"
            )

    def __len__(self) -> int:
        return len(self.files)

    def _read(self, file: pathlib.Path) -> np.ndarray:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(file) as image:
                return np.asarray(image.convert("RGB"))
        except (OSError, UnidentifiedImageError, ValueError) as error:
            raise ValueError(f"{str(file)!r}: not a readable image ({error})") from None

    def batches(self, size: int) -> Iterator[np.ndarray]:
        for start in range(0, len(self.files), size):
            files = self.files[start : start + size]
            images = [self._read(file) for file in files]
            yield _stack(images, [str(file) for file in files], self.path)


class TfdsSplit:
    """The ``image`` feature of every example of TFDS ``name``/``split`` under ``data_dir``."""

    def __init__(self, name: str, split: str, data_dir: str | None = None):
        self.path = f"tfds:{name}:{split}"
        try:
            self.source = pipeline.load_source(name, split, data_dir)
            first = self.source[0] if len(self.source) else None
        except (ValueError, RuntimeError, KeyError, OSError) as error:
            reason = " ".join(str(error).split())
            raise ValueError(f"{self.path!r}: {reason}") from None
        if first is None or "image" not in first:
            raise ValueError(f"{self.path!r}: no examples with an 'image' feature")

    def __len__(self) -> int:
        return len(self.source)

    def batches(self, size: int) -> Iterator[np.ndarray]:
        for start in range(0, len(self), size):
            indices = range(start, min(start + size, len(self)))
            images = [_rgb(np.asarray(self.source[i]["image"]), self.path) for i in indices]
            yield _stack(images, [f"example {i}" for i in indices], self.path)


class DataImages:
    """The images of image files (``KIND:PATH``: ``folder:``, ``filelist:``, ``shards:``) of both
    splits, or (``KIND:PATH:SPLIT``) of one split, held out by ``fraction`` and ``seed`` where the
    layout has no split folders (``attnjax.data.folder.list_split``)."""

    SPLITS = folder.SPLITS

    def __init__(
        self,
        spec: str,
        image_size: int = 0,
        fraction: float = folder.HOLDOUT_FRACTION,
        seed: int = folder.HOLDOUT_SEED,
    ):
        self.path, self.image_size = spec, image_size
        kind, location = file_kind(spec)
        split = split_of(spec)
        if split is not None:
            location = location[: -len(split) - 1]
        if kind == "shards":
            splits = self.SPLITS if split is None else (split,)
            for name in splits:
                shards.split_list(location, name)  # a one-line error for a split it lacks
            self.sources = [shards.ShardSource(location, name, 3) for name in splits]
            self.items = [(s, i) for s in self.sources for i in range(len(s))]
        elif split is None:
            lists = folder.list_splits(kind, location, self.SPLITS, fraction=0.5).values()
            self.items = [(path, None) for images in lists for path in images.paths]
        else:
            images = folder.list_split(kind, location, split, fraction=fraction, seed=seed)
            self.items = [(path, None) for path in images.paths]
        if not self.items:
            raise ValueError(f"{spec!r}: no images in this split; expected at least one")

    def __len__(self) -> int:
        return len(self.items)

    def _read(self, item) -> np.ndarray:
        where, index = item
        image = decode_image(where, 3, where) if index is None else where[index]["image"]
        square = transforms.center_crop(image, min(image.shape[:2]))
        return transforms.resize(square, self.image_size)

    def batches(self, size: int) -> Iterator[np.ndarray]:
        for start in range(0, len(self), size):
            items = self.items[start : start + size]
            images = [self._read(item) for item in items]
            yield _stack(images, [f"image {start + i}" for i in range(len(items))], self.path)


class ArrayImages:
    """Images held in memory, ``[n, H, W, C]`` floats in [0, 1], as given (no channel change:
    a domain network may read gray images); ``path`` names them in messages."""

    def __init__(self, images, path: str = "images"):
        self.path = path
        self.images = np.asarray(images, np.float32)
        if self.images.ndim != 4 or not len(self.images):
            raise ValueError(
                f"{path}: images must be [n, H, W, C] with n > 0, got {self.images.shape}"
            )

    def __len__(self) -> int:
        return len(self.images)

    def batches(self, size: int) -> Iterator[np.ndarray]:
        for start in range(0, len(self), size):
            yield self.images[start : start + size]


def split_of(spec: str) -> str | None:
    """The SPLIT of image files named ``KIND:PATH:SPLIT`` (after the last colon, where
    ``KIND:PATH:SPLIT`` as a whole names no existing file or folder); None for ``KIND:PATH``."""
    kind, location = file_kind(spec)
    path, colon, split = location.rpartition(":")
    if not colon or "/" in split or os.path.exists(os.path.expanduser(location)):
        return None
    if not split or not path:
        raise ValueError(
            f"{spec!r}: expected {kind}:PATH or {kind}:PATH:SPLIT, e.g. {kind}:photos:test"
        )
    return split


def open_source(
    spec: str,
    data_dir: str | None = None,
    image_size: int = 0,
    holdout_fraction: float = folder.HOLDOUT_FRACTION,
    holdout_seed: int = folder.HOLDOUT_SEED,
):
    """``spec`` (a folder, a statistics ``.npz``, ``tfds:NAME:SPLIT`` or image files as training
    reads them, ``KIND:PATH[:SPLIT]``) -> ``Statistics``, ``ImageFolder``, ``TfdsSplit`` or
    ``DataImages``; ``data_dir``: TFDS's (default ``$TFDS_DATA_DIR``); ``image_size``,
    ``holdout_fraction`` and ``holdout_seed``: of ``DataImages``."""
    spec = os.fspath(spec)
    if file_kind(spec):
        return DataImages(spec, image_size, holdout_fraction, holdout_seed)
    if spec.startswith("tfds:"):
        parts = spec.split(":", 2)  # a split may hold colons itself: test[:100]
        if len(parts) != 3 or not parts[1] or not parts[2]:
            raise ValueError(f"{spec!r}: a TFDS source is tfds:NAME:SPLIT, e.g. tfds:cifar10:test")
        return TfdsSplit(parts[1], parts[2], data_dir)
    if spec.endswith(".npz"):
        if not os.path.isfile(spec):
            raise ValueError(f"{spec!r}: no such statistics file")
        return Statistics(spec, *load_statistics(spec))
    if os.path.isdir(spec):
        return ImageFolder(spec)
    raise ValueError(
        f"{spec!r}: not a folder of images, a statistics .npz or tfds:NAME:SPLIT"
        + ("" if os.path.exists(spec) else " (no such file or folder)")
    )
