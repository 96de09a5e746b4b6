"""Pallas splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) behind
``attention.dot_product_attention``'s semantics, for TPU programs.

The kernel takes one example's ``[heads, length, head_dim]`` and a static mask; this wrapper

* scales the query (the kernel does not), pads both lengths to a multiple of the tile, and marks
  the padded keys, and the keys a key-padding mask removes, with segment ids that never match the
  queries' (segment ids are the kernel's only per-example mask);
* passes ``is_causal`` as the kernel's static causal mask (top-left aligned, as PyTorch's), whose
  tiles above the diagonal it skips;
* maps over the batch, inside a ``shard_map`` over the batch axis when a mesh is set for tracing
  (``jax.sharding.use_abstract_mesh``; the training loop sets it): a Mosaic kernel cannot be
  partitioned by XLA, so each device runs it on its own slice of the batch.

Rows whose keys are all masked come out finite here; the caller zeroes them, as on every path.
On CPU the same kernel runs in Pallas' interpreter (``interpret=True``): slow, for tests.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# The kernel's tiles are multiples of the TPU's 128 lanes; 512 is the largest tried (MaxText's
# default), smaller ones are taken when they pad a length less.
TILES = (512, 256, 128)
LANES = 128


def tile_for(length: int) -> tuple[int, int]:
    """``length`` -> (padded length, tile): the tile of ``TILES`` that pads the least, the
    larger on a tie."""
    return min(((-(-length // t) * t, t) for t in TILES), key=lambda pt: (pt[0], -pt[1]))


def _batch_axes():
    """``(axes, devices)`` of the context mesh when it has more than one device, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    devices = 1 if mesh.empty else math.prod(mesh.axis_sizes)
    return None if devices == 1 else (tuple(mesh.axis_names), devices)


def serves(batch: int, head_dim: int, value_dim: int, mask_kind: str | None) -> bool:
    """Whether the kernel can take a call: no mask or a key-padding mask (no float mask, no
    per-query mask), ``Ev == E``, and a batch that divides over the context mesh."""
    if mask_kind not in (None, "key_padding") or head_dim != value_dim:
        return False
    mesh = _batch_axes()
    return mesh is None or batch % mesh[1] == 0


def splash_attention(
    query, key, value, key_valid=None, *, is_causal: bool, scale: float, interpret: bool = False
):
    """``[batch, L, heads, E]`` x ``[batch, S, heads, E]`` x ``[batch, S, heads, E]`` ->
    ``[batch, L, heads, E]``; ``key_valid``: ``[batch or 1, S]`` booleans (False = masked key)
    or None."""
    # Imported here: Pallas takes half a second to import, and most programs never need it.
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    batch, length, heads, _ = query.shape
    key_length = key.shape[1]
    padded_length, query_tile = tile_for(length)
    padded_keys, key_tile = tile_for(key_length)
    shape = (padded_length, padded_keys)
    one_head = masks.CausalMask(shape) if is_causal else masks.FullMask(shape)
    tiles = kernel.BlockSizes(
        block_q=query_tile,
        block_kv=key_tile,
        block_kv_compute=key_tile,
        block_q_dkv=query_tile,
        block_kv_dkv=key_tile,
        block_kv_dkv_compute=key_tile,
        block_q_dq=query_tile,
        block_kv_dq=key_tile,
    )
    splash = kernel.make_splash_mha_single_device(
        masks.MultiHeadMask([one_head] * heads), block_sizes=tiles, interpret=interpret
    )

    def heads_first(x, size):
        x = jnp.swapaxes(x, 1, 2)
        return jnp.pad(x, ((0, 0), (0, 0), (0, size - x.shape[2]), (0, 0)))

    q = heads_first(query * jnp.asarray(scale, query.dtype), padded_length)
    k, v = heads_first(key, padded_keys), heads_first(value, padded_keys)
    segments = None
    if key_valid is not None or padded_keys != key_length:
        valid = jnp.ones((1, key_length), bool) if key_valid is None else key_valid
        valid = jnp.pad(
            jnp.broadcast_to(valid, (batch, key_length)), ((0, 0), (0, padded_keys - key_length))
        )
        segments = kernel.SegmentIds(
            q=jnp.ones((batch, padded_length), jnp.int32), kv=valid.astype(jnp.int32)
        )

    def per_example(q, k, v, segments):
        return jax.vmap(lambda q, k, v, s: splash(q, k, v, segment_ids=s))(q, k, v, segments)

    mesh = _batch_axes()
    if mesh is not None:
        spec = jax.sharding.PartitionSpec(mesh[0])
        per_example = jax.shard_map(per_example, in_specs=spec, out_specs=spec, check_vma=False)
    out = per_example(q, k, v, segments)
    return jnp.swapaxes(out[:, :, :length], 1, 2)
