"""attnjax/ops/splash.py: the Pallas TPU splash kernel, run by Pallas' interpreter on CPU, gives
the explicit path's values and gradients (float32, 1e-5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close

from attnjax.ops import attention, splash


def _value_and_grads(implementation, q, k, v, mask, is_causal):
    def loss(q, k, v):
        out = attention.dot_product_attention(
            q, k, v, mask, is_causal=is_causal, implementation=implementation
        )
        return jnp.sum(jnp.sin(out)), out

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)


@pytest.mark.parametrize(
    "length, key_length, is_causal, padded",
    [
        # Causal with a key-padding mask; 150 tokens pad to 256 (two 128-row tiles); the second
        # example masks every key, so its rows must be zeros with finite gradients.
        (150, 150, True, True),
        # Cross attention, lengths of different tiles (130 -> 256, 300 -> 384), padded keys only.
        (130, 300, False, False),
    ],
)
def test_interpreted_kernel_matches_explicit_path(length, key_length, is_causal, padded):
    rng = np.random.default_rng(length)
    q = rng.standard_normal((2, length, 2, 32)).astype(np.float32)
    k, v = (rng.standard_normal((2, key_length, 2, 32)).astype(np.float32) for _ in range(2))
    mask = None
    if padded:
        mask = np.ones((2, 1, 1, key_length), bool)
        mask[0, ..., 100:] = False
        mask[1] = False
    (loss, out), grads = _value_and_grads("splash", q, k, v, mask, is_causal)
    (ref_loss, ref_out), ref_grads = _value_and_grads("explicit", q, k, v, mask, is_causal)
    assert_close(out, ref_out, rtol=1e-5, atol=1e-6, what="splash output")
    for name, ours, ref in zip("qkv", grads, ref_grads):
        assert np.all(np.isfinite(ours)), f"d{name} not finite"
        assert_close(ours, ref, rtol=1e-5, atol=1e-6, what=f"splash d{name}")
    if padded:
        np.testing.assert_array_equal(np.asarray(out[1]), 0.0)


def test_tiles_pad_the_least():
    assert splash.tile_for(197) == (256, 256)  # 256 pads as little as 128 does: the larger
    assert splash.tile_for(600) == (640, 128)
    assert splash.tile_for(1024) == (1024, 512)
    assert splash.tile_for(4100) == (4224, 128)


def test_requested_where_it_cannot_serve_raises():
    q = np.zeros((1, 8, 2, 4), np.float32)
    with pytest.raises(ValueError, match=r"implementation='splash'.*mask shape \(8, 8\)"):
        attention.dot_product_attention(
            q, q, q, np.zeros((8, 8), np.float32), implementation="splash"
        )
    with pytest.raises(ValueError, match=r"value \(1, 8, 2, 6\)"):
        attention.dot_product_attention(q, q, np.zeros((1, 8, 2, 6)), implementation="splash")
