"""A split of image files as a random-access source: ``source[i]`` -> ``{"image": uint8 [H, W, C],
"label": int32}``, the file read and decoded when grain asks for it (in its threads or worker
processes when the config asks for them, never beforehand).

``ImageList`` is what a listing (``attnjax.data.folder``: folder trees and file lists) finds;
``checked`` reads every file's header before training (unreadable files, non-images and, with
``skip_unreadable``, truncated files are found there, not hours into a run); ``FileSource`` reads
the files. The ArrayRecord shards of ``attnjax.data.shards`` give the same records.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import NamedTuple, Sequence

import numpy as np
from absl import logging
from tqdm import tqdm

from attnjax.data.decode import decode_image, image_size

# Files whose headers are read at once; reading is I/O bound, so more threads than cores pay.
SCAN_THREADS = 16
# Listings of more files than this show a progress bar while their headers are read.
SCAN_PROGRESS_FROM = 5000


class ImageList(NamedTuple):
    """The image files of one split.

    paths: where each file is read from (and how errors name it); names: its path relative to
    the dataset's root (how shards name it); labels: int32 ``[n]`` (0 for unlabelled images);
    classes: the class names, label ``i`` is ``classes[i]`` (empty: unlabelled); sizes: int32
    ``[n, 2]`` (width, height) once ``checked``; unreadable: names of the files left out by
    ``skip_unreadable``.
    """

    paths: Sequence[str]
    names: Sequence[str]
    labels: np.ndarray
    classes: tuple[str, ...]
    sizes: np.ndarray | None = None
    unreadable: tuple[str, ...] = ()

    def select(self, keep: Sequence[int]) -> ImageList:
        keep = np.asarray(keep, np.int64)
        return self._replace(
            paths=[self.paths[i] for i in keep],
            names=[self.names[i] for i in keep],
            labels=self.labels[keep],
            sizes=None if self.sizes is None else self.sizes[keep],
        )


def checked(images: ImageList, *, skip_unreadable: bool, where: str) -> ImageList:
    """``images`` with the sizes of their files read from the headers. A file that cannot be
    read or is no image raises a one-line ``ValueError`` naming it; with ``skip_unreadable`` each
    file is decoded whole instead (which also finds truncated files) and the bad ones are left
    out, counted in ``unreadable`` and logged."""
    sizes = np.zeros((len(images.paths), 2), np.int32)
    problems: dict[int, str] = {}
    count = len(images.paths)
    bar = tqdm(
        total=count,
        desc=f"reading the headers of {where}",
        unit="file",
        disable=count < SCAN_PROGRESS_FROM,
        leave=False,
    )

    def read(first):
        # Every SCAN_THREADS-th file from ``first``: one task per thread, not one per file,
        # whose hand-offs cost more than a header read from the page cache.
        for i in range(first, count, SCAN_THREADS):
            try:
                sizes[i] = image_size(images.paths[i], str(images.paths[i]), full=skip_unreadable)
            except ValueError as error:
                problems[i] = str(error)
            bar.update(1)

    with bar, concurrent.futures.ThreadPoolExecutor(SCAN_THREADS) as pool:
        list(pool.map(read, range(min(SCAN_THREADS, count))))
    if problems and not skip_unreadable:
        raise ValueError(f"{problems[min(problems)]} (config.data.skip_unreadable=True skips it)")
    keep = [i for i in range(len(images.paths)) if i not in problems]
    result = images._replace(sizes=sizes).select(keep)
    if problems:
        unreadable = tuple(images.names[i] for i in sorted(problems))
        logging.warning(
            "%s: %d unreadable file(s) left out (config.data.skip_unreadable): %s",
            where,
            len(unreadable),
            "; ".join(problems[i] for i in sorted(problems)[:3]),
        )
        result = result._replace(unreadable=images.unreadable + unreadable)
    if not result.paths:
        raise ValueError(f"{where!r} holds no readable images; expected at least one")
    return result


def check_sizes(images: ImageList, least: int, why: str) -> None:
    """A one-line ``ValueError`` naming the first image whose shorter side is below ``least``."""
    shorter = images.sizes.min(axis=1)
    small = np.flatnonzero(shorter < least)
    if len(small):
        width, height = images.sizes[small[0]]
        raise ValueError(
            f"{str(images.paths[small[0]])!r} is {width}x{height}, smaller than the {least}-pixel "
            f"shorter side {why} needs ({len(small)} such image(s)); use larger images, a smaller "
            "config.data.image_size, or config.data.upscale=True"
        )


class FileSource:
    """Random access to the decoded files of an ``ImageList``, converted to ``channels``.

    ``min_side``: JPEGs may decode at a reduced scale that keeps both sides at least this long
    (``attnjax.data.decode.decode_image``); 0 decodes them whole. ``shorter_side``: images come
    resized to it (``decode_image``); 0: as they are.
    """

    def __init__(self, images: ImageList, channels: int, min_side: int = 0, shorter_side: int = 0):
        self.images, self.channels = images, channels
        self.min_side, self.shorter_side = min_side, shorter_side

    def __len__(self) -> int:
        return len(self.images.paths)

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        path = self.images.paths[index]
        image = decode_image(
            os.fspath(path), self.channels, str(path), self.min_side, self.shorter_side
        )
        return {"image": image, "label": self.images.labels[index]}
