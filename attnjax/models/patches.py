"""Images <-> patch sequences by reshaping, and the ``(h, w)`` pairs that size them.

``patchify`` cuts channels-last images ``[batch, H, W, C]`` into ``[batch, gh * gw, ph * pw * C]``,
patches row-major over the grid, pixels in ``(row, column, channel)`` order (what ``ViT``'s
``patch_embed`` reads); ``unpatchify`` inverts it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def pair(value, name: str, where: str) -> tuple[int, int]:
    """``n`` or ``(h, w)`` -> ``(h, w)`` as ints, each >= 1; ``name`` and ``where`` go in the
    error."""
    values = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(values) != 2 or not all(isinstance(v, (int, np.integer)) and v >= 1 for v in values):
        raise ValueError(f"{where}: {name} must be a positive int or a pair of them, got {value!r}")
    return int(values[0]), int(values[1])


def patchify(images, patch_size) -> Array:
    """Cut images into non-overlapping patches by reshaping (no copy of overlapping windows).

    Args:
      images: ``[batch, H, W, C]``.
      patch_size: ``P`` or ``(ph, pw)``; must divide ``H`` and ``W``.

    Returns:
      ``[batch, gh * gw, ph * pw * C]``, patches row-major over the grid, pixels ``(row, col, C)``.
    """
    ph, pw = pair(patch_size, "patch_size", "patchify")
    if jnp.ndim(images) != 4:
        raise ValueError(
            f"patchify: images must be [batch, H, W, C], got shape {jnp.shape(images)}"
        )
    batch, height, width, channels = images.shape
    if height % ph or width % pw:
        raise ValueError(
            f"patchify: image size {height}x{width} (images shape {images.shape}) is not divisible "
            f"by patch_size {ph}x{pw}"
        )
    gh, gw = height // ph, width // pw
    patches = images.reshape(batch, gh, ph, gw, pw, channels).transpose(0, 1, 3, 2, 4, 5)
    return patches.reshape(batch, gh * gw, ph * pw * channels)


def unpatchify(patches, grid_shape, patch_size, channels: int) -> Array:
    """Inverse of ``patchify``: ``[batch, gh * gw, ph * pw * C]`` -> ``[batch, H, W, C]``."""
    gh, gw = pair(grid_shape, "grid_shape", "unpatchify")
    ph, pw = pair(patch_size, "patch_size", "unpatchify")
    batch = patches.shape[0]
    if patches.shape[1:] != (gh * gw, ph * pw * channels):
        raise ValueError(
            f"unpatchify: patches of shape {patches.shape} do not match grid {gh}x{gw}, patch "
            f"{ph}x{pw} and {channels} channels (expected [batch, {gh * gw}, {ph * pw * channels}])"
        )
    images = patches.reshape(batch, gh, gw, ph, pw, channels).transpose(0, 1, 3, 2, 4, 5)
    return images.reshape(batch, gh * ph, gw * pw, channels)
