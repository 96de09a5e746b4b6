"""attnjax/quantizers.py against each paper's formulas, written out in numpy here."""

import itertools
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, xla_flags

from attnjax.models import quantizers, vqgan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def np_rotation(e, q):
    """Fifty et al.'s R = I - 2 r r^T + 2 q_hat e_hat^T and lambda = ||q|| / ||e||, for one
    vector."""
    e_hat, q_hat = e / np.linalg.norm(e), q / np.linalg.norm(q)
    r = (e_hat + q_hat) / np.linalg.norm(e_hat + q_hat)
    rotation = np.eye(len(e)) - 2 * np.outer(r, r) + 2 * np.outer(q_hat, e_hat)
    return rotation, np.linalg.norm(q) / np.linalg.norm(e)


def output_and_input_grad(quantizer, variables, z, upstream):
    """Quantized output and the gradient of <upstream, output> with respect to z."""

    def f(z):
        (out, _, _), _ = quantizer.apply(variables, z, train=True, mutable=["vq_state"])
        return jnp.sum(out * upstream), out

    (_, out), grad = jax.value_and_grad(f, has_aux=True)(z)
    return np.asarray(out, np.float64), np.asarray(grad, np.float64)


def test_fsq_values_indices_and_straight_through_gradient(np_rng):
    levels = np.array([8, 5, 4])
    quantizer = quantizers.make_quantizer(160, 3, kind="fsq", fsq_levels=(8, 5, 4))
    z = np_rng.normal(size=(2, 3, 3, 3)).astype(np.float32) * 2
    variables = quantizer.init(jax.random.key(0), jnp.asarray(z))
    upstream = np_rng.normal(size=z.shape).astype(np.float32)
    out, grad = output_and_input_grad(quantizer, variables, jnp.asarray(z), jnp.asarray(upstream))
    _, indices, aux = quantizer.apply(variables, jnp.asarray(z))

    # The paper's listing: bound, round, divide by the half width; mixed radix, first digit lowest.
    half_l = (levels - 1) * (1 - 1e-3) / 2
    offset = np.where(levels % 2 == 1, 0.0, 0.5)
    shift = np.tan(offset / half_l)
    z64 = z.astype(np.float64)
    bounded = np.tanh(z64 + shift) * half_l - offset
    half_width = levels // 2
    expected = np.round(bounded) / half_width
    basis = np.array([1, 8, 40])
    expected_indices = np.sum((np.round(bounded) + half_width) * basis, axis=-1)
    assert_close(out, expected, what="FSQ codes")
    np.testing.assert_array_equal(np.asarray(indices), expected_indices)
    assert float(aux["loss"]) == 0.0
    # Straight-through: d round / dx = 1, so the gradient is the bound's derivative.
    expected_grad = upstream * half_l * (1 - np.tanh(z64 + shift) ** 2) / half_width
    assert_close(grad, expected_grad, rtol=1e-4, what="FSQ gradient")

    grid = np.asarray(quantizer.apply(variables, method=type(quantizer).codebook))
    assert grid.shape == (160, 3) and len({tuple(row) for row in grid}) == 160
    assert_close(
        np.asarray(quantizer.apply(variables, indices, method=type(quantizer).lookup)),
        expected,
        what="FSQ lookup(indices)",
    )


