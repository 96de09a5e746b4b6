"""attnjax.models.gpt against taming's minGPT and net2net objective."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_close, assert_relative
from taming.modules.transformer import mingpt

from attnjax.convert.taming import gpt_from_taming
from attnjax.models import gpt


def _taming_gpt(seed=0, vocab_size=37, block_size=24, n_layer=2, n_head=4, n_embd=32):
    torch.manual_seed(seed)
    model = mingpt.GPT(vocab_size, block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd).eval()
    with torch.no_grad():
        # minGPT initialises pos_emb to zeros, LayerNorms to (1, 0) and biases to 0: randomise
        # them all so every converted tensor matters.
        for name, tensor in model.named_parameters():
            if (
                name == "pos_emb"
                or name.endswith("bias")
                or ".ln" in name
                or name.startswith("ln_f")
            ):
                tensor.add_(0.1 * torch.randn_like(tensor))
    return model


@pytest.fixture(scope="module")
def converted():
    torch_model = _taming_gpt()
    model, variables = gpt_from_taming(torch_model.state_dict(), n_head=4)
    return torch_model, model, variables


def test_gpt_matches_taming_mingpt(converted):
    torch_model, model, variables = converted
    indices = np.random.default_rng(0).integers(0, 37, size=(3, 24))
    with torch.no_grad():
        expected, _ = torch_model(torch.from_numpy(indices))
    apply = jax.jit(model.apply)
    actual = apply(variables, jnp.asarray(indices))
    assert_close(actual, expected.numpy(), what="GPT logits vs taming minGPT")
    # Shorter sequences use the first positions of pos_emb, as taming slices pos_emb[:, :t].
    with torch.no_grad():
        expected_short, _ = torch_model(torch.from_numpy(indices[:, :5]))
    assert_close(
        apply(variables, jnp.asarray(indices[:, :5])),
        expected_short.numpy(),
        what="GPT logits on a 5-token prefix",
    )


def test_gpt_from_taming_reads_the_architecture(converted):
    _, model, variables = converted
    assert (model.vocab_size, model.block_size, model.n_layer, model.n_embd) == (37, 24, 2, 32)
    own = gpt.GPT(vocab_size=37, block_size=24, n_layer=2, n_head=4, n_embd=32)
    own_shapes = jax.eval_shape(own.init, jax.random.key(0), jnp.zeros((1, 24), jnp.int32))
    chex.assert_trees_all_equal_shapes(variables, own_shapes)


def test_training_objective_matches_net2net(converted):
    """Class prefix + codes: our loss equals taming's Net2NetTransformer.forward + cross-entropy."""
    torch_model, model, variables = converted
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 32, size=(4, 24))
    prefix = np.array(gpt.prefix_tokens(np.array([0, 1, 2, 4]), 32, 5))
    logits = gpt.sequence_logits(model, variables["params"], jnp.asarray(codes), prefix)
    nll = gpt.cross_entropy(logits, jnp.asarray(codes))
    with torch.no_grad():  # Net2NetTransformer.forward with pkeep=1, spelled out
        cz = torch.cat([torch.from_numpy(prefix).long(), torch.from_numpy(codes)], dim=1)
        torch_logits, _ = torch_model(cz[:, :-1])
        torch_logits = torch_logits[:, prefix.shape[1] - 1 :]
        torch_nll = torch.nn.functional.cross_entropy(
            torch_logits.reshape(-1, 37), torch.from_numpy(codes).reshape(-1)
        )
    assert_close(logits, torch_logits.numpy(), what="sequence logits")
    assert_close(nll, torch_nll.item(), what="cross-entropy")


@pytest.mark.parametrize("remat", [False, True])
def test_training_gradients_match_net2net(converted, remat):
    """The objective's gradient against torch's backward, every block kept or recomputed."""
    torch_model, model, variables = converted
    model = model.clone(remat=remat)
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 32, size=(4, 24))
    prefix = np.array(gpt.prefix_tokens(np.array([3, 1, 0, 4]), 32, 5))

    def loss(params):
        logits = gpt.sequence_logits(model, params, jnp.asarray(codes), prefix)
        return gpt.cross_entropy(logits, jnp.asarray(codes))

    traced = jax.jit(jax.grad(loss)).trace(variables["params"])  # traced once for both
    assert str(traced.jaxpr).count("remat2[") == (2 if remat else 0)
    grads = traced.lower().compile()(variables["params"])
    torch_model.zero_grad()
    cz = torch.cat([torch.from_numpy(prefix).long(), torch.from_numpy(codes)], dim=1)
    torch_logits, _ = torch_model(cz[:, :-1])
    torch.nn.functional.cross_entropy(
        torch_logits[:, prefix.shape[1] - 1 :].reshape(-1, 37), torch.from_numpy(codes).reshape(-1)
    ).backward()
    torch_grads = dict(torch_model.named_parameters())
    for torch_name, ours in [
        ("tok_emb.weight", grads["tok_emb"]["embedding"]),
        ("pos_emb", grads["pos_emb"]),
        ("blocks.0.attn.query.weight", grads["blocks_0"]["attn"]["query"]["kernel"]),
        ("blocks.1.mlp.2.weight", grads["blocks_1"]["mlp"]["fc2"]["kernel"]),
        ("ln_f.bias", grads["ln_f"]["bias"]),
        ("head.weight", grads["head"]["kernel"]),
    ]:
        expected = torch_grads[torch_name].grad.numpy()
        if torch_name.endswith(".weight") and "emb" not in torch_name:  # Linear: [out, in]
            expected = expected.T
        assert_relative(ours, expected, tol=1e-5, what=f"grad of {torch_name}")


