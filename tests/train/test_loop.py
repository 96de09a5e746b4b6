"""train.py and attnjax/train/loop.py: a run's outputs, the datasets' configs,
bad configs, the metrics log and the per-step keys (resuming after a kill: test_faults.py)."""

import glob
import hashlib
import json
import math
import os

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
from helpers import assert_close, load_config, tiny_vit, tiny_vit_config, tiny_vqgan_config

from attnjax import compat, data
from attnjax.tasks import classification, get_task, train_and_evaluate
from attnjax.train import executables, loop, report, steps

# ---- a short real run: every output a person looks at -------------------------------------


@pytest.fixture(scope="module")
def short_run(digits_dir, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("run"))
    config = tiny_vit_config(digits_dir, num_train_steps=8, profile_steps="5:7")
    # Recomputed blocks: the same run, and MFU's FLOPs (checked by hand below) leave them out.
    config.model.remat = True
    return config, workdir, train_and_evaluate(config, workdir)


@pytest.mark.xdist_group("short_run")  # trained once, on one worker
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
    assert glob.glob(os.path.join(workdir, "profile", "plugins", "profile", "*", "*.xplane.pb"))
    (start,) = [json.loads(line) for line in open(os.path.join(workdir, "environment.jsonl"))]
    assert start["step"] == 0 and start["jax"] == jax.__version__
    # What XLA read: the suite's flags (conftest) after those importing attnjax set.
    assert start["xla_flags"] == os.environ["XLA_FLAGS"]
    assert set(compat.xla_cpu_speed_flags()) <= set(start["xla_flags"].split())


@pytest.mark.xdist_group("short_run")  # trained once, on one worker
def test_run_logs_the_flops_it_ran_at_and_its_mfu(short_run):
    config, workdir, _ = short_run
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    last = [r for r in records if "train/mfu" in r][-1]
    # One CPU device (vit_digits' cpu_devices): FLOPs per step = TFLOP/s / steps per second.
    flops_per_step = last["train/tflops_per_device"] * 1e12 / last["steps_per_sec"]
    # The tiny ViT's matrix products by hand (16 tokens + class token, width 16, MLP 32, one
    # block, 10 classes; 16x16x1 images in 4x4 patches): forward, and backward's two products
    # per forward one but the patch embedding's input gradient (images are not differentiated).
    tokens, width, mlp = 17, 16, 32
    embed = 16 * 16 * width
    forward = embed + tokens * (4 * width**2 + 2 * width * mlp) + 2 * tokens**2 * width + width * 10
    expected = 2 * (3 * forward - embed) * config.batch_size
    assert flops_per_step == pytest.approx(expected, rel=1e-9)
    assert 0 < last["train/mfu"] < 1


@pytest.mark.xdist_group("short_run")  # trained once, on one worker
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
    config = tiny_vit(
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
    ("num_train_steps", -1, r"config.num_train_steps=-1"),
    ("cpu_devices", -1, r"config.cpu_devices=-1 must be >= 0"),
]


@pytest.mark.xdist_group("short_run")  # trained once, on one worker
def test_bad_configs_fail_before_training_and_leave_the_workdir_alone(short_run, digits_dir):
    _, workdir, _ = short_run
    before = snapshot(workdir)
    for field, value, message in BAD:
        config = tiny_vit_config(digits_dir, num_train_steps=8)
        parent, _, leaf = field.rpartition(".")
        (config[parent] if parent else config)[leaf] = value
        with pytest.raises(ValueError, match=message):
            train_and_evaluate(config, workdir)
        assert snapshot(workdir) == before, field
    # Rerunning the finished run trains nothing and reports the same final evaluation, remat
    # switched off or not (the configs above have it off: it is no part of the model's identity).
    config, _, result = short_run
    again = train_and_evaluate(config, workdir)
    assert again["step"] == 8 and again["eval/accuracy"] == result["eval/accuracy"]
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4", "8"]


@pytest.mark.parametrize("make_config", [tiny_vit_config, tiny_vqgan_config])
def test_a_resuming_runs_target_is_the_initial_states_shapes_and_layout(make_config, digits_dir):
    """A resuming run restores into ``jax.eval_shape`` of the task's initialisation placed by
    the mesh's rules (nothing initialised): the initialised and placed state's tree, shapes,
    dtypes and shardings. (Across meshes and process counts: the resumes of
    test_multiprocess_faults.py, from a checkpoint whose parameters 2 processes split.)"""
    config = make_config(digits_dir)
    task = get_task(config.task)
    dp = loop.make_data_parallel(config, task)
    model = task.create_model(config)
    datasets = loop._make_datasets(config, task)
    rng = jax.random.PRNGKey(0)
    example = next(data.make_iterator(datasets.train, config.get("data")))
    state = loop._create_train_state(config, task, model, example, dp, rng)
    target = loop._create_train_state(config, task, model, example, dp, rng, abstract=True)
    assert jax.tree.structure(target) == jax.tree.structure(state)
    for x, t in zip(jax.tree.leaves(state), jax.tree.leaves(target)):
        assert isinstance(t, jax.ShapeDtypeStruct) and not isinstance(x, jax.ShapeDtypeStruct)
        assert (t.shape, t.dtype, t.sharding) == (x.shape, x.dtype, x.sharding)
    # The signature a program is kept under: the train step compiled ahead for the shapes is
    # the one the first step's values call; the task's abstract batch, which the compile command
    # compiles for, is the data's.
    assert executables._signature((target,)) == executables._signature((state,))
    announced = steps.placed_batch(task.abstract_batch(config, config.batch_size), dp)
    assert announced == steps.placed_batch(example, dp)
    assert executables._signature(announced) == executables._signature(dp.shard_batch(example))


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
