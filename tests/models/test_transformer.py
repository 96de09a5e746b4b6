"""Properties of attnjax.models.transformer that need no PyTorch: masks, layout, dropout, bad
input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close

from attnjax.models.transformer import (
    Transformer,
    TransformerDecoder,
    TransformerEncoder,
    TransformerEncoderLayer,
)
from attnjax.ops.masks import padding_mask

SMALL = dict(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0)


def _init(module, *inputs):
    return module.init(jax.random.PRNGKey(0), *inputs)


def test_padded_tokens_do_not_reach_real_ones(np_rng):
    encoder = TransformerEncoder(**SMALL, num_layers=2, final_norm=True)
    src = np_rng.standard_normal((2, 5, 8)).astype(np.float32)
    variables = _init(encoder, src)
    mask = padding_mask(jnp.array([5, 3]), 5)[:, None, None, :]
    changed = src.copy()
    changed[1, 3:] = 100.0
    apply = jax.jit(encoder.apply)
    out, out_changed = (apply(variables, x, mask) for x in (src, changed))
    assert_close(out_changed[1, :3], out[1, :3], what="real tokens with other padding")
    assert_close(out_changed[0], out[0], what="unpadded sequence")
    assert not np.allclose(out_changed[1, 3:], out[1, 3:])


def test_causal_decoder_ignores_future_targets(np_rng):
    decoder = TransformerDecoder(**SMALL, num_layers=2, norm_first=True)
    tgt = np_rng.standard_normal((2, 4, 8)).astype(np.float32)
    memory = np_rng.standard_normal((2, 6, 8)).astype(np.float32)
    variables = _init(decoder, tgt, memory)
    changed = tgt.copy()
    changed[:, 2:] = -7.0
    apply = jax.jit(lambda v, x: decoder.apply(v, x, memory, tgt_is_causal=True))
    out, out_changed = (apply(variables, x) for x in (tgt, changed))
    assert_close(out_changed[:, :2], out[:, :2], what="positions before the change")
    assert not np.allclose(out_changed[:, 2:], out[:, 2:])


def test_post_norm_rows_are_normalised_and_layouts_agree(np_rng):
    model = Transformer(**SMALL, num_encoder_layers=1, num_decoder_layers=1)
    src = np_rng.standard_normal((3, 5, 8)).astype(np.float32)
    tgt = np_rng.standard_normal((3, 4, 8)).astype(np.float32)
    variables = _init(model, src, tgt)
    out = np.asarray(model.apply(variables, src, tgt))
    # the decoder's final LayerNorm at init (scale 1, bias 0): zero mean, unit variance per token
    assert_close(out.mean(-1), np.zeros(out.shape[:2]), atol=1e-5, what="row means")
    assert_close(out.var(-1), np.ones(out.shape[:2]), rtol=1e-3, what="row variances")
    sequence_first = Transformer(
        **SMALL, num_encoder_layers=1, num_decoder_layers=1, batch_first=False
    )
    swapped = sequence_first.apply(variables, src.swapaxes(0, 1), tgt.swapaxes(0, 1))
    assert_close(np.asarray(swapped).swapaxes(0, 1), out, what="batch_first=False output")


def test_dropout_runs_only_when_not_deterministic(np_rng):
    layer = TransformerEncoderLayer(**{**SMALL, "dropout": 0.5})
    src = np_rng.standard_normal((2, 5, 8)).astype(np.float32)
    variables = _init(layer, src)
    quiet = layer.apply(variables, src)
    assert_close(layer.apply(variables, src, deterministic=True), quiet, what="deterministic")
    noisy = layer.apply(
        variables, src, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)}
    )
    assert not np.allclose(noisy, quiet)


@pytest.mark.parametrize(
    "module, shape, message",
    [
        (
            TransformerEncoderLayer(**{**SMALL, "activation": "silu"}),
            (2, 5, 8),
            "activation='silu'",
        ),
        (TransformerEncoderLayer(**{**SMALL, "nhead": 3}), (2, 5, 8), "nhead=3 does not divide"),
        (TransformerEncoderLayer(**SMALL), (2, 5, 6), r"src must be \[batch, length, d_model\]"),
        (TransformerEncoder(**SMALL, batch_first=False), (5, 8), r"\[length, batch, d_model\]"),
    ],
)
def test_bad_configuration_or_input_raises(module, shape, message):
    with pytest.raises(ValueError, match=message):
        _init(module, jnp.zeros(shape))
