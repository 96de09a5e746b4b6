"""Positional encodings: fixed sin-cos (1-D and 2-D) and learned embeddings, and their resizing.

Formula (Vaswani et al., 2017), for position ``pos`` and column pair ``(2i, 2i + 1)``::

    PE[pos, 2i]     = sin(pos / base ** (2i / dim))
    PE[pos, 2i + 1] = cos(pos / base ** (2i / dim))

Sines and cosines are interleaved column by column exactly as written. For an odd ``dim`` the
last column is a sine (its pair has no room for the cosine).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_RESIZE_METHODS = {"nearest": "nearest", "bilinear": "linear", "bicubic": "cubic"}


def _positive_int(value, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
    return value


def _sinusoid(positions, dim: int, base) -> jax.Array:
    """``positions [n]`` (float) -> ``[n, dim]`` interleaved sin/cos encoding."""
    pair_index = jnp.arange(0, dim, 2, dtype=jnp.float32)  # the "2i" of the formula
    inv_frequency = jnp.power(jnp.asarray(base, jnp.float32), -pair_index / dim)
    angles = positions[:, None] * inv_frequency[None, :]  # [n, ceil(dim / 2)]
    interleaved = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(len(positions), -1)
    return interleaved[:, :dim]


def sinusoidal_encoding(length: int, dim: int, base=10000.0) -> jax.Array:
    """Fixed sin-cos positional encoding ``[length, dim]`` (float32), positions ``0 .. length-1``.

    ``PE[pos, 2i] = sin(pos / base**(2i/dim))``, ``PE[pos, 2i+1] = cos(pos / base**(2i/dim))``.
    An odd ``dim`` is supported: its last column is ``sin(pos / base**((dim-1)/dim))``.
    ``base`` may be a traced value (``jax.grad``/``jax.vmap`` over it work); ``length`` and ``dim``
    are static.

    Example: ``dim=4``, ``pos=1`` gives ``[sin(1), cos(1), sin(0.01), cos(0.01)]`` =
    ``[0.8415, 0.5403, 0.0100, 0.99995]``. (A third entry of 0.0001, as some worked examples
    print, does not follow from the formula: ``1 / 10000**(2/4) = 0.01``.)
    """
    _positive_int(length, "length", "sinusoidal_encoding")
    _positive_int(dim, "dim", "sinusoidal_encoding")
    return _sinusoid(jnp.arange(length, dtype=jnp.float32), dim, base)


def sincos_2d_encoding(grid_h: int, grid_w: int, dim: int, base=10000.0) -> jax.Array:
    """Fixed 2-D sin-cos encoding for a patch grid: ``[grid_h * grid_w, dim]`` (row-major tokens).

    The first ``dim / 2`` columns are ``sinusoidal_encoding``'s formula applied to the row index,
    the last ``dim / 2`` to the column index; token ``r * grid_w + c`` is patch ``(r, c)``, the
    order in which a ``[batch, grid_h, grid_w, dim]`` patch grid flattens.
    """
    _positive_int(grid_h, "grid_h", "sincos_2d_encoding")
    _positive_int(grid_w, "grid_w", "sincos_2d_encoding")
    _positive_int(dim, "dim", "sincos_2d_encoding")
    if dim % 2:
        raise ValueError(
            f"sincos_2d_encoding: dim must be even (half rows, half columns), got {dim}"
        )
    rows, cols = jnp.meshgrid(
        jnp.arange(grid_h, dtype=jnp.float32), jnp.arange(grid_w, dtype=jnp.float32), indexing="ij"
    )
    return jnp.concatenate(
        [_sinusoid(rows.reshape(-1), dim // 2, base), _sinusoid(cols.reshape(-1), dim // 2, base)],
        axis=-1,
    )


def resize_position_embedding(
    posemb,
    new_grid_hw,
    num_prefix_tokens: int = 1,
    method: str = "bicubic",
    old_grid_hw=None,
) -> jax.Array:
    """Resample a learned grid position embedding to a new patch grid (ViT fine-tuning at a new
    size).

    Args:
      posemb: ``[1, num_prefix_tokens + h * w, dim]``; prefix tokens (class token) come first and
        are kept as they are; the grid tokens are row-major.
      new_grid_hw: ``(H, W)`` of the new grid.
      num_prefix_tokens: number of leading non-grid tokens.
      method: "bicubic" (Keys cubic, a = -0.5), "bilinear" or "nearest", with half-pixel centres
        (``jax.image.resize``; antialiased when shrinking).
      old_grid_hw: ``(h, w)`` of the old grid; default a square grid.

    Returns:
      ``[1, num_prefix_tokens + H * W, dim]``.
    """
    posemb = jnp.asarray(posemb)
    if posemb.ndim != 3 or posemb.shape[0] != 1:
        raise ValueError(
            f"resize_position_embedding: posemb must be [1, tokens, dim], got shape {posemb.shape}"
        )
    if method not in _RESIZE_METHODS:
        raise ValueError(
            f"resize_position_embedding: method must be one of {sorted(_RESIZE_METHODS)}, "
            f"got {method!r}"
        )
    num_grid = posemb.shape[1] - num_prefix_tokens
    if num_prefix_tokens < 0 or num_grid < 1:
        raise ValueError(
            f"resize_position_embedding: num_prefix_tokens={num_prefix_tokens} leaves no grid "
            f"tokens in posemb of shape {posemb.shape}"
        )
    if old_grid_hw is None:
        side = math.isqrt(num_grid)
        if side * side != num_grid:
            raise ValueError(
                f"resize_position_embedding: {num_grid} grid tokens (posemb shape {posemb.shape}, "
                f"num_prefix_tokens={num_prefix_tokens}) are not a square grid; pass old_grid_hw"
            )
        old_grid_hw = (side, side)
    old_h, old_w = old_grid_hw
    if old_h * old_w != num_grid:
        raise ValueError(
            f"resize_position_embedding: old_grid_hw={tuple(old_grid_hw)} does not match the "
            f"{num_grid} grid tokens of posemb shape {posemb.shape}"
        )
    new_h, new_w = new_grid_hw
    _positive_int(new_h, "new_grid_hw[0]", "resize_position_embedding")
    _positive_int(new_w, "new_grid_hw[1]", "resize_position_embedding")
    dim = posemb.shape[-1]
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[0, num_prefix_tokens:]
    grid = grid.reshape(old_h, old_w, dim)
    grid = jax.image.resize(grid, (new_h, new_w, dim), method=_RESIZE_METHODS[method])
    return jnp.concatenate(
        [prefix, grid.reshape(1, new_h * new_w, dim).astype(posemb.dtype)], axis=1
    )
