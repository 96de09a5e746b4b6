"""attnjax/train/optim.py: weight decay only on weight matrices, gradient accumulation equal to
one big batch, and layer-wise learning-rate decay by the ViT's depths."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, flat, tiny_vit_config, tiny_vit_params

from attnjax import data
from attnjax.models import vit
from attnjax.tasks import classification
from attnjax.train import optim


def test_weight_decay_only_on_weight_matrices():
    _, params = tiny_vit_params()
    mask = flat(optim.decay_mask(params))
    decayed = sorted(k for k, v in mask.items() if v)
    assert decayed and all(k.endswith("kernel") for k in decayed)
    for name in ("cls_token", "pos_embed/pos_embedding", "norm/scale", "head/bias"):
        assert any(k.endswith(name) for k in mask) and not any(
            v for k, v in mask.items() if k.endswith(name)
        ), name

    config = tiny_vit_config(
        "",
        weight_decay=0.5,
        learning_rate=0.1,
        warmup_steps=0,
        num_train_steps=10,
        grad_clip_norm=0.0,
    )
    grads = jax.tree.map(jnp.ones_like, params)

    @functools.partial(jax.jit, static_argnums=1)
    def first_update(params, weight_decay):
        config.weight_decay = weight_decay
        tx = optim.make_optimizer(config)
        return tx.update(grads, tx.init(params), params)[0]

    with_decay, without = first_update(params, 0.5), first_update(params, 0.0)
    for key, decays in mask.items():
        expected = flat(without)[key] - (0.1 * 0.5 * flat(params)[key] if decays else 0.0)
        assert_close(flat(with_decay)[key], expected, what=key)


def test_gradient_accumulation_equals_one_big_batch(digits_dir):
    # Two accumulated half batches == one full batch (mean of means over equal halves).
    config = tiny_vit_config(digits_dir, num_train_steps=4, batch_size=16, grad_clip_norm=1.0)
    config.model.dropout_rate = 0.0
    model = classification.create_model(config)
    batch = next(data.make_iterator(data.make_datasets(config).train))
    state = classification.create_train_state(jax.random.PRNGKey(0), config, model, batch)
    step = jax.jit(functools.partial(classification.train_step, config=config, model=model))
    big, _ = step(state, batch, jax.random.PRNGKey(1))

    accumulated = config.copy_and_resolve_references()
    accumulated.update(grad_accum_steps=2, num_train_steps=8, warmup_steps=4)
    initial = classification.create_train_state(jax.random.PRNGKey(0), accumulated, model, batch)
    step = jax.jit(functools.partial(classification.train_step, config=accumulated, model=model))
    half = lambda i: jax.tree.map(lambda x: x[8 * i : 8 * (i + 1)], batch)
    state, _ = step(initial, half(0), jax.random.PRNGKey(1))
    for key, value in flat(initial.params).items():  # MultiSteps holds the update back
        np.testing.assert_array_equal(flat(state.params)[key], value, err_msg=key)
    state, _ = step(state, half(1), jax.random.PRNGKey(1))
    for key, value in flat(big.params).items():
        assert_close(flat(state.params)[key], value, rtol=1e-5, atol=1e-6, what=key)


# Depths of a 2-block ViT's parameters by their top-level module, timm's rule written out.
TWO_BLOCK_DEPTHS = dict(
    patch_embed=0, cls_token=0, pos_embed=0, blocks_0=1, blocks_1=2, norm=2, head=3
)


def _layer_decay_setup(**overrides):
    """A 2-block tiny ViT's params, gradients of magnitude 0.5-1.5 with random signs, a config."""
    _, params = tiny_vit_params(depth=2)
    rng = np.random.default_rng(0)
    grads = jax.tree.map(
        lambda p: rng.uniform(0.5, 1.5, p.shape) * rng.choice([-1.0, 1.0], p.shape), params
    )
    fields = dict(learning_rate=0.1, warmup_steps=0, num_train_steps=10, grad_clip_norm=0.0)
    return params, grads, tiny_vit_config("", **{**fields, **overrides})


