"""Group normalisation of channels-last maps ``[batch, ..., channels]`` (Wu and He 2018), with
PyTorch's ``nn.GroupNorm`` semantics: ``channels // groups`` consecutive channels share a mean and
a two-pass variance (the mean subtracted first), taken over every position; then a per-channel
``scale`` and ``bias``. Flax's ``nn.GroupNorm(use_fast_variance=False)`` computes the same with
the same parameter names, and either module loads the other's weights.

Each statistic is summed in two steps, over the positions first (``[batch, channels]``) and then
over a group's channels, where Flax reduces both at once. The values differ only in float32
rounding; the time does not: XLA:CPU hands reductions to YNNPACK (``attnjax.xla_cpu``), which is
fast on the first kind and several times slower on the joint one
(``python benchmarks/group_norm.py``, benchmarks/results/group_norm.md).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def group_norm(x: Array, scale: Array, bias: Array, groups: int, epsilon: float) -> Array:
    """``[batch, ..., channels]`` -> the same shape, float32 or wider: ``x`` normalised per sample
    and group of ``channels // groups`` channels, then ``* scale + bias`` (``[channels]``)."""
    batch, channels = x.shape[0], x.shape[-1]
    if channels % groups:
        raise ValueError(f"group_norm: {channels} channels do not split into {groups} groups")
    per_group = channels // groups
    flat = x.astype(jnp.promote_types(x.dtype, jnp.float32)).reshape(batch, -1, channels)
    count = flat.shape[1] * per_group

    def group_mean(values):  # [batch, positions, channels] -> [batch, 1, channels]
        per_channel = jnp.sum(values, axis=1)
        means = jnp.sum(per_channel.reshape(batch, groups, per_group), axis=-1) / count
        return jnp.repeat(means, per_group, axis=-1)[:, None, :]

    centred = flat - group_mean(flat)
    variance = group_mean(centred * centred)
    return (centred * (jax.lax.rsqrt(variance + epsilon) * scale) + bias).reshape(x.shape)


class GroupNorm(nn.Module):
    """``group_norm`` with learned ``scale`` (ones) and ``bias`` (zeros) of ``[channels]``: the
    result has ``dtype``, or the promotion of the input's and the parameters' dtypes; the
    statistics are float32 whatever the input's dtype."""

    num_groups: int = 32
    epsilon: float = 1e-5
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        channels = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (channels,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (channels,), self.param_dtype)
        y = group_norm(x, scale, bias, self.num_groups, self.epsilon)
        return y.astype(self.dtype or jnp.result_type(x, scale, bias))
