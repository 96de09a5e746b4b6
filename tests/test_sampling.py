"""attnjax/sampling.py: the cached sampler against full recompute and the model's own forward pass."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

from attnjax import prior, sampling

VOCAB, BLOCK = 37, 24  # 32 codes, 4 classes, a null token


@pytest.fixture(scope="module")
def gpt():
    """A small GPT whose every parameter is random (minGPT's init leaves pos_emb, the LayerNorms
    and the biases constant, which would let a wrong position or norm go unnoticed)."""
    model = prior.GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32)
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
    tokens, logits = sampling.sample(model, params, prefix, rng, 20, num_codes=32,
                                     return_logits=True, **settings)
    ref_tokens, ref_logits = sampling.sample_recompute(model, params, prefix, rng, 20, num_codes=32,
                                                       return_logits=True, **settings)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(ref_tokens))
    # Cache and recompute sum in different orders; guidance scales that float32 rounding by w.
    assert_close(logits, ref_logits, atol=1e-5, what="logits along the cached sampling")
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
    np.testing.assert_array_equal(np.asarray(sampling.filter_logits(logits, top_k=2))[0, :2],
                                  np.asarray(logits)[0, :2])


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
    with pytest.raises(ValueError, match=r"null_prefix shape \(2, 2\) must equal prefix shape \(2, 1\)"):
        sampling.sample_recompute(model, params, prefix, jax.random.key(0), 4, guidance=2.0,
                                  null_prefix=jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"prefix must be \[batch, p\]"):
        sampling.sample(model, params, jnp.zeros((2,), jnp.int32), jax.random.key(0), 4)
