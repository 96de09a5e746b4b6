"""``config.compute_dtype``: the dtype a model computes in, parameters staying float32.

``"float32"`` (the default) or ``"bfloat16"``. With bfloat16, matrix products and activations
run in bf16 while parameters, optimiser state, gradients' accumulation into the parameters, the
losses and softmax/LayerNorm statistics stay float32 (flax's LayerNorm computes its statistics
in float32; losses cast logits to float32 first).
"""

from __future__ import annotations

import jax.numpy as jnp

COMPUTE_DTYPES = {"float32": None, "bfloat16": jnp.bfloat16}


def compute_dtype(config):
    """``config.compute_dtype`` as a model's ``dtype`` field: None (the input's, float32) or
    ``jnp.bfloat16``."""
    name = config.get("compute_dtype", "float32")
    if name not in COMPUTE_DTYPES:
        raise ValueError(
            f"config.compute_dtype={name!r} is not supported; expected one of "
            f"{sorted(COMPUTE_DTYPES)}."
        )
    return COMPUTE_DTYPES[name]
