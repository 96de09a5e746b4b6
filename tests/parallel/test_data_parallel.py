"""attnjax/parallel/data_parallel.py: jit+NamedSharding and pmap data parallelism equal one
device."""

import glob
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import flax
import grain
import jax
import numpy as np
import pytest
from helpers import ROOT, assert_close, tiny_config, xla_flags

from attnjax import data
from attnjax.parallel import data_parallel
from attnjax.tasks import classification, train_and_evaluate
from attnjax.train import checkpoint

EIGHT_DEVICES = textwrap.dedent("""
    import json, os, sys
    from attnjax.train import collector
    collector.raise_thresholds()
    sys.path.insert(0, os.path.join({root!r}, "tests"))
    import jax, numpy as np
    import flax
    from helpers import tiny_config, jit_steps
    from attnjax.parallel import data_parallel
    from attnjax.train import checkpoint
    from attnjax.tasks import train_and_evaluate

    # A count chosen in $XLA_FLAGS stands: use_cpu_cores leaves it and every device is used.
    assert data_parallel.use_cpu_cores(tiny_config({data_dir!r})) is None
    assert jax.device_count() == 8, jax.devices()
    out = {{}}
    workdir = os.path.join({tmp!r}, "pmap")
    metrics = train_and_evaluate(tiny_config({data_dir!r}, "pmap"), workdir)
    out["pmap"] = {{k: v for k, v in metrics.items() if k.startswith(("eval/", "train/"))}}
    for mode, params in (("pmap", checkpoint.load(workdir)[1]),
                         ("jit", jax.device_get(jit_steps(tiny_config({data_dir!r}))[0].params))):
        flat = flax.traverse_util.flatten_dict(params, sep="/")
        np.savez(os.path.join({tmp!r}, mode + ".npz"), **flat)
    try:
        data_parallel.DataParallel("jit", batch_size=12)
    except ValueError as e:
        out["error"] = str(e)
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def one_device_run(digits_dir, tmp_path_factory):
    """tiny_config trained in this (one-device) process -> (final metrics, flat params)."""
    workdir = str(tmp_path_factory.mktemp("one"))
    metrics = train_and_evaluate(tiny_config(digits_dir), workdir)
    return metrics, flax.traverse_util.flatten_dict(checkpoint.load(workdir)[1], sep="/")


@pytest.mark.xdist_group("one_device_run")  # the reference is trained once, on one worker
def test_jit_and_pmap_on_8_devices_equal_one_device(digits_dir, one_device_run, tmp_path):
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(8),
        "JAX_PLATFORMS": "cpu",
    }
    script = EIGHT_DEVICES.format(root=ROOT, tmp=str(tmp_path), data_dir=digits_dir)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])

    one, reference = one_device_run
    for mode in ("jit", "pmap"):
        with np.load(tmp_path / f"{mode}.npz") as got:
            assert sorted(got.files) == sorted(reference)
            for key, value in reference.items():
                assert_close(got[key], value, rtol=1e-5, atol=1e-6, what=f"{mode} {key}")
    for key, value in result["pmap"].items():  # losses, accuracies, learning rate, grad norm
        assert_close(value, one[key], rtol=1e-5, atol=1e-6, what=f"pmap {key}")
    # The steps moved the parameters (equal-but-untrained would prove nothing).
    config = tiny_config(digits_dir)
    model = classification.create_model(config)
    example = next(data.make_iterator(data.make_datasets(config).train))
    init_rng, _ = jax.random.split(jax.random.PRNGKey(config.seed))
    initial = flax.traverse_util.flatten_dict(
        classification.create_train_state(init_rng, config, model, example).params, sep="/"
    )
    moved = max(float(np.max(np.abs(np.asarray(initial[k]) - v))) for k, v in reference.items())
    assert moved > 1e-3, moved
    assert "config.batch_size=12" in result["error"] and "8 devices" in result["error"]


CPU_CORES_AS_DEVICES = textwrap.dedent("""
    import json, os, sys
    from attnjax.train import collector
    collector.raise_thresholds()
    sys.path.insert(0, os.path.join({root!r}, "tests"))
    import jax
    import flax, numpy as np
    from helpers import tiny_config
    from attnjax.parallel import data_parallel
    from attnjax.train import checkpoint
    from attnjax.tasks import train_and_evaluate

    one_device = tiny_config({data_dir!r})          # the digits ViT's config asks for 1 device
    four = tiny_config({data_dir!r})
    four.cpu_devices = 4
    out = {{"chosen": data_parallel.use_cpu_cores(one_device, four), "devices": jax.device_count(),
           "four_run_devices": data_parallel.run_devices(four),
           "one_run_devices": [d.id for d in data_parallel.run_devices(one_device)],
           "too_late": data_parallel.set_cpu_devices(2), "after": jax.device_count()}}
    workdir = os.path.join({tmp!r}, "first_of_4")
    train_and_evaluate(one_device, workdir)
    np.savez(os.path.join({tmp!r}, "first_of_4.npz"),
             **flax.traverse_util.flatten_dict(checkpoint.load(workdir)[1], sep="/"))
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.xdist_group("one_device_run")
def test_cpu_devices_per_config_and_a_subset_equals_one_device(
    digits_dir, one_device_run, tmp_path
):
    """use_cpu_cores gives the process the largest count its configs ask for; a config that asks
    for fewer trains on the first of them, with the values of a one-device process."""
    env = {**os.environ, "XLA_FLAGS": xla_flags()}
    script = CPU_CORES_AS_DEVICES.format(root=ROOT, tmp=str(tmp_path), data_dir=digits_dir)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env={**env, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result == {
        "chosen": 4,
        "devices": 4,
        "four_run_devices": None,
        "one_run_devices": [0],
        "too_late": False,
        "after": 4,
    }, result

    _, reference = one_device_run
    with np.load(tmp_path / "first_of_4.npz") as got:
        assert sorted(got.files) == sorted(reference)
        for key, value in reference.items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_cpu_devices_wanted_divides_the_batches_and_rejects_negatives(digits_dir):
    config = tiny_config(digits_dir)  # batch 16, eval batch 40
    config.cpu_devices = 0
    cores = len(os.sched_getaffinity(0))
    assert data_parallel.cpu_devices_wanted(config) == max(
        n for n in range(1, cores + 1) if 16 % n == 0 and 40 % n == 0
    )
    config.cpu_devices = 3
    assert data_parallel.cpu_devices_wanted(config) == 3
    config.cpu_devices = -1
    with pytest.raises(ValueError, match="config.cpu_devices=-1 must be >= 0"):
        data_parallel.cpu_devices_wanted(config)


def test_prefetcher_state_is_that_of_the_consumed_batch():
    source = grain.MapDataset.range(10).batch(2)
    iterator = data.make_iterator(source)
    prefetcher = data_parallel.Prefetcher(iterator, put=lambda b: b * 1, size=3)
    batch, state = next(prefetcher)
    np.testing.assert_array_equal(batch, [0, 1])
    resumed = data.make_iterator(source)
    resumed.set_state(state)
    np.testing.assert_array_equal(next(resumed), [2, 3])  # not [8, 9]: prefetch is invisible


def test_unknown_parallel_mode():
    with pytest.raises(ValueError, match="config.parallel='shard'"):
        data_parallel.DataParallel("shard", batch_size=8)


def test_an_accelerator_plugin_counts_only_beside_its_device(monkeypatch, tmp_path):
    # The dev environment holds libtpu (compile-only TPU programs) on a machine with no TPU: JAX
    # runs on the CPU there, and use_cpu_cores must still give it one device per core.
    installed = {d.metadata["Name"].lower() for d in importlib.metadata.distributions()}
    assert "libtpu" in installed
    monkeypatch.setattr(
        data_parallel, "ACCELERATOR_DEVICE_FILES", {"libtpu": ("/dev/accel[0-9]*",)}
    )
    assert data_parallel.accelerator_present() == bool(glob.glob("/dev/accel[0-9]*"))
    (tmp_path / "accel0").touch()
    present = {"libtpu": (str(tmp_path / "accel[0-9]*"),)}
    monkeypatch.setattr(data_parallel, "ACCELERATOR_DEVICE_FILES", present)
    assert data_parallel.accelerator_present()
    absent = {"no-such-plugin": (str(tmp_path / "accel[0-9]*"),)}
    monkeypatch.setattr(data_parallel, "ACCELERATOR_DEVICE_FILES", absent)
    assert not data_parallel.accelerator_present()
