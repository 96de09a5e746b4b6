"""attnjax/sharding.py: FSDP equals data parallelism; checkpoints restore across meshes."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import flax
import jax
import numpy as np
import pytest
from helpers import ROOT, assert_close, xla_flags
from jax.sharding import PartitionSpec as P

from attnjax.models import gpt
from attnjax.parallel import sharding
from attnjax.tasks import classification
from attnjax.train import checkpoint

EIGHT_DEVICES = textwrap.dedent("""
    import json, os, sys
    from attnjax.train import collector
    collector.raise_thresholds()
    sys.path.insert(0, os.path.join({root!r}, "tests"))
    import jax, numpy as np
    from helpers import fsdp_config, train_steps
    from attnjax.tasks import train_and_evaluate

    assert jax.device_count() == 8, jax.devices()
    out = {{}}
    for name, mesh in (("dp", {{"data": -1}}), ("fsdp", {{"data": 1, "fsdp": -1}})):
        params, held, whole = train_steps(fsdp_config({data_dir!r}, mesh))
        np.savez(os.path.join({tmp!r}, name + ".npz"), **params)
        out[name] = {{"bytes_per_device": held, "replicated_bytes": whole}}
    params, _, _ = train_steps(fsdp_config({data_dir!r}, {{"data": 2, "fsdp": 4}}, steps=4))
    np.savez(os.path.join({tmp!r}, "fsdp_4_steps.npz"), **params)
    train_and_evaluate(fsdp_config({data_dir!r}, {{"data": 2, "fsdp": 4}}, steps=4),
                       os.path.join({tmp!r}, "run8"))
    print("RESULT " + json.dumps(out))
""")

FOUR_DEVICES = textwrap.dedent("""
    import os, sys
    from attnjax.train import collector
    collector.raise_thresholds()
    sys.path.insert(0, os.path.join({root!r}, "tests"))
    import flax, jax, numpy as np
    from helpers import fsdp_config
    from attnjax.parallel import data_parallel, sharding
    from attnjax.train import checkpoint
    from attnjax import data
    from attnjax.tasks import classification
    from attnjax.tasks import train_and_evaluate

    assert jax.device_count() == 4, jax.devices()
    workdir = os.path.join({tmp!r}, "run4")
    config = fsdp_config({data_dir!r}, {{"data": 1, "fsdp": -1}}, steps=4)
    dp = data_parallel.DataParallel("jit", config.batch_size, mesh=config.mesh,
                               rules=sharding.rules_for(config, classification.SHARDING_RULES))
    model = classification.create_model(config)
    datasets = data.make_datasets(config)
    example = next(data.make_iterator(datasets.train))
    state = dp.place_state(classification.create_train_state(
        jax.random.PRNGKey(1), config, model, example))
    ckpt = checkpoint.Checkpointer(workdir, config)
    restored = ckpt.restore(state, data.make_iterator(datasets.train), step=2)
    ckpt.close()
    kernel = restored.params["blocks_0"]["mlp"]["fc1"]["kernel"]
    assert kernel.sharding.spec == dp.state_shardings(state).params["blocks_0"]["mlp"]["fc1"][
        "kernel"].spec
    params = flax.traverse_util.flatten_dict(dp.to_host(restored.params), sep="/")
    np.savez(os.path.join({tmp!r}, "restored4.npz"), **params)
    train_and_evaluate(config, workdir)
    print("DONE")
