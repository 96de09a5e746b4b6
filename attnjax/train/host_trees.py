"""A tree of host arrays as the bytes of one file and back, the arrays' bytes out of band: what
``executables`` keeps of an initialisation's outputs, and which values it can keep."""

from __future__ import annotations

import pickle

import jax
import numpy as np


def pack(tree) -> list:
    """``tree`` of host arrays as the parts of one entry: its pickle with the arrays' bytes out of
    band, after it, so that reading it back copies them once (ViT-B/16's 343 MB of parameters:
    0.2 s less than an in-band pickle); the arrays' own memory, written without a copy."""
    buffers = []
    head = pickle.dumps(tree, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    index = pickle.dumps((len(head), [raw.nbytes for raw in raws]), protocol=5)
    return [len(index).to_bytes(8, "little"), index, head, *raws]


def unpack(entry: bytearray):
    view = memoryview(entry)
    start = 8 + int.from_bytes(view[:8], "little")
    head_size, sizes = pickle.loads(view[8:start])
    head, offset = view[start : start + head_size], start + head_size
    buffers = []
    for size in sizes:
        buffers.append(view[offset : offset + size])
        offset += size
    if offset != len(entry):
        raise ValueError(f"{len(entry)} bytes where the index says {offset}")
    return pickle.loads(head, buffers=buffers)


def on_default_device(x) -> bool:
    """A host value, or a jax array left where JAX put it (uncommitted: on the default device),
    of a plain dtype: what ``memoized`` can digest and put back in the same place."""
    if isinstance(x, jax.core.Tracer):
        return False
    if isinstance(x, jax.Array):
        return not x.committed and len(x.sharding.device_set) == 1 and plain_array(x)
    return isinstance(x, (int, float, bool)) or (
        isinstance(x, (np.ndarray, np.generic))
        and x.dtype.kind in "biufc"  # bytes that mean values
    )


def plain_array(x) -> bool:
    return isinstance(x, (np.ndarray, np.generic, jax.Array)) and not jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.extended
    )