def test_prefix_and_vocabulary_conventions():
    np.testing.assert_array_equal(
        np.asarray(gpt.prefix_tokens(np.array([0, 9]), 128, 10)), [[128], [137]]
    )
    np.testing.assert_array_equal(
        np.asarray(gpt.prefix_tokens(None, 128, 0, batch=2)), [[128], [128]]
    )
    np.testing.assert_array_equal(np.asarray(gpt.null_tokens(128, 10, 1)), [[138]])
    assert gpt.vocab_size(128, 10) == 138 and gpt.vocab_size(128, 10, null_class=True) == 139
    assert gpt.vocab_size(128, 0) == 129
    with pytest.raises(ValueError, match="needs labels"):
        gpt.prefix_tokens(None, 128, 10)


def test_gpt_rejects_indices_that_are_not_batch_by_length(converted):
    _, model, variables = converted
    with pytest.raises(ValueError, match="indices must be"):
        model.apply(variables, jnp.zeros((24,), jnp.int32))
    with pytest.raises(ValueError, match="exceeds block_size=24"):
        model.apply(variables, jnp.zeros((1, 25), jnp.int32))


def test_bfloat16_compute_keeps_float32_parameters_and_logits():
    model = gpt.GPT(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=32)
    indices = jax.random.randint(jax.random.key(1), (4, 16), 0, 40)
    params = model.init(jax.random.key(0), indices)["params"]
    half = model.clone(dtype=jnp.bfloat16)
    assert jax.tree.structure(half.init(jax.random.key(0), indices)["params"]) == (
        jax.tree.structure(params)
    )
    full_logits = model.apply({"params": params}, indices)
    half_logits = half.apply({"params": params}, indices)
    assert half_logits.dtype == jnp.float32
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    # bf16 keeps 8 bits of mantissa: logits of a 2-block model agree to about 1e-2 of their scale.
    scale = float(jnp.max(jnp.abs(full_logits)))
    assert float(jnp.max(jnp.abs(half_logits - full_logits))) < 2e-2 * scale
    assert float(jnp.max(jnp.abs(half_logits - full_logits))) > 0  # bf16 did run


def test_a_padded_vocabulary_changes_no_probability_and_no_gradient():
    # vocab 11 padded to 16: the real ids' logits, the loss and its gradients are those of the
    # unpadded model holding the same rows and columns; the padding gets no probability.
    sizes = dict(block_size=6, n_layer=1, n_head=2, n_embd=8)
    padded_model = gpt.GPT(vocab_size=11, vocab_multiple=8, **sizes)
    plain_model = gpt.GPT(vocab_size=11, **sizes)
    assert padded_model.padded_vocab_size == 16
    codes = jax.random.randint(jax.random.key(1), (3, 6), 0, 11)
    padded = jax.jit(padded_model.init)(jax.random.key(0), codes)["params"]
    assert padded["tok_emb"]["embedding"].shape == (16, 8) and padded["head"]["kernel"].shape == (
        8,
        16,
    )
    plain = {
        **padded,
        "tok_emb": {"embedding": padded["tok_emb"]["embedding"][:11]},
        "head": {"kernel": padded["head"]["kernel"][:, :11]},
    }

    @functools.partial(jax.jit, static_argnums=0)
    @functools.partial(jax.value_and_grad, argnums=1, has_aux=True)
    def loss(model, params):
        logits = model.apply({"params": params}, codes)
        return gpt.cross_entropy(logits, codes), logits

    (padded_loss, padded_logits), padded_grads = loss(padded_model, padded)
    (plain_loss, plain_logits), plain_grads = loss(plain_model, plain)
    assert_relative(padded_logits[..., :11], plain_logits, 1e-6)
    np.testing.assert_array_equal(padded_logits[..., 11:], np.float32(gpt.PADDED_LOGIT))
    assert_relative(padded_loss, plain_loss, 1e-6)
    head = padded_grads["head"]["kernel"]
    np.testing.assert_array_equal(head[:, 11:], 0.0)
    assert_relative(head[:, :11], plain_grads["head"]["kernel"], 1e-5)
    np.testing.assert_array_equal(padded_grads["tok_emb"]["embedding"][11:], 0.0)
