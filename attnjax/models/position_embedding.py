"""A learned position embedding (the ViT's ``pos_embedding``), added to the token sequence."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax.numpy as jnp


class LearnedPositionEmbedding(nn.Module):
    """Adds a learned embedding ``pos_embedding [1, length, dim]`` to
    ``inputs [batch, length, dim]``.

    The parameter's shape is taken from the inputs at ``init``; later inputs must match it (use
    ``resize_position_embedding`` on the parameter to change a ViT's grid).
    """

    posemb_init: Callable = nn.initializers.normal(stddev=0.02)
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, inputs):
        if jnp.ndim(inputs) != 3:
            raise ValueError(
                "LearnedPositionEmbedding: inputs must be [batch, length, dim], "
                f"got {jnp.shape(inputs)}"
            )
        shape = (1,) + tuple(inputs.shape[1:])
        if self.has_variable("params", "pos_embedding"):
            stored = self.get_variable("params", "pos_embedding").shape
            if tuple(stored) != shape:
                raise ValueError(
                    f"LearnedPositionEmbedding: inputs of shape {inputs.shape} do not match "
                    f"pos_embedding {tuple(stored)}"
                )
        pos_embedding = self.param("pos_embedding", self.posemb_init, shape, self.param_dtype)
        return inputs + pos_embedding.astype(inputs.dtype)
