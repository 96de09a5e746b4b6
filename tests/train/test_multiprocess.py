"""Several real processes (attnjax/launch.py + jax.distributed over gloo) train what one process
over as many devices trains and lay out sharded state across processes (killed, stopped and
failing processes: test_multiprocess_faults.py)."""

import json
import os
import subprocess
import sys
import time

import flax
import numpy as np
import pytest
from helpers import ROOT, assert_close, xla_flags

from attnjax.parallel import data_parallel, launch
from attnjax.train import checkpoint

# Each test runs 2 or more JAX processes (a 2-core machine has room for no more): one xdist
# worker runs them all, one at a time.
pytestmark = pytest.mark.xdist_group("multiprocess")


def train_command(config, data_dir, workdir, *flags):
    return [
        "train.py",
        f"--config={os.path.join(ROOT, 'configs', config)}",
        f"--workdir={workdir}",
        f"--config.data.data_dir={data_dir}",
        *flags,
    ]


def env_without_jax_settings():
    """The environment less JAX's settings, but for the suite's compilation cache."""
    return {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or "CACHE" in k}


def env_with_devices(devices):
    env = env_without_jax_settings()
    env.update(XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu")
    return env


def run_one_process(command, devices):
    proc = subprocess.run(
        [sys.executable, *command],
        env=env_with_devices(devices),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def launcher(command, processes, devices_per_process):
    env = env_without_jax_settings()
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "attnjax.parallel.launch",
            f"--processes={processes}",
            f"--devices-per-process={devices_per_process}",
            "--",
            *command,
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def flat_params(workdir, **kwargs):
    return flax.traverse_util.flatten_dict(checkpoint.load(workdir, **kwargs)[1], sep="/")


def last_metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as lines:
        return json.loads(lines.readlines()[-1])


# SGD: Adam divides each gradient by its own magnitude, so parameters whose true gradient is zero
# would move by rounding noise, which differs between gloo's and one process's reduction order. A
# GroupNorm with one channel per group erases its input's per-channel biases; softmax ignores the
# attention key biases.
VQGAN_FLAGS = (
    "--config.optimizer=sgd",
    "--config.learning_rate=0.05",
    "--config.disc_learning_rate=0.05",
    # The prior test encodes both splits to codes, once in each run: a few hundred images do.
    "--config.data.train_split=train[:256]",
    "--config.data.eval_split=test[:64]",
    "--config.model.ddconfig.ch_mult=(1,)",
    "--config.model.ddconfig.num_res_blocks=1",
    "--config.batch_size=16",
    "--config.eval_batch_size=32",
    "--config.warmup_steps=1",
    "--config.log_every=2",
    "--config.eval_every=4",
    "--config.checkpoint_every=4",
    "--config.num_train_steps=4",
    "--config.loss.disc_start=2",
    "--config.loss.disc_weight=0.5",
)


@pytest.fixture(scope="module")
def vqgan_workdir(digits_dir, tmp_path_factory):
    """A tiny VQGAN trained by 1 process x 4 devices: the VQGAN test's reference and the
    prior test's code source, trained once for both."""
    workdir = str(tmp_path_factory.mktemp("vqgan_one"))
    run_one_process(train_command("vqgan_digits.py", digits_dir, workdir, *VQGAN_FLAGS), devices=4)
    return workdir


def test_vqgan_two_processes_sharded_equal_one_process(digits_dir, vqgan_workdir, tmp_path):
    """The VQGAN task (autoencoder + PatchGAN discriminator) with its parameters split over
    4 devices of 2 processes computes what one process over 4 devices computes."""
    two = str(tmp_path / "two")
    sharded = (*VQGAN_FLAGS, "--config.mesh.data=1", "--config.mesh.fsdp=-1")
    proc = launcher(train_command("vqgan_digits.py", digits_dir, two, *sharded), 2, 2)
    output, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, output[-4000:]
    reference = flat_params(vqgan_workdir, use_ema=False)
    got = flat_params(two, use_ema=False)
    assert sorted(got) == sorted(reference)
    for key, value in reference.items():
        assert_close(got[key], value, rtol=1e-5, atol=1e-6, what=key)


def test_prior_two_processes_sharded_equal_one_process(vqgan_workdir, tmp_path):
    """The prior task on 2 processes x 2 devices (mesh data=2, fsdp=2) encodes the VQGAN's
    dataset to the codes one process encodes (both write the same cache files, each through its
    own temporary file, and leave nothing else behind), and trains the GPT to the parameters of
    1 process x 4 devices over the same mesh. SGD, as above: softmax ignores the attention key
    biases, so their gradient is rounding noise."""
    flags = (
        "--config.optimizer=sgd",
        "--config.learning_rate=0.3",
        "--config.weight_decay=0",
        "--config.data.train_shifts=0",
        "--config.model.n_layer=1",
        "--config.model.n_head=2",
        "--config.model.n_embd=32",
        "--config.batch_size=16",
        "--config.eval_batch_size=32",
        "--config.warmup_steps=1",
        "--config.log_every=2",
        "--config.eval_every=4",
        "--config.checkpoint_every=4",
        "--config.num_train_steps=4",
        "--config.sampling.per_class=1",
        f"--config.vqgan_workdir={vqgan_workdir}",
        "--config.mesh.fsdp=2",
    )

    def prior_command(workdir, codes_dir):  # the data (and data_dir) are the VQGAN run's
        return [
            "train.py",
            f"--config={os.path.join(ROOT, 'configs', 'prior_digits.py')}",
            f"--workdir={workdir}",
            *flags,
            f"--config.codes_cache_dir={codes_dir}",
        ]

    one, one_codes = str(tmp_path / "one"), str(tmp_path / "one_codes")
    two, two_codes = str(tmp_path / "two"), str(tmp_path / "two_codes")
    run_one_process(prior_command(one, one_codes), devices=4)
    proc = launcher(prior_command(two, two_codes), 2, 2)
    output, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, output[-4000:]
    assert "[p0] final:" in output and "[p1] final:" in output, output[-3000:]

    assert sorted(os.listdir(two_codes)) == sorted(os.listdir(one_codes))
    for name in os.listdir(one_codes):
        with (
            np.load(os.path.join(one_codes, name)) as expected,
            np.load(os.path.join(two_codes, name)) as got,
        ):
            np.testing.assert_array_equal(got["codes"], expected["codes"], err_msg=name)
            np.testing.assert_array_equal(got["labels"], expected["labels"], err_msg=name)
    reference, got = flat_params(one), flat_params(two)
    assert sorted(got) == sorted(reference)
    for key, value in reference.items():
        assert_close(got[key], value, rtol=1e-5, atol=1e-6, what=key)
    final_eval = last_metrics(one)
    assert "eval/nll" in final_eval, final_eval
    for key, value in final_eval.items():
        assert_close(last_metrics(two)[key], value, rtol=1e-5, atol=1e-6, what=key)
    # Drawn by process 0 from parameters gathered off both processes.
    assert os.path.exists(os.path.join(two, "samples", "000004.png"))


def test_launcher_stops_the_others_when_one_fails(tmp_path):
    script = tmp_path / "one_fails.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['JAX_PROCESS_ID'] == '1':\n"
        "    sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    started = time.monotonic()
    proc = launcher([str(script)], processes=2, devices_per_process=0)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, output
    assert time.monotonic() - started < 30, output
    assert "[launch] process 1 exited with 3; stopping the others" in output


def test_launch_environment_and_bad_input(monkeypatch):
    env = launch.process_env(
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo"},
        index=1,
        count=2,
        port=1234,
        devices_per_process=2,
    )
    assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:1234"
    assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == ("2", "1")
    assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=2"
    with pytest.raises(ValueError, match="--processes=0"):
        launch.launch(["train.py"], processes=0)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "two")
    with pytest.raises(ValueError, match=r"\$JAX_PROCESS_ID='two' is not an integer"):
        data_parallel.maybe_initialize_distributed()
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    with pytest.raises(ValueError, match=r"\$JAX_PROCESS_ID=2 is outside"):
        data_parallel.maybe_initialize_distributed()
    monkeypatch.delenv("JAX_NUM_PROCESSES")
    with pytest.raises(ValueError, match=r"\$JAX_NUM_PROCESSES=None"):
        data_parallel.maybe_initialize_distributed()
