"""attnjax/prior.py against taming's minGPT, and the cached sampler against full recompute."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import assert_close

from attnjax import prior, torch_interop
from taming.modules.transformer import mingpt


def _taming_gpt(seed=0, vocab_size=37, block_size=24, n_layer=2, n_head=4, n_embd=32):
    torch.manual_seed(seed)
    model = mingpt.GPT(vocab_size, block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd).eval()
    with torch.no_grad():
        # minGPT initialises pos_emb to zeros, LayerNorms to (1, 0) and biases to 0: randomise
        # them all so every converted tensor matters.
        for name, tensor in model.named_parameters():
            if name == "pos_emb" or name.endswith("bias") or ".ln" in name or name.startswith("ln_f"):
                tensor.add_(0.1 * torch.randn_like(tensor))
    return model


@pytest.fixture(scope="module")
def converted():
    torch_model = _taming_gpt()
    model, variables = torch_interop.gpt_from_taming(torch_model.state_dict(), n_head=4)
    return torch_model, model, variables


def test_gpt_matches_taming_mingpt(converted):
    torch_model, model, variables = converted
    indices = np.random.default_rng(0).integers(0, 37, size=(3, 24))
    with torch.no_grad():
        expected, _ = torch_model(torch.from_numpy(indices))
    actual = model.apply(variables, jnp.asarray(indices))
    assert_close(actual, expected.numpy(), what="GPT logits vs taming minGPT")
    # Shorter sequences use the first positions of pos_emb, as taming slices pos_emb[:, :t].
    with torch.no_grad():
        expected_short, _ = torch_model(torch.from_numpy(indices[:, :5]))
    assert_close(model.apply(variables, jnp.asarray(indices[:, :5])), expected_short.numpy(),
                 what="GPT logits on a 5-token prefix")


def test_gpt_from_taming_reads_the_architecture(converted):
    _, model, variables = converted
    assert (model.vocab_size, model.block_size, model.n_layer, model.n_embd) == (37, 24, 2, 32)
    own = prior.GPT(vocab_size=37, block_size=24, n_layer=2, n_head=4, n_embd=32)
    own_shapes = jax.tree.map(jnp.shape, own.init(jax.random.key(0), jnp.zeros((1, 24), jnp.int32)))
    assert jax.tree.map(jnp.shape, variables) == own_shapes


def test_training_objective_matches_net2net(converted):
    """Class prefix + codes: our loss equals taming's Net2NetTransformer.forward + cross-entropy."""
    torch_model, model, variables = converted
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 32, size=(4, 24))
    prefix = np.array(prior.prefix_tokens(np.array([0, 1, 2, 4]), 32, 5))
    logits = prior.sequence_logits(model, variables["params"], jnp.asarray(codes), prefix)
    nll = prior.cross_entropy(logits, jnp.asarray(codes))
    with torch.no_grad():  # Net2NetTransformer.forward with pkeep=1, spelled out
        cz = torch.cat([torch.from_numpy(prefix).long(), torch.from_numpy(codes)], dim=1)
        torch_logits, _ = torch_model(cz[:, :-1])
        torch_logits = torch_logits[:, prefix.shape[1] - 1 :]
        torch_nll = torch.nn.functional.cross_entropy(
            torch_logits.reshape(-1, 37), torch.from_numpy(codes).reshape(-1)
        )
    assert_close(logits, torch_logits.numpy(), what="sequence logits")
    assert_close(nll, torch_nll.item(), what="cross-entropy")


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=1.0),
        dict(temperature=0.8, top_k=5),
        dict(temperature=1.3, top_p=0.7),
        dict(temperature=0.0),
    ],
    ids=["plain", "top_k", "top_p", "greedy"],
)
def test_cached_sampling_equals_full_recompute(converted, settings):
    _, model, variables = converted
    params = variables["params"]
    prefix = jnp.array([[33, 3], [34, 7], [35, 1]], jnp.int32)
    rng = jax.random.key(7)
    tokens, logits = prior.sample(model, params, prefix, rng, 20, num_codes=32, return_logits=True,
                                  **settings)
    ref_tokens, ref_logits = prior.sample_recompute(model, params, prefix, rng, 20, num_codes=32,
                                                    return_logits=True, **settings)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(ref_tokens))
    assert_close(logits, ref_logits, what="logits along the cached sampling")
    assert tokens.shape == (3, 20) and int(tokens.max()) < 32
    # And the logits are the model's: a plain forward pass over the sampled sequence.
    full = model.apply(variables, jnp.concatenate([prefix, tokens[:, :-1]], axis=1))
    assert_close(logits, full[:, 1:], what="sampler logits vs forward pass")


def test_sampling_is_determined_by_the_key(converted):
    _, model, variables = converted
    prefix = jnp.full((64, 1), 33, jnp.int32)
    first = prior.sample(model, variables["params"], prefix, jax.random.key(1), 8, num_codes=32)
    again = prior.sample(model, variables["params"], prefix, jax.random.key(1), 8, num_codes=32)
    other = prior.sample(model, variables["params"], prefix, jax.random.key(2), 8, num_codes=32)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    assert not np.array_equal(np.asarray(first), np.asarray(other))
    assert len({tuple(row) for row in np.asarray(first)}) > 1, "batch rows must draw independently"


def test_filter_logits_top_k_and_top_p():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = lambda x: np.isfinite(np.asarray(x))[0].tolist()  # noqa: E731
    assert kept(prior.filter_logits(logits, top_k=2)) == [True, True, False, False, False]
    # 0.5 < 0.6, 0.5 + 0.2 crosses 0.6: the crossing token is kept.
    assert kept(prior.filter_logits(logits, top_p=0.6)) == [True, True, False, False, False]
    assert kept(prior.filter_logits(logits, top_p=0.4)) == [True, False, False, False, False]
    assert kept(prior.filter_logits(logits, num_codes=3)) == [True, True, True, False, False]


def test_bad_sampling_arguments_raise(converted):
    _, model, variables = converted
    prefix = jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ValueError, match="block_size=24"):
        prior.sample(model, variables["params"], prefix, jax.random.key(0), 25)
    with pytest.raises(ValueError, match="top_k"):
        prior.sample(model, variables["params"], prefix, jax.random.key(0), 4, top_k=0)
    with pytest.raises(ValueError, match="top_p"):
        prior.sample(model, variables["params"], prefix, jax.random.key(0), 4, top_p=1.5)
    with pytest.raises(ValueError, match="indices must be"):
        model.apply(variables, jnp.zeros((24,), jnp.int32))
