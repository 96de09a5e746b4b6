"""attnjax.compile: a config's programs compiled for TPU (libtpu) and GPU (jax CUDA plugin)
compile-only devices, their memory and FLOPs checked against counts made here by hand."""

import math

import jax
import numpy as np
import pytest
from helpers import load_config

import attnjax.compile
from attnjax import tasks
from attnjax.compile import programs, targets
from attnjax.parallel import data_parallel
from attnjax.train import accelerators

# A ViT big enough that its matrix products dominate XLA's FLOP count (elementwise work, the
# optimiser and the loss add a few percent), small enough to compile in seconds.
WIDTH, DEPTH, MLP, HEADS, IMAGE, PATCH, CLASSES = 128, 1, 512, 4, 16, 4, 10
BATCH = 64


def vit_config(**overrides):
    config = load_config("vit_digits")
    config.model.update(width=WIDTH, depth=DEPTH, mlp_dim=MLP, num_heads=HEADS)
    config.update({"batch_size": BATCH, "eval_batch_size": BATCH, **overrides})
    return config


def vit_train_flops(image=IMAGE, patch=PATCH, channels=1) -> float:
    """Multiply-adds x 2 of one image through the ViT's training step: forward, and in the
    backward the two products of each forward one (weight and input gradients), except the
    patch embedding's input gradient (the images are not differentiated). Forward: patch
    embedding, per block the q/k/v and output projections, the two attention products and the
    MLP, and the head."""
    tokens = (image // patch) ** 2 + 1  # + the class token
    embed = (image // patch) ** 2 * patch * patch * channels * WIDTH
    block = tokens * (4 * WIDTH * WIDTH + 2 * WIDTH * MLP) + 2 * tokens * tokens * WIDTH
    forward = embed + DEPTH * block + WIDTH * CLASSES
    return 2.0 * (3 * forward - embed)


def state_bytes(config) -> int:
    task = tasks.get_task(config.task)
    batch = task.abstract_batch(config, config.batch_size)
    state = programs.abstract_state(config, task, task.create_model(config), batch)
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))


@pytest.fixture(scope="module")
def v5e_2x2():
    return targets.parse("tpu:v5e:2x2")


def test_tpu_train_step_holds_the_state_and_counts_the_model_flops(v5e_2x2):
    config = vit_config()
    mesh, (train,) = programs.compile_programs(
        config, tasks.get_task("classification"), v5e_2x2, only=("train",)
    )
    assert mesh == {"data": 4, "fsdp": 1, "model": 1}
    # Data parallel: every device holds the whole state (donated, so written in place) and a
    # quarter of the batch (images float32 [16, 16, 16, 1] and labels) and the key; TPU layouts
    # pad small arrays to whole tiles (the head's [128, 10] kernel and its moments to
    # [128, 128]: 180 kB of this 2.5 MB state).
    batch_bytes = BATCH * (IMAGE * IMAGE * 4 + 4) // 4
    expected_arguments = state_bytes(config) + batch_bytes + 8
    assert expected_arguments <= train.argument_bytes <= 1.08 * expected_arguments
    assert train.alias_bytes >= 0.98 * state_bytes(config)
    assert train.flops == BATCH * vit_train_flops()
    # XLA counts elementwise work and the optimiser too, a few percent at this width; the
    # compiled program splits the batch over 4 devices.
    assert train.flops < train.xla_flops < 1.12 * train.flops
    assert train.compiled_flops_per_device * 4 == pytest.approx(train.xla_flops, rel=0.1)
    assert train.collectives.get("all-reduce", 0) >= 1  # the gradients' mean over the batch
    assert "all-gather" not in train.collectives


def test_tpu_fsdp_splits_the_state_over_devices(v5e_2x2):
    config = vit_config(mesh={"data": 1, "fsdp": 4})
    _, (train,) = programs.compile_programs(
        config, tasks.get_task("classification"), v5e_2x2, only=("train",)
    )
    # Every array split four ways except scalars and the 10-class head bias (whole); a quarter
    # of a bias or a norm scale ([32]) fills a whole TPU tile of 128 lanes.
    quarter = state_bytes(config) / 4
    assert quarter <= train.argument_bytes <= 1.4 * quarter
    assert "all-gather" in train.collectives  # each weight gathered before its layer


