"""Image transforms: resizing and augmentation of uint8 ``[H, W, C]`` numpy arrays, and the
pixel normalisation of a config's ``data`` (``mean``, ``std``) with its inverse."""

from __future__ import annotations

import numpy as np
from PIL import Image


def resize(image: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of a uint8 ``[H, W, C]`` image to ``[size, size, C]``; 0 keeps it."""
    if not size or image.shape[:2] == (size, size):
        return image
    channels = image.shape[-1]
    pil = Image.fromarray(image[..., 0] if channels == 1 else image)
    out = np.asarray(pil.resize((size, size), Image.BILINEAR))
    return out[..., None] if channels == 1 else out


def random_crop_flip(
    image: np.ndarray, rng: np.random.Generator, padding: int, flip: bool
) -> np.ndarray:
    """Zero-pad by ``padding``, crop back at a random offset (a shift of +-padding), maybe flip."""
    if padding:
        # The crop of the zero-padded image, written as a shifted copy: np.pad costs most of the
        # per-example time of a 16x16 digit.
        h, w = image.shape[:2]
        dy, dx = rng.integers(0, 2 * padding + 1, size=2) - padding
        shifted = np.zeros_like(image)
        rows, cols = slice(max(0, -dy), h - max(0, dy)), slice(max(0, -dx), w - max(0, dx))
        if rows.start < rows.stop and cols.start < cols.stop:
            shifted[rows, cols] = image[
                rows.start + dy : rows.stop + dy, cols.start + dx : cols.stop + dx
            ]
        image = shifted
    if flip and rng.random() < 0.5:
        image = image[:, ::-1]
    return image


def _mean_std(data_config) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(data_config.mean, np.float32), np.asarray(data_config.std, np.float32)


def normalize(images, data_config):
    """Pixels ``[..., C]`` -> model inputs ``(x - mean) / std`` (float32, per channel).

    uint8 pixels are read as ``x / 255``; float pixels are taken to be in [0, 1] already.
    """
    mean, std = _mean_std(data_config)
    if isinstance(images, np.ndarray) and images.dtype == np.uint8:
        # Each channel's 256 values computed once, with the operations (so the values) below: a
        # lookup per pixel instead of four passes over a float array, the most of a batch's
        # time after decoding (benchmarks/results/input_pipeline.md).
        table = (np.arange(256, dtype=np.float32)[:, None] / 255.0 - mean) / std
        if (table == table[:, :1]).all():
            return table[:, 0][images]
        return table[images, np.arange(table.shape[1])]
    if images.dtype == np.uint8:
        images = images.astype(np.float32) / 255.0
    return (images - mean) / std


def denormalize(images, data_config):
    """Model-space images ``[..., C]`` -> pixels ``x * std + mean`` (in [0, 1], unclipped).

    numpy in, numpy out; a jax array (traced or not) stays a jax array.
    """
    mean, std = _mean_std(data_config)
    return images * std + mean


def _pil(image: np.ndarray) -> Image.Image:
    return Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)


def _array(pil: Image.Image) -> np.ndarray:
    pixels = np.asarray(pil)
    return pixels[..., None] if pixels.ndim == 2 else pixels


def resize_shorter(image: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of ``[H, W, C]`` so that its shorter side is ``size``, the aspect ratio
    kept (taming's ``SmallestMaxSize``); an image already that size is returned as it is."""
    if min(image.shape[:2]) == size:
        return image
    return _array(resize_shorter_image(_pil(image), size))


def resize_shorter_image(image: Image.Image, size: int) -> Image.Image:
    """``resize_shorter`` of a PIL image (a decoder resizes before converting to an array)."""
    width, height = image.size
    if min(height, width) == size:
        return image
    scale = size / min(height, width)
    shape = (max(size, round(width * scale)), max(size, round(height * scale)))
    return image.resize(shape, Image.BILINEAR)


def center_crop(image: np.ndarray, size: int) -> np.ndarray:
    """The central ``[size, size]`` window (the top-left one of the two where a side's surplus
    is odd)."""
    height, width = image.shape[:2]
    top, left = (height - size) // 2, (width - size) // 2
    return image[top : top + size, left : left + size]


def random_crop(image: np.ndarray, rng: np.random.Generator, size: int) -> np.ndarray:
    """A ``[size, size]`` window at a uniformly drawn offset (taming's ``RandomCrop``)."""
    height, width = image.shape[:2]
    top, left = rng.integers(0, height - size + 1), rng.integers(0, width - size + 1)
    return image[top : top + size, left : left + size]


def inception_crop(
    image: np.ndarray,
    rng: np.random.Generator,
    size: int,
    area: tuple[float, float] = (0.05, 1.0),
    aspect: tuple[float, float] = (3 / 4, 4 / 3),
) -> np.ndarray:
    """A random window covering ``area`` of the image (a fraction, drawn uniformly) with an aspect
    ratio drawn log-uniformly from ``aspect``, resized to ``[size, size]`` (the "Inception" crop:
    big_vision's ``inception_crop``, torchvision's ``RandomResizedCrop``). Ten draws that do not
    fit the image fall back to the largest central window of a ratio inside ``aspect``."""
    height, width = image.shape[:2]
    log_aspect = np.log(aspect)
    for _ in range(10):
        target = height * width * rng.uniform(*area)
        ratio = np.exp(rng.uniform(*log_aspect))
        w, h = round(np.sqrt(target * ratio)), round(np.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            top, left = rng.integers(0, height - h + 1), rng.integers(0, width - w + 1)
            break
    else:
        ratio = np.clip(width / height, *aspect)
        w, h = min(width, round(height * ratio)), min(height, round(width / ratio))
        top, left = (height - h) // 2, (width - w) // 2
    box = (left, top, left + w, top + h)
    return _array(_pil(image).resize((size, size), Image.BILINEAR, box=box))
