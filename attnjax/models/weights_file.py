"""Converted weights as one ``.npz`` of ``/``-joined variable paths (``params/net/conv/kernel``),
float32, read back only after every array and shape is checked against the model's own tree.

The LPIPS and Inception converters write these files once (torch present); training and
evaluation read them without torch.
"""

from __future__ import annotations

import os

import flax
import jax
import jax.numpy as jnp
import numpy as np


def save_variables(variables, path) -> str:
    """Writes ``variables`` to ``path`` (.npz) as float32 arrays under ``/``-joined keys."""
    flat = flax.traverse_util.flatten_dict(jax.device_get(variables), sep="/")
    path = os.fspath(path)
    np.savez(path, **{key: np.asarray(value, np.float32) for key, value in flat.items()})
    return path


def load_variables(path, expected, *, what: str, command: str) -> dict:
    """Reads what ``save_variables`` wrote, checked against ``expected`` (the model's variables
    or their ``jax.eval_shape``): a missing file raises FileNotFoundError naming ``command``
    (the converter that writes it), any other bad file a one-line ValueError naming ``path``."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what}: no file {path!r} (convert them once with {command})")
    try:
        with np.load(path, allow_pickle=False) as arrays:
            flat = {key: arrays[key] for key in arrays.files}
    except (OSError, ValueError, EOFError) as error:
        raise ValueError(f"{what} {path!r}: not a readable .npz ({error})") from None
    expected = flax.traverse_util.flatten_dict(expected, sep="/")
    missing, unexpected = sorted(set(expected) - set(flat)), sorted(set(flat) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{what} {path!r}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    for key, spec in expected.items():
        if flat[key].shape != spec.shape:
            raise ValueError(
                f"{what} {path!r}: {key} has shape {flat[key].shape}, expected {spec.shape}"
            )
    return flax.traverse_util.unflatten_dict(
        {key: jnp.asarray(value, jnp.float32) for key, value in flat.items()}, sep="/"
    )