def test_a_batch_larger_than_the_chip_is_refused_in_one_line(capsys):
    # 2^17 images: the activations kept for the backward pass alone take tens of GiB.
    config = vit_config(batch_size=2**17, eval_batch_size=64)
    status = attnjax.compile.run(config, "tpu:v5e:1x1", config_name="vit_digits")
    err = capsys.readouterr().err.strip().splitlines()
    assert status == attnjax.compile.EXIT_DOES_NOT_FIT
    assert len(err) == 1, err
    assert "the train step at config.batch_size=131072 needs" in err[0]
    needed = float(err[0].split(" needs ")[1].split(" GiB")[0])
    # At least the batch itself, [2^17, 16, 16, 1] float32, and the state.
    assert needed > 2**17 * IMAGE * IMAGE * 4 / 2**30
    # XLA:TPU's own refusal: the HBM it can use, a little under the chip's 16 GiB.
    assert "tpu:v5e:1x1 has 15.75 GiB" in err[0] and "config.mesh.fsdp" in err[0]


@pytest.mark.parametrize(
    "target, why",
    [
        ("tpu:v9:2x2", "unknown TPU generation 'v9'"),
        ("tpu:v5e:2y2", "topology '2y2'"),
        ("gpu:h100:12", "GPU count '12'"),
        ("npu:x", "unknown platform 'npu'"),
    ],
)
def test_a_bad_target_is_named(target, why):
    with pytest.raises(ValueError, match="expected tpu:") as error:
        targets.parse(target)
    assert f"--target={target!r}" in str(error.value) and why in str(error.value)


def test_chips_are_found_by_the_kind_their_devices_report(v5e_2x2):
    assert accelerators.chip_of(v5e_2x2.devices[0]) is accelerators.CHIPS["v5e"]
    assert accelerators.chip_of(jax.devices("cpu")[0]) is None
    assert v5e_2x2.memory_per_device == 16 * 2**30


@pytest.mark.cuda
def test_gpu_train_step_compiles_for_eight_h100s():
    target = targets.parse("gpu:h100:8")
    assert len(target.devices) == 8
    assert target.devices[0].device_kind.startswith("NVIDIA H100")
    config = vit_config()
    _, (train,) = programs.compile_programs(
        config, tasks.get_task("classification"), target, only=("train",)
    )
    batch_bytes = BATCH * (IMAGE * IMAGE * 4 + 4) // 8
    assert train.argument_bytes == pytest.approx(state_bytes(config) + batch_bytes + 8, rel=0.02)
    assert train.flops == BATCH * vit_train_flops()
    assert train.compiled_flops_per_device is None  # XLA:GPU has no cost analysis
    assert train.collectives.get("all-reduce", 0) >= 1
    assert np.isfinite(train.compile_seconds)


@pytest.mark.cuda
def test_remat_on_eight_h100s_keeps_few_activations():
    """Data-parallel remat on XLA:GPU: with the gradients' all-reduce synchronous
    (``data_parallel.train_step_compiler_options``), the recomputed blocks' activations are not all
    kept, and the step's temporaries shrink as they do on one device."""
    target = targets.parse("gpu:h100:8")
    task = tasks.get_task("classification")
    config = vit_config(batch_size=8 * 512, eval_batch_size=8 * 512)
    config.model.depth = 6
    mesh = jax.sharding.Mesh(np.array(target.devices), ("data",))
    temporaries = {}
    for remat in (False, True):
        config.model.remat = remat
        options = data_parallel.train_step_compiler_options(config, mesh)
        assert options == ({"xla_gpu_disable_async_collectives": "ALLREDUCE"} if remat else {})
        _, (train,) = programs.compile_programs(config, task, target, only=("train",))
        temporaries[remat] = train.temp_bytes
    assert temporaries[True] < 0.5 * temporaries[False], temporaries
    cpu_mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("data",))
    assert data_parallel.train_step_compiler_options(config, cpu_mesh) == {}
