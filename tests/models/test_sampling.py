"""attnjax/sampling.py: the cached sampler against full recompute and the model's own forward
pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close

from attnjax.models import sampling
from attnjax.models.gpt import GPT

VOCAB, BLOCK = 37, 24  # 32 codes, 4 classes, a null token


@pytest.fixture(scope="module")
def gpt():
    """A small GPT whose every parameter is random (minGPT's init leaves pos_emb, the LayerNorms
    and the biases constant, which would let a wrong position or norm go unnoticed)."""
    model = GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, BLOCK), jnp.int32))["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noisy = [leaf + 0.1 * jax.random.normal(k, leaf.shape) for leaf, k in zip(leaves, keys)]
    return model, jax.tree.unflatten(tree, noisy)


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.8, top_k=5),
        dict(temperature=1.3, top_p=0.7),
        dict(temperature=0.0),
        dict(temperature=0.9, top_k=8, guidance=2.5, null_prefix=[[36, 0], [36, 0], [36, 0]]),
    ],
    ids=["top_k", "top_p", "greedy", "guided"],
)
def test_cached_sampling_equals_full_recompute(gpt, settings):
    model, params = gpt
    prefix = jnp.array([[33, 3], [34, 7], [35, 1]], jnp.int32)
    rng = jax.random.key(7)
    tokens, logits = sampling.sample(
        model, params, prefix, rng, 20, num_codes=32, return_logits=True, **settings
    )
    ref_tokens, ref_logits = sampling.sample_recompute(
        model, params, prefix, rng, 20, num_codes=32, return_logits=True, **settings
    )
    # Cache and recompute sum in different orders; guidance scales that float32 rounding by w.
    # A draw between two nearly equal candidates may go either way on that rounding: each row's
    # tokens are equal up to its first difference, and the logits up to and at it (a row drawn
    # differently is then conditioned differently).
    for row, (got, expected) in enumerate(zip(np.asarray(tokens), np.asarray(ref_tokens))):
        differ = np.flatnonzero(got != expected)
        upto = int(differ[0]) + 1 if differ.size else len(got)
        assert_close(
            logits[row, :upto], ref_logits[row, :upto], atol=1e-5, what=f"row {row} logits"
        )
    assert np.mean(np.asarray(tokens) == np.asarray(ref_tokens)) > 0.9
    assert tokens.shape == (3, 20) and int(tokens.max()) < 32
    # And the logits are the model's: a plain forward pass over the sampled sequence.
    forward = jax.jit(model.apply)
    variables = {"params": params}
    full = forward(variables, jnp.concatenate([prefix, tokens[:, :-1]], axis=1))[:, 1:]
    if "guidance" in settings:
        null = jnp.asarray(settings["null_prefix"], jnp.int32)
        unconditional = forward(variables, jnp.concatenate([null, tokens[:, :-1]], axis=1))[:, 1:]
        full = unconditional + settings["guidance"] * (full - unconditional)
    assert_close(logits, full, rtol=1e-4, atol=1e-5, what="sampler logits vs forward pass")
    if settings["temperature"] == 0.0:
        np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(full)[..., :32], -1))


def test_sampling_is_determined_by_the_key(gpt):
    model, params = gpt
    prefix = jnp.full((64, 1), 33, jnp.int32)
    first = sampling.sample(model, params, prefix, jax.random.key(1), 8, num_codes=32)
    again = sampling.sample(model, params, prefix, jax.random.key(1), 8, num_codes=32)
    other = sampling.sample(model, params, prefix, jax.random.key(2), 8, num_codes=32)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    assert not np.array_equal(np.asarray(first), np.asarray(other))
    assert len({tuple(row) for row in np.asarray(first)}) > 1, "batch rows must draw independently"


def test_filter_logits_top_k_and_top_p():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = lambda x: np.isfinite(np.asarray(x))[0].tolist()  # noqa: E731
    assert kept(sampling.filter_logits(logits, top_k=2)) == [True, True, False, False, False]
    # 0.5 < 0.6, 0.5 + 0.2 crosses 0.6: the crossing token is kept.
    assert kept(sampling.filter_logits(logits, top_p=0.6)) == [True, True, False, False, False]
    assert kept(sampling.filter_logits(logits, top_p=0.4)) == [True, False, False, False, False]
    assert kept(sampling.filter_logits(logits, num_codes=3)) == [True, True, True, False, False]
    # Kept logits keep their values: the filter masks, it does not renormalise.
    np.testing.assert_array_equal(
        np.asarray(sampling.filter_logits(logits, top_k=2))[0, :2], np.asarray(logits)[0, :2]
    )


def test_sampling_settings_check_and_normalise():
    settings = sampling.SamplingSettings(temperature=1, top_p=1, guidance=2).check(VOCAB)
    assert settings == sampling.SamplingSettings(1.0, None, 1.0, None, 2.0)
    assert isinstance(settings.temperature, float) and isinstance(settings.guidance, float)
    hash(settings)  # a static jit argument must be hashable
    with pytest.raises(ValueError, match=r"num_codes must be in \[1, 37\]"):
        sampling.SamplingSettings(num_codes=40).check(VOCAB)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        sampling.SamplingSettings(temperature=-1.0).check(VOCAB)


def test_bad_sampling_arguments_raise(gpt):
    model, params = gpt
    prefix = jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ValueError, match="block_size=24"):
        sampling.sample(model, params, prefix, jax.random.key(0), 25)
    with pytest.raises(ValueError, match="top_k"):
        sampling.sample(model, params, prefix, jax.random.key(0), 4, top_k=0)
    with pytest.raises(ValueError, match="top_p"):
        sampling.sample(model, params, prefix, jax.random.key(0), 4, top_p=1.5)
    with pytest.raises(ValueError, match="null_prefix"):
        sampling.sample(model, params, prefix, jax.random.key(0), 4, guidance=2.0)
    with pytest.raises(
        ValueError, match=r"null_prefix shape \(2, 2\) must equal prefix shape \(2, 1\)"
    ):
        sampling.sample_recompute(
            model,
            params,
            prefix,
            jax.random.key(0),
            4,
            guidance=2.0,
            null_prefix=jnp.zeros((2, 2), jnp.int32),
        )
    with pytest.raises(ValueError, match=r"prefix must be \[batch, p\]"):
        sampling.sample(model, params, jnp.zeros((2,), jnp.int32), jax.random.key(0), 4)


# ---- taming's sampling modes: sliding window and completion against a per-token recompute ----

WINDOW = (4, 6)  # the trained grid of the fixture: 24 codes, block_size 24 with one prefix token


def _taming_local(position, grid, window):
    """taming's ``sample_conditional.py`` rule, written as it is there (half = window // 2)."""
    half = window // 2
    if position <= half:
        return position
    if grid - position < half:
        return window - (grid - position)
    return half


