"""attnjax/tasks/classification.py: its loss, EMA parameters, pretrained initialisation
(init_from), model names, and the task registry."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, flat, load_config, tiny_vit_config, tiny_vit_params

from attnjax import data
from attnjax.convert.google_npz import save_google_npz
from attnjax.models import vit
from attnjax.tasks import classification, get_task


def test_label_smoothing_cross_entropy_reference():
    logits = np.array([[2.0, -1.0, 0.5], [0.0, 0.0, 3.0]], np.float32)
    labels = np.array([0, 1])
    got = classification.label_smoothed_cross_entropy(jnp.asarray(logits), jnp.asarray(labels), 0.2)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    target = np.full((2, 3), 0.2 / 3)
    target[[0, 1], labels] += 0.8
    assert_close(got, -(target * log_p).sum(-1), what="smoothed cross-entropy")


def test_ema_follows_its_recurrence_and_is_used_for_eval(digits_dir):
    config = tiny_vit_config(digits_dir, num_train_steps=4, ema_decay=0.5)
    model = classification.create_model(config)
    ds = data.make_datasets(config)
    batches = data.make_iterator(ds.train)
    state = classification.create_train_state(jax.random.PRNGKey(0), config, model, next(batches))
    step = jax.jit(functools.partial(classification.train_step, config=config, model=model))
    history = [state.params]
    for i in range(2):
        state, _ = step(state, next(batches), jax.random.PRNGKey(i))
        history.append(state.params)
    expected = jax.tree.map(lambda p0, p1, p2: 0.25 * p0 + 0.25 * p1 + 0.5 * p2, *history)
    for key, value in flat(expected).items():
        assert_close(flat(state.ema_params)[key], value, what=key)
    batch = next(data.make_iterator(ds.eval))
    sums = jax.jit(functools.partial(classification.eval_step, config=config, model=model))(
        state, batch
    )
    logits = model.apply({"params": state.ema_params}, batch["image"])
    correct = np.sum((np.argmax(logits, -1) == batch["label"]) * batch["mask"])
    assert float(sums["accuracy"]) == correct


def test_init_from_loads_weights_resizes_positions_and_keeps_a_fresh_head(tmp_path):
    _, params = tiny_vit_params()  # 8x8 images, patch 4: a 2x2 grid, 3 classes
    path = str(tmp_path / "pretrained.npz")
    np.savez(path, **{f"params/{k}": np.asarray(v) for k, v in flat(params).items()})
    config = load_config("vit_digits")
    config.model.update(
        num_classes=5, image_size=16, patch_size=4, width=8, depth=1, num_heads=2, mlp_dim=16
    )
    config.init_from = path
    model = classification.create_model(config)
    state = classification.create_train_state(
        jax.random.PRNGKey(1), config, model, {"image": np.zeros((2, 16, 16, 1), np.float32)}
    )
    got, old = flat(state.params), flat(params)
    for key, value in old.items():
        if key.startswith("head/"):
            assert got[key].shape[-1] == 5
        elif key.endswith("pos_embedding"):  # 1 + 2x2 tokens -> 1 + 4x4 tokens
            from attnjax.ops import positional

            assert_close(got[key], positional.resize_position_embedding(value, (4, 4)), what=key)
        else:
            np.testing.assert_array_equal(got[key], value, err_msg=key)

    np.savez(path, **{k: np.asarray(v) for k, v in flat(params).items() if "blocks_0" not in k})
    with pytest.raises(ValueError, match="lacks .* parameter"):
        classification.create_train_state(
            jax.random.PRNGKey(1), config, model, {"image": np.zeros((2, 16, 16, 1), np.float32)}
        )


def test_init_from_a_big_vision_npz_with_a_class_token_into_a_default_vit(tmp_path):
    """big_vision's position table covers the patches only; the default ViT's covers the class
    token too. The table's prefix count is the checkpoint's, and the missing class-token row is
    zero, so the loaded model computes what the checkpoint's model does."""
    source = vit.create_vit(
        num_classes=3,
        image_size=8,
        patch_size=4,
        width=8,
        depth=1,
        num_heads=2,
        mlp_dim=16,
        in_channels=1,
        no_embed_class=True,
    )
    variables = source.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))
    variables = jax.tree.map(
        lambda x: x + 0.1 * jax.random.normal(jax.random.PRNGKey(3), x.shape), variables
    )  # a non-zero class token and position table
    path = save_google_npz(tmp_path / "big_vision.npz", source, variables, layout="big_vision")
    config = load_config("vit_digits")
    config.model.update(
        num_classes=3, image_size=8, patch_size=4, width=8, depth=1, num_heads=2, mlp_dim=16
    )
    config.init_from = str(path)
    model = classification.create_model(config)
    assert model.class_token and not model.no_embed_class
    images = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 8, 1))
    state = classification.create_train_state(
        jax.random.PRNGKey(2), config, model, {"image": np.asarray(images)}
    )
    params = dict(state.params, head=variables["params"]["head"])
    assert_close(
        model.apply({"params": params}, images),
        source.apply(variables, images),
        rtol=1e-5,
        atol=1e-6,
        what="logits after loading the big_vision checkpoint",
    )

    config.model.update(class_token=False, pool="gap", fc_norm=False)
    np.savez(
        tmp_path / "flat.npz",
        **{
            k: np.asarray(v)
            for k, v in flat(
                dict(params, pos_embed={"pos_embedding": np.zeros((1, 5, 8), np.float32)})
            ).items()
        },
    )
    config.init_from = str(tmp_path / "flat.npz")
    with pytest.raises(ValueError, match=r"covers 1 prefix token\(s\) .* the model's covers 0"):
        classification.create_train_state(
            jax.random.PRNGKey(2),
            config,
            classification.create_model(config),
            {"image": np.asarray(images)},
        )


def test_unknown_model_name():
    config = load_config("vit_digits")
    config.model_name = "resnet"
    with pytest.raises(ValueError, match="config.model_name='resnet' is not a known classifier"):
        classification.create_model(config)


def test_task_registry_protocol():
    task = get_task("classification")
    assert all(
        callable(getattr(task, name))
        for name in ("create_model", "create_train_state", "train_step", "eval_step")
    )
    with pytest.raises(ValueError, match="config.task='gan'"):
        get_task("gan")


def test_compute_dtype_sets_the_vits_activations_and_is_checked():
    config = load_config("vit_digits")
    assert classification.create_model(config).dtype is None  # float32: the inputs' dtype
    config.compute_dtype = "bfloat16"
    assert classification.create_model(config).dtype == jnp.bfloat16
    config.compute_dtype = "float16"
    with pytest.raises(ValueError, match="config.compute_dtype='float16' is not supported"):
        classification.create_model(config)


def test_abstract_batch_takes_the_image_size_from_the_variant():
    config = load_config("vit_cifar10")
    batch = classification.abstract_batch(config, 8)
    assert batch["image"].shape == (8, 32, 32, 3) and batch["label"].dtype == jnp.int32