def test_lfq_signs_binary_indices_and_entropy_terms(np_rng):
    d, beta, weight, diversity, temperature = 4, 0.25, 0.1, 1.0, 0.5
    quantizer = quantizers.make_quantizer(
        2**d,
        d,
        beta,
        kind="lfq",
        lfq_entropy_weight=weight,
        lfq_diversity=diversity,
        lfq_temperature=temperature,
    )
    z = np_rng.normal(size=(2, 3, 3, d)).astype(np.float32)
    variables = quantizer.init(jax.random.key(0), jnp.asarray(z))
    upstream = np_rng.normal(size=z.shape).astype(np.float32)
    out, grad = output_and_input_grad(quantizer, variables, jnp.asarray(z), jnp.asarray(upstream))
    _, indices, aux = quantizer.apply(variables, jnp.asarray(z))

    signs = np.where(z > 0, 1.0, -1.0)
    assert_close(out, signs, what="LFQ codes")
    assert_close(grad, upstream, what="LFQ straight-through gradient")
    np.testing.assert_array_equal(
        np.asarray(indices), np.sum((z > 0) * 2 ** np.arange(d - 1, -1, -1), axis=-1)
    )

    # MAGVIT-v2's entropy penalty over q(c|z) = softmax_c(-||z - c||^2 / T), codes c in {-1, 1}^d.
    codes = np.array(list(itertools.product([-1.0, 1.0], repeat=d)))
    flat = z.reshape(-1, d).astype(np.float64)
    logits = -((flat[:, None, :] - codes[None]) ** 2).sum(-1) / temperature
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    per_sample = np.mean(-np.sum(probs * np.log(probs), axis=-1))
    mean_probs = probs.mean(0)
    batch = -np.sum(mean_probs * np.log(mean_probs))
    commitment = np.mean((z - signs) ** 2)
    assert_close(aux["per_sample_entropy"], per_sample, what="per-sample entropy")
    assert_close(aux["batch_entropy"], batch, what="batch (codebook) entropy")
    assert_close(
        aux["loss"], beta * commitment + weight * (per_sample - diversity * batch), what="LFQ loss"
    )
    assert_close(
        np.asarray(quantizer.apply(variables, method=type(quantizer).codebook)),
        codes,
        what="LFQ codebook in index order",
    )
    # lfq_commitment_weight replaces the shared beta for this kind alone.
    reweighted = quantizers.make_quantizer(
        2**d,
        d,
        beta,
        kind="lfq",
        lfq_entropy_weight=weight,
        lfq_diversity=diversity,
        lfq_temperature=temperature,
        lfq_commitment_weight=0.01,
    )
    _, _, aux = reweighted.apply(variables, jnp.asarray(z))
    assert_close(
        aux["loss"],
        0.01 * commitment + weight * (per_sample - diversity * batch),
        what="LFQ loss with lfq_commitment_weight",
    )


@pytest.mark.parametrize("kind", ["vq", "simvq"])
def test_rotation_trick_value_is_the_code_and_gradient_is_scaled_rotation_transposed(kind, np_rng):
    quantizer = quantizers.make_quantizer(16, 6, kind=kind, rotation_trick=True)
    z = np_rng.normal(size=(1, 2, 3, 6)).astype(np.float32)
    variables = quantizer.init(jax.random.key(1), jnp.asarray(z))
    upstream = np_rng.normal(size=z.shape).astype(np.float32)
    out, grad = output_and_input_grad(quantizer, variables, jnp.asarray(z), jnp.asarray(upstream))
    codes = np.asarray(quantizer.apply(variables, method=type(quantizer).codebook), np.float64)
    flat = z.reshape(-1, 6).astype(np.float64)
    nearest = codes[np.argmin(((flat[:, None] - codes[None]) ** 2).sum(-1), axis=1)]
    assert_close(out.reshape(-1, 6), nearest, rtol=1e-5, atol=1e-6, what="rotated output = code")
    for e, q, g, got in zip(flat, nearest, upstream.reshape(-1, 6), grad.reshape(-1, 6)):
        rotation, scale = np_rotation(e, q)
        assert_close(rotation @ e * scale, q, what="lambda R e = q")
        assert_close(
            got, scale * rotation.T @ g, rtol=1e-4, atol=1e-6, what="gradient lambda R^T g"
        )


def test_simvq_codes_are_frozen_codebook_times_learned_map(np_rng):
    beta = 0.25
    quantizer = quantizers.make_quantizer(32, 8, beta, kind="simvq")
    z = np_rng.normal(size=(2, 2, 2, 8)).astype(np.float32)
    variables = quantizer.init(jax.random.key(2), jnp.asarray(z))
    frozen = np.asarray(variables["vq_state"]["frozen_codebook"], np.float64)
    w = np.asarray(variables["params"]["proj"]["kernel"], np.float64)
    assert set(variables["params"]) == {"proj"}, (
        "the random codebook must not be a trained parameter"
    )

    def loss_fn(params):
        (out, indices, aux), _ = quantizer.apply(
            {**variables, "params": params}, jnp.asarray(z), train=True, mutable=["vq_state"]
        )
        return aux["loss"], (out, indices)

    (loss, (out, indices)), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
    codes = frozen @ w
    flat = z.reshape(-1, 8).astype(np.float64)
    expected_indices = np.argmin(((flat[:, None] - codes[None]) ** 2).sum(-1), axis=1)
    np.testing.assert_array_equal(np.asarray(indices).reshape(-1), expected_indices)
    q = codes[expected_indices]
    assert_close(np.asarray(out).reshape(-1, 8), q, what="SimVQ codes C W")
    assert_close(
        loss, (1 + beta) * np.mean((q - flat) ** 2), what="||sg(z) - q||^2 + beta ||z - sg(q)||^2"
    )
    # Only the codebook term reaches W: d/dW mean((C_i W - z_i)^2) = C_i^T 2 (q_i - z_i) / numel.
    expected_grad = frozen[expected_indices].T @ (2 * (q - flat) / flat.size)
    assert_close(grads["proj"]["kernel"], expected_grad, rtol=1e-4, what="gradient of W")


