"""attnjax/train/optim.py: weight decay only on weight matrices, and gradient accumulation
equal to one big batch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_close, flat, tiny_vit_config, tiny_vit_params

from attnjax import data
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