def _first_update(tx, grads, params):
    return jax.jit(tx.update)(grads, tx.init(params), params)


def test_layer_decay_sgd_update_is_the_rate_times_the_depths_factor():
    params, grads, config = _layer_decay_setup(
        optimizer="sgd", momentum=0.0, nesterov=False, weight_decay=0.0, layer_decay=0.5
    )
    tx = classification.make_optimizer(config)
    updates, _ = _first_update(tx, grads, params)
    expected = {
        key: -0.1 * 0.5 ** (3 - TWO_BLOCK_DEPTHS[key.split("/")[0]]) * grad
        for key, grad in flat(grads).items()
    }
    for key, value in flat(updates).items():
        assert_close(value, expected[key], what=key)
    # The scanned layout: one factor per stacked block.
    scanned, _ = _first_update(tx, vit.stack_block_params(grads), vit.stack_block_params(params))
    for key, value in flat(vit.unstack_block_params(scanned)).items():
        assert_close(value, expected[key], what=f"scanned {key}")


def test_layer_decay_scales_adamw_after_clipping_weight_decay_and_accumulation():
    # AdamW's first update is -lr * (g / (|g| + eps) + weight_decay * p) (kernels decayed);
    # clipping rescales g, which leaves g / |g| as it is. MultiSteps holds the first step back.
    params, grads, config = _layer_decay_setup(
        optimizer="adamw",
        weight_decay=0.1,
        grad_clip_norm=0.5,
        grad_accum_steps=2,
        num_train_steps=20,
        layer_decay=0.5,
    )
    tx = classification.make_optimizer(config)
    held, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert not any(np.any(leaf) for leaf in jax.tree.leaves(held))
    updates, _ = jax.jit(tx.update)(grads, state, params)
    for key, value in flat(updates).items():
        grad, param = flat(grads)[key], flat(params)[key]
        decay = 0.1 * param if key.endswith("kernel") else 0.0
        factor = 0.5 ** (3 - TWO_BLOCK_DEPTHS[key.split("/")[0]])
        assert_close(value, -0.1 * factor * (np.sign(grad) + decay), rtol=1e-5, what=key)


def test_layer_decay_off_leaves_the_optimiser_as_it_was():
    params, grads, config = _layer_decay_setup(optimizer="adamw", weight_decay=0.1)
    assert "layer_decay" not in config
    before, before_state = _first_update(classification.make_optimizer(config), grads, params)
    for value in (0.0, 1.0):
        config.layer_decay = value
        updates, state = _first_update(classification.make_optimizer(config), grads, params)
        assert jax.tree.structure(state) == jax.tree.structure(before_state), value
        for key, leaf in flat(before).items():
            np.testing.assert_array_equal(flat(updates)[key], leaf, err_msg=f"{value} {key}")
    # On, with every parameter at one depth: factor 1, the same bits.
    config.layer_decay = 0.5
    same_depth = lambda tree: jax.tree.map(lambda _: np.array(0), tree)
    tx = optim.make_optimizer(config, layer_depths=same_depth)
    for key, leaf in flat(_first_update(tx, grads, params)[0]).items():
        np.testing.assert_array_equal(flat(before)[key], leaf, err_msg=key)


@pytest.mark.parametrize("value", [-0.5, 1.5, float("nan"), "0.7"])
def test_bad_layer_decay_raises(value):
    config = tiny_vit_config("", layer_decay=value)
    with pytest.raises(ValueError, match=re.escape(f"config.layer_decay={value!r}; expected")):
        classification.make_optimizer(config)


def test_layer_decay_without_the_tasks_depths_raises():
    with pytest.raises(ValueError, match="config.layer_decay=0.75; this task's parameters have"):
        optim.make_optimizer(tiny_vit_config("", layer_decay=0.75))
