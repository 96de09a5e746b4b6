"""Attention masks: causal, padding, pairwise and their combination; a mask split into the
boolean and additive parts every attention path takes.

A boolean mask is True where a query may attend to a key; a float mask is added to the scores
(``-inf`` entries mask a key out).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def causal_mask(query_length: int, key_length: int | None = None) -> Array:
    """Top-left aligned causal mask ``tril(ones(L, S))`` (PyTorch's ``is_causal``): bool
    ``[L, S]``."""
    key_length = query_length if key_length is None else key_length
    if query_length < 1 or key_length < 1:
        raise ValueError(
            "causal_mask: query_length and key_length must be >= 1, "
            f"got {query_length}, {key_length}"
        )
    return jnp.tril(jnp.ones((query_length, key_length), dtype=bool))


def padding_mask(lengths, max_length: int) -> Array:
    """Valid-token mask from sequence lengths: ``lengths [batch]`` -> bool ``[batch, max_length]``.

    True marks a real token (position < length), False padding.
    """
    lengths = jnp.asarray(lengths)
    if lengths.ndim != 1:
        raise ValueError(
            f"padding_mask: lengths must have shape [batch], got shape {lengths.shape}"
        )
    return jnp.arange(max_length)[None, :] < lengths[:, None]


def make_attention_mask(query_valid, key_valid) -> Array:
    """Pairwise mask from per-token validity: ``[batch, L]``, ``[batch, S]`` -> bool
    ``[batch, 1, L, S]``.

    A query may attend to a key when both are real tokens; the singleton axis broadcasts over
    heads.
    """
    query_valid = jnp.asarray(query_valid, dtype=bool)
    key_valid = jnp.asarray(key_valid, dtype=bool)
    if query_valid.ndim != 2 or key_valid.ndim != 2:
        raise ValueError(
            "make_attention_mask: query_valid and key_valid must be [batch, length], got shapes "
            f"{query_valid.shape} and {key_valid.shape}"
        )
    if query_valid.shape[0] != key_valid.shape[0]:
        raise ValueError(
            f"make_attention_mask: batch sizes differ: query_valid {query_valid.shape}, "
            f"key_valid {key_valid.shape}"
        )
    return query_valid[:, None, :, None] & key_valid[:, None, None, :]


def combine_masks(*masks) -> Array | None:
    """Combine masks (``None`` entries ignored) by broadcasting; ``None`` when none is given.

    Boolean masks combine with a logical and. If any mask is a float (additive) mask, the result is
    additive: boolean masks become 0 / -inf and the float masks are summed.
    """
    masks = [jnp.asarray(m) for m in masks if m is not None]
    if not masks:
        return None
    try:
        jnp.broadcast_shapes(*(m.shape for m in masks))
    except ValueError:
        raise ValueError(
            f"combine_masks: mask shapes {[m.shape for m in masks]} do not broadcast together"
        ) from None
    if all(m.dtype == jnp.bool_ for m in masks):
        return functools.reduce(jnp.logical_and, masks)
    additive = [jnp.where(m, 0.0, -jnp.inf) if m.dtype == jnp.bool_ else m for m in masks]
    return functools.reduce(jnp.add, additive)


def split_mask(mask, where: str):
    """A user mask -> (boolean part or None, additive float part or None); ``where`` names the
    caller in the error for a mask of another dtype."""
    if mask is None:
        return None, None
    mask = jnp.asarray(mask)
    if mask.dtype == jnp.bool_:
        return mask, None
    if not jnp.issubdtype(mask.dtype, jnp.floating):
        raise ValueError(
            f"{where}: mask must be boolean (True = attend) or floating (added), got {mask.dtype}"
        )
    # -inf entries are masked keys: moving them to the boolean part keeps fully masked rows
    # detectable (and the softmax finite) on every path.
    keep = ~jnp.isneginf(mask)
    return keep, jnp.where(keep, mask, 0.0)


def mask_kind(mask) -> str | None:
    """What a mask asks of a kernel (``kernel_choice.MASK_KINDS``): None, ``"key_padding"``
    (booleans broadcastable from ``[batch, 1, 1, S]``), ``"boolean"`` or ``"additive"``."""
    if mask is None:
        return None
    if jnp.result_type(mask) != jnp.bool_:
        return "additive"
    shape = (1,) * (4 - jnp.ndim(mask)) + tuple(jnp.shape(mask))
    return "key_padding" if shape[1] == 1 and shape[2] == 1 else "boolean"


def as_4d(mask):
    """A mask part of rank <= 4 -> rank 4 ``[batch, heads, L, S]`` with leading singleton axes
    added (``None`` stays ``None``)."""
    return None if mask is None else jnp.reshape(mask, (1,) * (4 - mask.ndim) + mask.shape)


def pad_axis(x, axis: int, size: int, value=0):
    """``x`` padded with ``value`` to ``size`` along ``axis``; None, a singleton (broadcast) axis
    and an axis already that long stay as they are."""
    if x is None or x.shape[axis] in (1, size):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def large_negative(dtype):
    # Finite, so a row whose keys are all masked gives a uniform softmax, not NaN; those rows are
    # then zeroed explicitly. Same constant as jax.nn.dot_product_attention uses.
    return jnp.asarray(-0.7 * float(jnp.finfo(jnp.float32).max), dtype=dtype)


def check_mask_shape(mask, target: tuple, where: str):
    if mask is None:
        return
    shape = jnp.shape(mask)
    try:
        broadcast = np.broadcast_shapes(shape, target)
    except ValueError:
        broadcast = None
    if broadcast != tuple(target) or len(shape) > len(target):
        raise ValueError(f"{where}: mask of shape {shape} does not broadcast to {tuple(target)}")
