"""What ``config.data`` does to each image on its way to a batch, as functions of a uint8
``[H, W, C]`` image (the crops themselves are in ``attnjax.data.transforms``).

``train_crop``:

- ``"resize"``: the whole image resized to ``image_size`` x ``image_size`` (0: kept as it is),
  then ``crop_padding`` shifts and ``flip`` (the TFDS configs' small images);
- ``"random"``: the shorter side resized to ``image_size / crop_fraction``, a random
  ``image_size`` square cut from it (taming's ``SmallestMaxSize`` + ``RandomCrop``);
- ``"center"``: the same resize, the central square;
- ``"inception"``: a random window of ``inception_area`` of the image and an aspect ratio in
  [3/4, 4/3], resized to the square (big_vision's ``decode_jpeg_and_inception_crop``).

Then ``flip`` (a left-right flip with probability 1/2) for every crop. ``eval_crop`` is
``"resize"`` or ``"center"``. With ``upscale=False`` a file whose shorter side is below what the
crops need is an error before training instead of being enlarged.

A train image goes through ``prepare`` (deterministic: what a kept-in-memory record stores)
then ``augment`` (random, from grain's per-position generator).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from attnjax.data.transforms import (
    center_crop,
    inception_crop,
    random_crop,
    random_crop_flip,
    resize,
    resize_shorter,
)

TRAIN_CROPS = ("resize", "random", "center", "inception")
EVAL_CROPS = ("resize", "center")


def crops(data) -> tuple[str, str]:
    """``(train_crop, eval_crop)``, checked; configs older than the fields read ``"resize"``."""
    train, evaluation = data.get("train_crop", "resize"), data.get("eval_crop", "resize")
    for field, value, choices in (
        ("train_crop", train, TRAIN_CROPS),
        ("eval_crop", evaluation, EVAL_CROPS),
    ):
        if value not in choices:
            raise ValueError(f"config.data.{field}={value!r}; expected one of {choices}")
    if {train, evaluation} != {"resize"}:
        size, fraction = data.get("image_size", 0), data.get("crop_fraction", 1.0)
        if not isinstance(size, int) or size <= 0:
            raise ValueError(
                f"config.data.image_size={size!r} with train_crop={train!r}, eval_crop="
                f"{evaluation!r}; expected a positive side for the crops"
            )
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"config.data.crop_fraction={fraction!r}; expected a value in (0, 1]")
    return train, evaluation


def resized_side(data) -> int:
    """The shorter side ``"random"`` and ``"center"`` crops resize to."""
    return round(data.image_size / data.get("crop_fraction", 1.0))


def _side(data, crop: str) -> int:
    return resized_side(data) if crop in ("random", "center") else data.get("image_size", 0)


def needed_side(data) -> int:
    """The shorter side a file needs for the crops not to enlarge it."""
    return max(_side(data, crop) for crop in crops(data))


def draft_side(data) -> int:
    """The side both sides of a decoded image may shrink to (JPEG's reduced-scale decoding) without
    changing what the crops need; 0 when an inception crop may cut a small window."""
    train, evaluation = crops(data)
    if train == "inception":
        return 0
    return min(_side(data, train), _side(data, evaluation))


def source_side(data) -> int:
    """The shorter side every transform of ``data`` first resizes an image to, so that a source
    may decode straight to it (``decode_image``'s ``shorter_side``); 0 where some transform
    needs the image as it is (``"resize"``, ``"inception"``)."""
    if set(crops(data)) <= {"random", "center"}:
        return resized_side(data)
    return 0


def _deterministic(data, crop: str) -> Callable[[np.ndarray], np.ndarray]:
    size = data.get("image_size", 0)
    if crop == "resize":
        return lambda image: resize(image, size)
    if crop == "center":
        side = resized_side(data)
        return lambda image: center_crop(resize_shorter(image, side), size)
    if crop == "random":
        side = resized_side(data)
        return lambda image: resize_shorter(image, side)
    return lambda image: image


def prepare_fn(data) -> Callable[[np.ndarray], np.ndarray]:
    """The deterministic part of the train transform."""
    return _deterministic(data, crops(data)[0])


def eval_fn(data) -> Callable[[np.ndarray], np.ndarray]:
    """The eval transform: an image -> ``[image_size, image_size, C]``."""
    return _deterministic(data, crops(data)[1])


def augment_fn(data) -> Callable[[np.ndarray, np.random.Generator], np.ndarray] | None:
    """The random part of the train transform (None when there is none)."""
    crop, size = crops(data)[0], data.get("image_size", 0)
    padding, flip = data.get("crop_padding", 0), data.get("flip", False)
    area = tuple(data.get("inception_area", (0.05, 1.0)))
    if crop == "random":
        cut = lambda image, rng: random_crop(image, rng, size)
    elif crop == "inception":
        cut = lambda image, rng: inception_crop(image, rng, size, area)
    elif padding or flip:
        cut = lambda image, rng: image
    else:
        return None
    return lambda image, rng: random_crop_flip(cut(image, rng), rng, padding, flip)
