"""train.py, attnjax/tasks (loop, classification, optim): runs, resume, configs, bad configs."""

import functools
import glob
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds
from helpers import ROOT, assert_close, load_config

from attnjax import data
from attnjax.convert.google_npz import save_google_npz
from attnjax.models import vit
from attnjax.tasks import classification, get_task, train_and_evaluate
from attnjax.train import checkpoint, optim, report


def tiny(config, **overrides):
    config.model.update(width=16, depth=1, num_heads=2, mlp_dim=32)
    config.update(
        dict(
            batch_size=16,
            eval_batch_size=40,
            warmup_steps=2,
            log_every=2,
            eval_every=4,
            checkpoint_every=4,
            quiet=True,
        ),
        **overrides,
    )
    return config


def digits(data_dir, **overrides):
    config = load_config("vit_digits")
    config.data.data_dir = data_dir
    return tiny(config, **overrides)


def flat(tree):
    return flax.traverse_util.flatten_dict(tree, sep="/")


# ---- a short real run: every output a person looks at -------------------------------------


@pytest.fixture(scope="module")
def short_run(digits_dir, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("run"))
    config = digits(digits_dir, num_train_steps=8)
    return config, workdir, train_and_evaluate(config, workdir)


def test_run_writes_metrics_plots_events_and_checkpoints(short_run):
    config, workdir, result = short_run
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    train = [r for r in records if "train/loss" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in train] == [2, 4, 6, 8] and [r["step"] for r in evals] == [4, 8]
    assert {"train/learning_rate", "train/accuracy", "steps_per_sec"} <= set(train[-1])

    # Logged learning rates follow linear warmup (2 steps) + cosine decay to 0 over 8 steps;
    # a log at step s averages the rates of steps s-2 and s-1 (0-based update counts).
    def reference_lr(i):
        if i < 2:
            return config.learning_rate * i / 2
        return config.learning_rate * 0.5 * (1 + math.cos(math.pi * (i - 2) / 6))

    for r in train:
        expected = (reference_lr(r["step"] - 2) + reference_lr(r["step"] - 1)) / 2
        assert_close(r["train/learning_rate"], expected, rtol=1e-5, what=f"lr at {r['step']}")
    assert result["eval/accuracy"] == evals[-1]["eval/accuracy"] and result["step"] == 8
    for name in ("curves.png", "eval_images.png", "config.json"):
        assert os.path.getsize(os.path.join(workdir, name)) > 0, name
    assert glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4", "8"]


def test_predict_reproduces_eval_metrics(short_run, digits_dir):
    config, workdir, result = short_run
    loaded_config, predict = classification.make_predict(workdir)
    assert loaded_config.model.width == 16
    test = data.load_source("digits", "test", digits_dir)
    images = np.stack([test[i]["image"] for i in range(len(test))])
    labels = np.array([test[i]["label"] for i in range(len(test))])
    # Independent preprocessing: nearest-free bilinear via jax.image (half-pixel centres, as PIL).
    resized = jax.image.resize(
        images.astype(np.float32), (len(images), 16, 16, 1), "bilinear", antialias=False
    )
    resized = np.round(np.asarray(resized)).clip(0, 255) / 255.0
    logits = np.asarray(predict((resized - 0.5) / 0.5), np.float64)
    accuracy = np.mean(logits.argmax(-1) == labels)
    smooth = np.full((len(labels), 10), 0.1 / 10)
    smooth[np.arange(len(labels)), labels] += 0.9
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    loss = -(smooth * log_probs).sum(-1).mean()
    # PIL rounds its 8-bit bilinear output; a pixel may differ by one level from jax.image.
    assert abs(accuracy - result["eval/accuracy"]) <= 2 / 360
    assert_close(loss, result["eval/loss"], rtol=2e-3, what="eval loss")


# ---- the other datasets' configs on tfds.testing.mock_data --------------------------------


@pytest.mark.parametrize(
    "name,optimizer",
    [("vit_cifar10", "adamw"), ("vit_mnist", "sgd"), ("vit_fashion_mnist", "adamw")],
)
def test_dataset_configs_run_on_mock_data(name, optimizer, tmp_path):
    config = tiny(
        load_config(name),
        num_train_steps=2,
        eval_every=2,
        checkpoint_every=2,
        log_every=1,
        batch_size=8,
        eval_batch_size=8,
        optimizer=optimizer,
    )
    config.data.data_dir = str(tmp_path / "tfds")
    with tfds.testing.mock_data(num_examples=12):
        result = train_and_evaluate(config, str(tmp_path / "run"))
    assert result["step"] == 2 and np.isfinite(result["train/loss"])
    assert result["train/learning_rate"] > 0
    assert 0.0 <= result["eval/accuracy"] <= 1.0


# ---- interrupt and resume ------------------------------------------------------------------

RESUME_FLAGS = [
    "--config.model.width=16",
    "--config.model.depth=1",
    "--config.model.num_heads=2",
    "--config.model.mlp_dim=32",
    "--config.batch_size=16",
    "--config.eval_batch_size=40",
    "--config.warmup_steps=5",
    "--config.num_train_steps=40",
    "--config.log_every=5",
    "--config.eval_every=40",
    "--config.checkpoint_every=5",
    "--config.data.crop_padding=1",
    "--config.model.dropout_rate=0.1",
]