""")


def _run(script, devices):
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(devices),
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def _flat(params):
    return flax.traverse_util.flatten_dict(params, sep="/")


def test_fsdp_equals_data_parallel_and_restores_across_meshes(digits_dir, tmp_path):
    stdout = _run(EIGHT_DEVICES.format(root=ROOT, tmp=str(tmp_path), data_dir=digits_dir), 8)
    result = json.loads(stdout.split("RESULT ", 1)[1])

    # FSDP over 8 devices computes what data parallelism computes.
    with np.load(tmp_path / "dp.npz") as dp, np.load(tmp_path / "fsdp.npz") as fsdp:
        assert sorted(dp.files) == sorted(fsdp.files)
        for key in dp.files:
            assert_close(fsdp[key], dp[key], rtol=1e-6, atol=1e-6, what=f"fsdp {key}")
    # ... holding about an eighth of the parameters and optimiser state per device.
    dp_bytes, fsdp_bytes = result["dp"], result["fsdp"]
    assert dp_bytes["bytes_per_device"] == dp_bytes["replicated_bytes"]
    ratio = fsdp_bytes["bytes_per_device"] / fsdp_bytes["replicated_bytes"]
    print(
        f"params + SGD momentum per device: data parallel {dp_bytes['bytes_per_device']} B, "
        f"FSDP x8 {fsdp_bytes['bytes_per_device']} B (ratio {ratio:.4f}, ideal 0.125)"
    )
    assert 0.125 <= ratio < 0.13, ratio

    # The 8-device (data 2 x fsdp 4) run restores whole on this one-device process, bitwise.
    run8 = str(tmp_path / "run8")
    assert jax.device_count() == 1
    _, loaded = checkpoint.load(run8)
    with np.load(tmp_path / "fsdp_4_steps.npz") as expected:
        for key, value in _flat(loaded).items():
            np.testing.assert_array_equal(value, expected[key], err_msg=key)

    # ... and continues on 4 devices from its step-2 checkpoint: the restored arrays are the
    # saved ones, and the two remaining steps reach the 8-device run's final parameters.
    shutil.copytree(run8, tmp_path / "run4")
    shutil.rmtree(tmp_path / "run4" / "checkpoints" / "4")
    _, at_step_2 = checkpoint.load(run8, step=2)
    _run(FOUR_DEVICES.format(root=ROOT, tmp=str(tmp_path), data_dir=digits_dir), 4)
    with np.load(tmp_path / "restored4.npz") as restored:
        for key, value in _flat(at_step_2).items():
            np.testing.assert_array_equal(restored[key], value, err_msg=key)
    _, continued = checkpoint.load(str(tmp_path / "run4"))
    for key, value in _flat(loaded).items():
        assert_close(_flat(continued)[key], value, rtol=1e-6, atol=1e-6, what=f"continued {key}")
    moved = max(float(np.max(np.abs(_flat(at_step_2)[k] - v))) for k, v in _flat(loaded).items())
    assert moved > 1e-3, moved


def test_fsdp_spec_takes_the_largest_dimension_the_axis_divides():
    mesh = jax.sharding.AbstractMesh((1, 4), ("data", "fsdp"))
    assert sharding.fsdp_spec((6, 8, 12), mesh) == P(None, None, "fsdp")
    assert sharding.fsdp_spec((8, 6), mesh) == P("fsdp")
    assert sharding.fsdp_spec((6, 3), mesh) == P()  # nothing divides: replicated
    single = jax.sharding.AbstractMesh((4, 1), ("data", "fsdp"))
    assert sharding.fsdp_spec((8, 8), single) == P()
    # An optimiser moment gets its parameter's layout; counters and biases stay whole.
    rules = classification.SHARDING_RULES
    assert sharding.leaf_spec(
        "opt_state/1/0/trace/blocks_0/mlp/fc1/kernel", (32, 64), mesh, rules
    ) == P(None, "fsdp")
    assert sharding.leaf_spec("opt_state/0/count", (), mesh, rules) == P()
    assert sharding.leaf_spec("params/head/bias", (16,), mesh, rules) == P()
    assert sharding.leaf_spec("params/norm/scale", (16,), mesh, rules) == P("fsdp")


@pytest.mark.parametrize(
    "mesh, message",
    [
        ({"data": -1, "fsdp": -1}, "2 axes of size -1"),
        ({"data": 3}, "3 positions but there are 1 devices"),
        ({"tensor": 1}, "axis 'tensor'"),
    ],
)
def test_bad_mesh_names_the_problem(mesh, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(mesh)


@pytest.mark.parametrize("model", [2, 4, 8])
def test_a_model_axis_that_splits_a_physical_axis_gets_neighbouring_chips(model):
    # On a 4x4x4 v5p slice a model axis of 2 is no product of whole physical axes, which JAX's
    # own placement refuses; each model group must still fill a box of neighbouring chips.
    from attnjax.compile import targets

    devices = list(targets.parse("tpu:v5p:4x4x4").devices)
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "model": model}, devices)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 64 // model, "model": model}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
    for group in mesh.devices.reshape(-1, model):
        coords = np.array([d.coords for d in group])
        box = coords.max(axis=0) - coords.min(axis=0) + 1
        assert np.prod(box) == model, coords.tolist()


def test_arrays_fsdp_cannot_split_are_named():
    # Width 3200 over 256 chips: no dimension of a [3200, 3200] kernel divides, its [3200,
    # 12800] neighbour's second does; small arrays and replicated rules are not reported.
    mesh = jax.sharding.AbstractMesh((256, 1), ("fsdp", "model"))
    shape = lambda *dims: jax.ShapeDtypeStruct(dims, np.float32)
    state = {
        "params": {
            "blocks_0": {
                "attn": {"query": {"kernel": shape(3200, 3200), "bias": shape(3200)}},
                "mlp": {"fc1": {"kernel": shape(3200, 12800)}},
            },
            "pos_emb": shape(1, 256, 3200),
        }
    }
    rules = (*sharding.logical_rules(gpt.PARAM_AXES), ("pos_emb", P()), sharding.SPLIT_REST)
    assert sharding.left_whole(state, mesh, rules) == [
        ("params/blocks_0/attn/query/kernel", (3200, 3200), 3200 * 3200 * 4)
    ]
    model_2 = jax.sharding.AbstractMesh((128, 2), ("fsdp", "model"))
    assert sharding.left_whole(state, model_2, rules) == []
