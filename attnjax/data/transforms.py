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
    if images.dtype == np.uint8:
        images = images.astype(np.float32) / 255.0
    return (images - mean) / std


def denormalize(images, data_config):
    """Model-space images ``[..., C]`` -> pixels ``x * std + mean`` (in [0, 1], unclipped).

    numpy in, numpy out; a jax array (traced or not) stays a jax array.
    """
    mean, std = _mean_std(data_config)
    return images * std + mean