@pytest.mark.parametrize(
    "kind,options",
    [
        ("vq", dict(l2_normalize=True, usage_decay=0.95)),
        ("fsq", {}),
        ("lfq", {}),
        ("simvq", dict(usage_decay=0.95)),
    ],
)
def test_every_kind_runs_inside_the_vqgan(kind, options, np_rng):
    ddconfig = dict(
        ch=32,
        ch_mult=(1, 2),
        num_res_blocks=1,
        attn_resolutions=(),
        in_channels=1,
        out_ch=1,
        resolution=8,
        z_channels=32,
        double_z=False,
    )
    model = vqgan.create_vqgan(
        ddconfig,
        128,
        16,
        quantizer=dict(kind=kind, **options),
        quantizer_factory=quantizers.make_quantizer,
    )
    x = jnp.asarray(np_rng.uniform(-1, 1, size=(2, 8, 8, 1)).astype(np.float32))
    variables = model.init(jax.random.key(0), x)
    rec, aux = model.apply(variables, x)
    indices = np.asarray(aux["indices"])
    assert indices.shape == (2, 4, 4) and indices.dtype == np.int32
    assert 0 <= indices.min() and indices.max() < model.n_embed
    from_indices = model.apply(variables, aux["indices"], method=vqgan.VQGAN.decode_indices)
    assert_close(
        from_indices, rec, rtol=1e-4, atol=1e-5, what=f"{kind}: decode_indices(encode(x)) = x_rec"
    )
    assert_close(
        aux["codebook_usage"], len(np.unique(indices)) / 128, what="usage from the indices"
    )


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="kind='pq'"):
        quantizers.make_quantizer(128, 8, kind="pq")
    with pytest.raises(ValueError, match="rotation_trick.*kind='fsq'"):
        quantizers.make_quantizer(128, 8, kind="fsq", rotation_trick=True)
    with pytest.raises(ValueError, match=r"fsq_levels=\(8, 8\).*n_embed=128"):
        quantizers.make_quantizer(128, 8, kind="fsq", fsq_levels=(8, 8))
    with pytest.raises(ValueError, match="unknown quantizer options.*'levels'"):
        quantizers.make_quantizer(128, 8, kind="fsq", levels=(8, 4, 4))
    with pytest.raises(ValueError, match="n_embed=100 must be a power of two"):
        quantizers.make_quantizer(100, 8, kind="lfq").init(
            jax.random.key(0), jnp.zeros((1, 2, 2, 8))
        )