def _reference_window_sampling(
    model,
    params,
    prefix,
    codes,
    start,
    rng,
    *,
    temperature=1.0,
    top_k=None,
    guidance=None,
    null_prefix=None,
    num_codes=32,
):
    """Full recompute per token, as taming does: the whole window through the model each time."""
    forward = jax.jit(model.apply)
    codes = np.array(codes, np.int32)
    height, width = codes.shape[1:]
    window_height, window_width = WINDOW
    for step, position in enumerate(range(start, height * width)):
        i, j = divmod(position, width)
        local_i, local_j = (
            _taming_local(i, height, window_height),
            _taming_local(j, width, window_width),
        )
        top, left = i - local_i, j - local_j
        window = codes[:, top : top + window_height, left : left + window_width].reshape(
            len(codes), -1
        )
        local = local_i * window_width + local_j

        def logits_for(first):
            sequence = np.concatenate([np.asarray(first), window[:, :-1]], axis=1)
            return forward({"params": params}, jnp.asarray(sequence))[
                :, prefix.shape[1] - 1 + local
            ]

        logits = logits_for(prefix)
        if guidance is not None:
            unconditional = logits_for(null_prefix)
            logits = unconditional + guidance * (logits - unconditional)
        logits = sampling.filter_logits(logits / temperature, num_codes=num_codes, top_k=top_k)
        token = jax.random.categorical(jax.random.fold_in(rng, step), logits, axis=-1)
        codes[:, i, j] = np.asarray(token)
    return codes


def test_window_schedule_is_taming_rule_and_refills_only_when_the_window_moves():
    for grid, window in [(9, 6), (6, 4), (16, 16), (32, 16), (40, 16)]:
        for position in range(grid):
            assert sampling.window_origin(position, grid, window) == position - _taming_local(
                position, grid, window
            )
    schedule = np.asarray(sampling.window_schedule((4, 6), (4, 6)))
    assert schedule[:, 4].tolist() == [1] + [0] * 23, "the trained grid is one cached pass"
    schedule = np.asarray(sampling.window_schedule((6, 9), WINDOW))
    # Row 3 of a 6x9 grid: window columns 0, 0, 0, 0 (cached run), then 1, 2, 3 (one per token).
    row = schedule[schedule[:, 0] == 3]
    assert row[:, 3].tolist() == [0, 0, 0, 0, 1, 2, 3, 3, 3]
    assert row[:, 4].tolist() == [1, 0, 0, 0, 1, 1, 1, 0, 0]


