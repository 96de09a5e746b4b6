"""attnjax.models.vector_quantizer against taming-transformers 0.0.1's VectorQuantizer (PyTorch),
and its codebook statistics, EMA updates and dead-code reseeding by construction."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_close, nchw, nhwc
from taming.modules.vqvae.quantize import VectorQuantizer as TorchVectorQuantizer

from attnjax.models import vector_quantizer


def test_vector_quantizer_matches_taming():
    torch.manual_seed(0)
    reference = TorchVectorQuantizer(64, 4, beta=0.25)
    with torch.no_grad():
        reference.embedding.weight.normal_()
    z = np.random.default_rng(0).normal(size=(3, 5, 6, 4)).astype(np.float32)
    z_torch = nchw(z).requires_grad_(True)
    z_q, loss, (perplexity, _, indices) = reference(z_torch)
    (loss + (z_q**3).sum()).backward()

    quantizer = vector_quantizer.VectorQuantizer(64, 4, beta=0.25, legacy=True)
    params = {"params": {"embedding": jnp.asarray(reference.embedding.weight.detach().numpy())}}

    def objective(params, z):
        quantized, _, aux = quantizer.apply(params, z)
        return aux["loss"] + jnp.sum(quantized**3), (quantized, aux)

    (value, (quantized, aux)), (grad_params, grad_z) = jax.value_and_grad(
        objective, (0, 1), has_aux=True
    )(params, jnp.asarray(z))
    _, ours_indices, _ = quantizer.apply(params, jnp.asarray(z))
    np.testing.assert_array_equal(np.asarray(ours_indices).reshape(-1), indices.numpy().reshape(-1))
    assert_close(quantized, nhwc(z_q), what="quantized")
    assert_close(aux["loss"], loss.item(), what="legacy loss")
    assert_close(aux["perplexity"], perplexity.item(), what="perplexity")
    assert_close(aux["codebook_usage"], len(np.unique(indices.numpy())) / 64, what="usage")
    assert_close(grad_z, nhwc(z_torch.grad), what="grad wrt z (straight-through)")
    assert_close(
        grad_params["params"]["embedding"],
        reference.embedding.weight.grad.numpy(),
        what="grad wrt codebook",
    )


def test_non_legacy_loss_puts_beta_on_commitment():
    """VectorQuantizer2(legacy=False): d loss / d z = 2 beta (z - e) / N,
    d loss / d e = 2 (e - z) / N."""
    rng = np.random.default_rng(0)
    codes = rng.normal(size=(8, 3)).astype(np.float32)
    z = rng.normal(size=(1, 2, 5, 3)).astype(np.float32)
    quantizer = vector_quantizer.VectorQuantizer(8, 3, beta=0.25)
    loss_of = lambda p, z: quantizer.apply(p, z)[2]["loss"]
    params = {"params": {"embedding": jnp.asarray(codes)}}
    grad_params, grad_z = jax.grad(loss_of, (0, 1))(params, jnp.asarray(z))
    nearest = ((z.reshape(-1, 1, 3) - codes) ** 2).sum(-1).argmin(-1)
    chosen = codes[nearest].reshape(z.shape)
    assert_close(grad_z, 2 * 0.25 * (z - chosen) / z.size, what="commitment gradient")
    expected = np.zeros_like(codes)
    np.add.at(expected, nearest, 2 * (chosen - z).reshape(-1, 3) / z.size)
    assert_close(grad_params["params"]["embedding"], expected, what="codebook gradient")


def test_l2_normalised_codes_pick_the_most_cosine_similar_code():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(2, 3, 3, 6)).astype(np.float32)
    quantizer = vector_quantizer.VectorQuantizer(16, 6, l2_normalize=True)
    params = quantizer.init(jax.random.PRNGKey(0), z)
    quantized, indices, _ = quantizer.apply(params, z)
    codes = np.asarray(params["params"]["embedding"])
    cosine = (z.reshape(-1, 6) / np.linalg.norm(z.reshape(-1, 6), axis=1, keepdims=True)) @ (
        codes / np.linalg.norm(codes, axis=1, keepdims=True)
    ).T
    np.testing.assert_array_equal(np.asarray(indices).reshape(-1), cosine.argmax(1))
    assert_close(
        np.linalg.norm(np.asarray(quantized), axis=-1), np.ones((2, 3, 3)), what="unit-norm codes"
    )


def test_lookup_dim_projects_in_and_out():
    z = np.random.default_rng(0).normal(size=(2, 3, 3, 8)).astype(np.float32)
    quantizer = vector_quantizer.VectorQuantizer(16, 8, lookup_dim=2)
    params = quantizer.init(jax.random.PRNGKey(0), z)
    quantized, indices, aux = quantizer.apply(params, z)
    p = params["params"]
    low = z @ np.asarray(p["in_proj"]["kernel"]) + np.asarray(p["in_proj"]["bias"])
    codes = np.asarray(p["embedding"])
    nearest = ((low.reshape(-1, 1, 2) - codes) ** 2).sum(-1).argmin(-1)
    np.testing.assert_array_equal(np.asarray(indices).reshape(-1), nearest)
    expected = codes[nearest] @ np.asarray(p["out_proj"]["kernel"]) + np.asarray(
        p["out_proj"]["bias"]
    )
    assert_close(quantized, expected.reshape(2, 3, 3, 8), what="projected-back codes")
    assert aux["latents"].shape == (18, 2)


def test_ema_update_and_dead_code_reseeding():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(1, 4, 4, 3)).astype(np.float32)
    quantizer = vector_quantizer.VectorQuantizer(6, 3, ema_decay=0.9, usage_decay=0.5)
    variables = quantizer.init(jax.random.PRNGKey(0), z)
    assert "params" not in variables, "with EMA the codebook is state, not a parameter"
    codes = np.asarray(variables["vq_state"]["embedding"])
    (_, indices, aux), state = quantizer.apply(variables, z, train=True, mutable=["vq_state"])
    flat, idx = z.reshape(-1, 3), np.asarray(indices).reshape(-1)
    counts = np.bincount(idx, minlength=6).astype(np.float32)
    size = 0.9 * 1.0 + 0.1 * counts
    sums = 0.9 * codes + 0.1 * np.stack([flat[idx == k].sum(0) for k in range(6)])
    smoothed = (size + 1e-5) / (size.sum() + 6e-5) * size.sum()
    assert_close(state["vq_state"]["embedding"], sums / smoothed[:, None], what="EMA codebook")
    usage = np.asarray(state["vq_state"]["usage"])
    assert_close(usage, 0.5 * counts * 6 / 16, what="usage share")

    wrapped_params, wrapped_state = {}, {"quantize": state["vq_state"]}
    _, new_state, reseeded = vector_quantizer.reseed_dead_codes(
        wrapped_params, wrapped_state, aux["latents"], jax.random.PRNGKey(1), threshold=0.5
    )
    dead = usage < 0.5
    new_codes = np.asarray(new_state["quantize"]["embedding"])
    assert int(reseeded) == dead.sum() > 0
    assert_close(
        new_codes[~dead], np.asarray(state["vq_state"]["embedding"])[~dead], what="live codes kept"
    )
    for code in new_codes[dead]:
        assert np.isclose(flat, code, rtol=1e-6).all(1).any(), (
            "a dead code must be reseeded from a latent"
        )
    assert (np.asarray(new_state["quantize"]["usage"])[dead] == 1.0).all()


def test_codebook_statistics_count_weighted_examples():
    indices = np.array([[[0, 1], [1, 1]], [[2, 2], [2, 2]], [[3, 3], [3, 0]]])  # [3, 2, 2]
    weights = np.array([1.0, 0.0, 0.5])  # the second example is padding
    stats = vector_quantizer.codebook_statistics(jnp.asarray(indices), 5, jnp.asarray(weights))
    counts = np.array([1 + 0.5, 3, 0, 1.5, 0])  # code 2 only appears in the padding example
    p = counts / counts.sum()
    expected = np.exp(-np.sum(p[p > 0] * np.log(p[p > 0])))
    assert_close(stats["perplexity"], expected, what="weighted perplexity")
    assert_close(stats["codebook_usage"], 3 / 5, what="weighted usage")
    plain = vector_quantizer.codebook_statistics(jnp.asarray(indices), 5)
    assert_close(
        plain["perplexity"],
        np.exp(-np.sum(np.array([2, 3, 4, 3]) / 12 * np.log(np.array([2, 3, 4, 3]) / 12))),
        what="unweighted perplexity",
    )
    assert_close(plain["codebook_usage"], 4 / 5, what="unweighted usage")
    with pytest.raises(ValueError, match=r"weights must be \[batch\] = \(3,\)"):
        vector_quantizer.codebook_statistics(jnp.asarray(indices), 5, jnp.ones(4))


def test_reseeding_a_trained_codebook_replaces_only_the_dead_codes():
    z = np.random.default_rng(3).normal(size=(1, 4, 4, 3)).astype(np.float32)
    quantizer = vector_quantizer.VectorQuantizer(6, 3, usage_decay=0.5)
    variables = quantizer.init(jax.random.PRNGKey(0), z)
    (_, _, aux), state = quantizer.apply(variables, z, train=True, mutable=["vq_state"])
    params, vq_state = {"quantize": variables["params"]}, {"quantize": state["vq_state"]}
    new_params, new_state, reseeded = vector_quantizer.reseed_dead_codes(
        params, vq_state, aux["latents"], jax.random.PRNGKey(1), threshold=0.5
    )
    dead = np.asarray(vq_state["quantize"]["usage"]) < 0.5
    codes, new_codes = (
        np.asarray(params["quantize"]["embedding"]),
        np.asarray(new_params["quantize"]["embedding"]),
    )
    assert int(reseeded) == dead.sum() > 0
    np.testing.assert_array_equal(new_codes[~dead], codes[~dead])
    assert all(
        np.isclose(np.asarray(aux["latents"]), code).all(1).any() for code in new_codes[dead]
    )
    np.testing.assert_array_equal(np.asarray(new_state["quantize"]["usage"])[dead], 1.0)
    chex.assert_trees_all_equal(
        params["quantize"]["embedding"], codes
    )  # the caller's tree is untouched