SHARDED = textwrap.dedent("""
    import json, sys
    from attnjax.train import collector
    collector.raise_thresholds()
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from attnjax.models import quantizers
    assert jax.device_count() == 8

    # On the host: each eager op on these (sharded) arrays would compile a program of its own.
    def max_difference(a, b):
        return max(
            float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
        )

    z = jnp.asarray(np.random.default_rng(0).normal(size=(16, 2, 2, 12)).astype(np.float32))
    out = {}
    for kind in ("lfq", "simvq", "fsq"):
        one = quantizers.make_quantizer(16, 12, kind=kind, fsq_levels=(4, 4))
        variables = one.init(jax.random.key(0), z)
        keys = ("loss", "perplexity", "codebook_usage")
        if kind == "lfq":
            keys += ("batch_entropy", "per_sample_entropy")
        def stats(q, v, x):
            quantized, indices, aux = q.apply(v, x)
            return quantized, indices, {k: aux[k] for k in keys}
        def loss(v, x):
            return one.apply(v, x)[2]["loss"] + jnp.sum(one.apply(v, x)[0] ** 2) / x.shape[0]
        # One device, jitted: op-by-op dispatch would compile every primitive on its own.
        ref = jax.jit(lambda v, x: stats(one, v, x))(variables, z)
        ref_grad = jax.jit(jax.grad(loss))(variables, z)
        # jit over a mesh: the batch sharded over 8 devices, the statistics global.
        mesh = Mesh(np.array(jax.devices()), ("data",))
        sharded = jax.device_put(z, NamedSharding(mesh, P("data")))
        jitted = jax.jit(lambda v, x: stats(one, v, x))(variables, sharded)
        jit_grad = jax.jit(jax.grad(loss))(variables, sharded)
        # pmap: each device sees 2 examples; the quantizer syncs its statistics over "data".
        per_device = quantizers.make_quantizer(
            16, 12, kind=kind, fsq_levels=(4, 4), axis_name="data")
        pmapped = jax.pmap(lambda x: stats(per_device, variables, x), axis_name="data")(
            z.reshape(8, 2, 2, 2, 12))
        out[kind] = {
            "jit": max_difference(jitted, ref),
            "jit_grad": max_difference(jit_grad, ref_grad),
            "pmap_outputs": max_difference(np.asarray(pmapped[0]).reshape(z.shape), ref[0]),
            "pmap_indices": bool(np.all(np.asarray(pmapped[1]).reshape(ref[1].shape) == ref[1])),
            # Losses are per-device means (the train step pmeans them); statistics are global.
            "pmap_loss": [float(np.mean(pmapped[2]["loss"])), float(ref[2]["loss"])],
            "pmap_stats": {
                k: [float(np.min(pmapped[2][k])), float(np.max(pmapped[2][k])), float(ref[2][k])]
                for k in keys if k != "loss"
            },
        }
    # The VQGAN task's step under pmap (2 examples per device) equals one device on the batch.
    from functools import partial
    from configs import vqgan_digits
    from attnjax.tasks import vqgan as vqgan_task
    config = vqgan_digits.get_config()
    config.model.ddconfig.update(ch=32, ch_mult=(1, 2), num_res_blocks=1, resolution=8)
    config.model.update(n_embed=16, embed_dim=4)
    config.model.quantizer.kind = "lfq"
    model = vqgan_task.create_model(config)
    images = np.random.default_rng(1).uniform(-1, 1, (16, 8, 8, 1)).astype(np.float32)
    state = vqgan_task.create_train_state(jax.random.PRNGKey(0), config, model, {"image": images})
    step = partial(vqgan_task.train_step, config=config, model=model)
    one_state, one_metrics = jax.jit(step)(state, {"image": images}, jax.random.PRNGKey(1))
    p_step = jax.pmap(partial(step, axis_name="data"), axis_name="data", in_axes=(0, 0, None))
    p_state, p_metrics = p_step(
        jax.tree.map(lambda x: np.stack([np.asarray(x)] * 8), state),
        {"image": images.reshape(8, 2, 8, 8, 1)},
        jax.random.PRNGKey(1))
    out["vqgan_task_pmap"] = {
        "metrics": {
            k: [float(p_metrics[k][0]), float(one_metrics[k])]
            for k in ("loss", "perplexity", "codebook_usage")
        },
        "params": max_difference(
            jax.tree.map(lambda x: np.asarray(x)[0], p_state.params), one_state.params
        ),
    }
    print(json.dumps(out))
""")


def test_statistics_on_8_devices_equal_one_device():
    env = dict(
        os.environ,
        XLA_FLAGS=xla_flags(8),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT,
    )
    result = subprocess.run(
        [sys.executable, "-c", SHARDED],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    task = out.pop("vqgan_task_pmap")
    for key, (pmapped, one) in task["metrics"].items():
        assert_close(pmapped, one, rtol=1e-5, atol=1e-6, what=f"VQGAN task {key} under pmap (lfq)")
    assert task["params"] < 1e-5, task
    for kind, r in out.items():
        assert r["jit"] < 1e-5 and r["jit_grad"] < 1e-5, (kind, r)
        assert r["pmap_outputs"] < 1e-5 and r["pmap_indices"], (kind, r)
        assert_close(*r["pmap_loss"], what=f"{kind} mean loss under pmap")
        for key, (low, high, one) in r["pmap_stats"].items():
            assert_close(
                [low, high], [one, one], rtol=1e-5, atol=1e-6, what=f"{kind} {key} under pmap"
            )