@pytest.mark.parametrize(
    "settings",
    [dict(temperature=0.9, top_k=6), dict(temperature=1.0, guidance=2.0)],
    ids=["top_k", "guided"],
)
def test_sliding_window_equals_taming_recompute(gpt, settings):
    model, params = gpt
    prefix = jnp.array([[33], [35]], jnp.int32)
    if "guidance" in settings:
        settings = dict(settings, null_prefix=jnp.full((2, 1), 36, jnp.int32))
    rng = jax.random.key(3)
    codes, logits = sampling.sample_window(
        model, params, prefix, rng, (6, 9), WINDOW, num_codes=32, return_logits=True, **settings
    )
    expected = _reference_window_sampling(
        model, params, prefix, np.zeros((2, 6, 9)), 0, rng, **settings
    )
    np.testing.assert_array_equal(np.asarray(codes), expected)
    assert logits.shape == (2, 54, VOCAB)
    assert len(np.unique(np.asarray(codes))) > 5


def test_sliding_window_on_the_trained_grid_is_plain_sampling(gpt):
    model, params = gpt
    prefix = jnp.array([[34], [33], [35]], jnp.int32)
    rng = jax.random.key(11)
    codes = sampling.sample_window(
        model, params, prefix, rng, WINDOW, WINDOW, num_codes=32, temperature=0.8, top_p=0.9
    )
    plain = sampling.sample(
        model, params, prefix, rng, 24, num_codes=32, temperature=0.8, top_p=0.9
    )
    np.testing.assert_array_equal(np.asarray(codes).reshape(3, -1), np.asarray(plain))


@pytest.mark.parametrize("grid", [WINDOW, (5, 8)], ids=["trained_grid", "larger_grid"])
def test_completion_keeps_rows_and_equals_recompute(gpt, grid):
    model, params = gpt
    real = jax.random.randint(jax.random.key(5), (2, *grid), 0, 32)
    prefix = jnp.array([[34], [33]], jnp.int32)
    null = jnp.full((2, 1), 36, jnp.int32)
    rng = jax.random.key(9)
    completed = sampling.complete(
        model,
        params,
        prefix,
        real,
        2,
        rng,
        window_shape=WINDOW,
        num_codes=32,
        temperature=1.1,
        guidance=1.5,
        null_prefix=null,
    )
    completed = np.asarray(completed)
    np.testing.assert_array_equal(completed[:, :2], np.asarray(real)[:, :2])
    assert not np.array_equal(completed[:, 2:], np.asarray(real)[:, 2:])
    expected = _reference_window_sampling(
        model,
        params,
        prefix,
        real,
        2 * grid[1],
        rng,
        temperature=1.1,
        guidance=1.5,
        null_prefix=null,
    )
    np.testing.assert_array_equal(completed, expected)
    if grid == WINDOW:  # and on the trained grid it continues the kept codes like ``sample``
        kept = jnp.concatenate([prefix, real[:, :2].reshape(2, -1)], axis=1)
        null_kept = jnp.concatenate([null, real[:, :2].reshape(2, -1)], axis=1)
        plain = sampling.sample(
            model,
            params,
            kept,
            rng,
            12,
            num_codes=32,
            temperature=1.1,
            guidance=1.5,
            null_prefix=null_kept,
        )
        np.testing.assert_array_equal(completed[:, 2:].reshape(2, -1), np.asarray(plain))


def test_bad_window_arguments_raise(gpt):
    model, params = gpt
    prefix = jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(
        ValueError, match=r"grid_shape \(3, 9\) must be at least the window_shape \(4, 6\)"
    ):
        sampling.sample_window(model, params, prefix, jax.random.key(0), (3, 9), WINDOW)
    with pytest.raises(ValueError, match=r"block_size=24"):
        sampling.sample_window(model, params, prefix, jax.random.key(0), (5, 7), (5, 7))
    with pytest.raises(ValueError, match="start=4 keeps codes, but codes is None"):
        sampling.sample_window(model, params, prefix, jax.random.key(0), WINDOW, WINDOW, start=4)
    with pytest.raises(ValueError, match=r"rows must be in \[1, 3\]"):
        sampling.complete(
            model, params, prefix, jnp.zeros((2, 4, 6), jnp.int32), 4, jax.random.key(0)
        )