def test_killed_run_resumes_to_the_uninterrupted_result(digits_dir, tmp_path):
    workdir = str(tmp_path / "resumed")
    command = [
        sys.executable,
        "train.py",
        "--config",
        "configs/vit_digits.py",
        "--workdir",
        workdir,
        f"--config.data.data_dir={digits_dir}",
        *RESUME_FLAGS,
    ]
    # Both processes run the same programs: the second loads them from the suite's compilation
    # cache (conftest.py), which the environment names.
    env = dict(os.environ)
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        env=env,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    first = os.path.join(workdir, "checkpoints", "5")
    deadline = time.time() + 180
    while not os.path.isdir(first) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # no chance to save anything more
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be interrupted"
    with checkpoint.ocp.CheckpointManager(os.path.join(workdir, "checkpoints")) as manager:
        interrupted_at = manager.latest_step()
    assert interrupted_at is not None and interrupted_at < 40

    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=300, env=env)
    resumed_lines = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    assert resumed_lines[-1]["step"] == 40

    config = load_config("vit_digits")
    config.data.data_dir = digits_dir
    config.model.update(width=16, depth=1, num_heads=2, mlp_dim=32, dropout_rate=0.1)
    config.update(
        batch_size=16,
        eval_batch_size=40,
        warmup_steps=5,
        num_train_steps=40,
        log_every=5,
        eval_every=40,
        checkpoint_every=5,
        quiet=True,
    )
    config.data.crop_padding = 1
    train_and_evaluate(config, str(tmp_path / "straight"))
    _, resumed = checkpoint.load(workdir)
    _, straight = checkpoint.load(str(tmp_path / "straight"))
    for key, value in flat(straight).items():  # bit-identical: same programs, same inputs
        np.testing.assert_array_equal(flat(resumed)[key], value, err_msg=key)


# ---- bad configs fail before training and touch nothing -----------------------------------


def snapshot(directory):
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "**"), recursive=True)):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[path] = (hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
    return out


BAD = [
    ("task", "nope", r"config.task='nope'"),
    ("model_name", "resnet", r"config.model_name.*'resnet'"),
    ("optimizer", "adagrad", r"config.optimizer='adagrad'"),
    ("parallel", "spmd", r"config.parallel='spmd'"),
    ("data.name", "no_such_dataset", r"config.data.name='no_such_dataset'"),
    ("model.width", 32, r"different model.*config.model"),
    ("num_train_steps", 0, r"config.num_train_steps=0"),
    ("cpu_devices", -1, r"config.cpu_devices=-1 must be >= 0"),
]


def test_bad_configs_fail_before_training_and_leave_the_workdir_alone(short_run, digits_dir):
    _, workdir, _ = short_run
    before = snapshot(workdir)
    for field, value, message in BAD:
        config = digits(digits_dir, num_train_steps=8)
        parent, _, leaf = field.rpartition(".")
        (config[parent] if parent else config)[leaf] = value
        with pytest.raises(ValueError, match=message):
            train_and_evaluate(config, workdir)
        assert snapshot(workdir) == before, field
    # Rerunning the finished run trains nothing and reports the same final evaluation.
    config, _, result = short_run
    again = train_and_evaluate(config, workdir)
    assert again["step"] == 8 and again["eval/accuracy"] == result["eval/accuracy"]
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4", "8"]


# ---- optimisation pieces ------------------------------------------------------------------


def _vit_params():
    model = vit.create_vit(
        num_classes=3,
        image_size=8,
        patch_size=4,
        width=8,
        depth=1,
        num_heads=2,
        mlp_dim=16,
        in_channels=1,
    )
    return model, model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]


def test_weight_decay_only_on_weight_matrices():
    _, params = _vit_params()
    mask = flat(optim.decay_mask(params))
    decayed = sorted(k for k, v in mask.items() if v)
    assert decayed and all(k.endswith("kernel") for k in decayed)
    for name in ("cls_token", "pos_embed/pos_embedding", "norm/scale", "head/bias"):
        assert any(k.endswith(name) for k in mask) and not any(
            v for k, v in mask.items() if k.endswith(name)
        ), name

    config = digits(
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
    config = digits(digits_dir, num_train_steps=4, batch_size=16, grad_clip_norm=1.0)
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


def test_label_smoothing_cross_entropy_reference():
    logits = np.array([[2.0, -1.0, 0.5], [0.0, 0.0, 3.0]], np.float32)
    labels = np.array([0, 1])
    got = classification.label_smoothed_cross_entropy(jnp.asarray(logits), jnp.asarray(labels), 0.2)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    target = np.full((2, 3), 0.2 / 3)
    target[[0, 1], labels] += 0.8
    assert_close(got, -(target * log_p).sum(-1), what="smoothed cross-entropy")


def test_ema_follows_its_recurrence_and_is_used_for_eval(digits_dir):
    config = digits(digits_dir, num_train_steps=4, ema_decay=0.5)
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
    _, params = _vit_params()  # 8x8 images, patch 4: a 2x2 grid, 3 classes
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


def test_read_metrics_keeps_the_last_record_of_each_step_and_kind(tmp_path):
    records = [
        {"step": 2, "train/loss": 3.0},
        {"step": 4, "train/loss": 2.0},
        {"step": 4, "eval/accuracy": 0.5},
        # resumed from the step-2 checkpoint: steps 4 logged again
        {"step": 4, "train/loss": 1.5, "steps_per_sec": 9.0},
        {"step": 4, "eval/accuracy": 0.6},
        {"step": 6, "train/loss": 1.0},
    ]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    assert report.read_metrics(str(tmp_path)) == [records[0], records[3], records[4], records[5]]


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


def test_step_keys_from_host_memory_are_the_per_step_fold_in():
    from attnjax.train.loop import _StepKeys

    train_rng = jax.random.split(jax.random.PRNGKey(7))[1]
    keys = _StepKeys(train_rng, chunk=8)
    # In order, across chunk boundaries, then backwards and far ahead (a resumed run starts
    # anywhere).
    for index in list(range(20)) + [3, 1000, 999, 7]:
        np.testing.assert_array_equal(keys(index), np.asarray(jax.random.fold_in(train_rng, index)))
