"""Per-example image transforms on uint8 ``[H, W, C]`` numpy arrays: resizing and augmentation."""

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
