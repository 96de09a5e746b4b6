"""attnjax/export.py: the exported programs of trained runs equal the live models, without
attnjax."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, assert_close

from attnjax import data
from attnjax.inference import export
from attnjax.models import vqgan
from attnjax.tasks import classification
from attnjax.tasks import prior as prior_task
from attnjax.train import checkpoint

# One worker reads the trained runs, so that no other waits for them to be trained.
pytestmark = pytest.mark.xdist_group("trained_runs")


def test_exported_classifier_equals_the_live_model(trained_runs, tmp_path, digits_dir):
    path = str(tmp_path / "vit.jaxexport")
    # One program per platform; this machine runs the CPU one (the TPU and CUDA programs' kernels
    # are checked in tests/ops/test_kernel_choice*.py).
    manifest = export.export_workdir(trained_runs["vit"], path, platforms=("cpu", "tpu"))
    assert manifest["task"] == "classification" and manifest["step"] == 4
    assert manifest["platforms"] == ["cpu", "tpu"]
    test = data.load_source("digits", "test", digits_dir)
    images = np.stack([data.resize(np.asarray(test[i]["image"]), 8) for i in range(7)])
    images = (images.astype(np.float32) / 255.0 - 0.5) / 0.5
    _, predict = classification.make_predict(trained_runs["vit"])
    exported = export.load(path)
    for batch in (images, images[:3]):  # one program, any batch size
        assert_close(
            exported["logits"](batch),
            predict(jnp.asarray(batch)),
            rtol=1e-5,
            atol=1e-6,
            what=f"exported logits, batch {len(batch)}",
        )


def test_exported_vqgan_and_prior_equal_the_live_models(trained_runs, tmp_path):
    vqgan_path, prior_path = str(tmp_path / "vqgan.jaxexport"), str(tmp_path / "prior.jaxexport")
    export.export_workdir(trained_runs["vqgan"], vqgan_path)
    export.export_workdir(trained_runs["prior"], prior_path, number=4)
    live = prior_task.load_vqgan(trained_runs["vqgan"])
    images, _ = prior_task.load_images(live.config.data, "test[:5]", 0)
    codes = live.model.apply(live.variables, images, method=vqgan.VQGAN.encode)[1]
    decoded = live.model.apply(live.variables, codes, method=vqgan.VQGAN.decode_indices)
    exported = export.load(vqgan_path)
    np.testing.assert_array_equal(np.asarray(exported["encode"](images)), np.asarray(codes))
    # The live decoding runs op by op, the export as one compiled program: their float32
    # roundings differ (2.4e-6 on pixels up to 1.7 on this CPU), so near-zero pixels are held to
    # 1e-5 of the image's scale.
    assert_close(
        exported["decode"](np.asarray(codes, np.int32)),
        decoded,
        rtol=1e-5,
        atol=1e-5 * float(np.abs(decoded).max()),
        what="exported VQGAN decoding",
    )

    config, params = (
        checkpoint.read_config(trained_runs["prior"]),
        checkpoint.load(trained_runs["prior"])[1],
    )
    labels = np.array([0, 3, 3, 9], np.int32)
    _, expected = prior_task.sample_images(
        prior_task.create_model(config),
        params,
        live.model,
        live.variables,
        labels,
        jax.random.key(5),
        grid_shape=live.grid_shape,
        codebook_size=live.model.n_embed,
        num_classes=10,
        temperature=config.sampling.temperature,
        top_k=config.sampling.top_k,
        guidance=2.0,
        mean=0.5,
        std=0.5,
    )
    sampled = export.load(prior_path)["sample"](labels, np.uint32(5))
    assert sampled.shape == (4, 8, 8, 1)
    assert_close(sampled, expected, rtol=1e-5, atol=1e-6, what="exported prior samples")


LOADER = """
import json, sys
import numpy as np
from attnjax.inference import export
exported = export.load(sys.argv[1])
images = np.load(sys.argv[2])
logits = np.asarray(exported["logits"](images))
modules = sorted(name for name in sys.modules if name.startswith(("attnjax.", "flax", "torch")))
print(json.dumps({"logits": logits.tolist(), "modules": modules}))
"""


def test_loader_runs_without_the_model_code(trained_runs, tmp_path):
    path = str(tmp_path / "vit.jaxexport")
    export.export_workdir(trained_runs["vit"], path)
    images = np.random.default_rng(0).normal(size=(2, 8, 8, 1)).astype(np.float32)
    np.save(tmp_path / "images.npy", images)
    result = subprocess.run(
        [sys.executable, "-c", LOADER, path, str(tmp_path / "images.npy")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    # attnjax.inference holds only a docstring: nothing is loaded but the loader itself and the
    # XLA flags the package sets on import (attnjax.xla_cpu, with the versions it reads).
    expected_modules = [
        "attnjax.compat",
        "attnjax.inference",
        "attnjax.inference.export",
        "attnjax.xla_cpu",
    ]
    assert loaded["modules"] == expected_modules, loaded["modules"]
    _, predict = classification.make_predict(trained_runs["vit"])
    assert_close(
        np.array(loaded["logits"]),
        predict(jnp.asarray(images)),
        rtol=1e-5,
        atol=1e-6,
        what="logits in a process without the model code",
    )


def test_command_line_refuses_to_overwrite_and_names_bad_workdirs(trained_runs, tmp_path, capsys):
    out = tmp_path / "vit.jaxexport"
    command = [
        sys.executable,
        "-m",
        "attnjax.inference.export",
        "--workdir",
        trained_runs["vit"],
        "--out",
        str(out),
    ]
    export.main(command[3:])  # in this process first: its programs are compiled here already
    assert f"wrote {out}: classification run at step 4" in capsys.readouterr().out
    written = out.read_bytes()
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)  # as a user runs it
    assert again.returncode != 0 and "exists; pass --force" in again.stderr.strip().splitlines()[-1]
    assert out.read_bytes() == written
    with pytest.raises(ValueError, match="holds no checkpoint"):
        export.export_workdir(str(tmp_path / "nothing"), str(tmp_path / "x.jaxexport"))
    with pytest.raises(ValueError, match="--number must be >= 1, got 0"):
        export.export_workdir(trained_runs["prior"], str(tmp_path / "p.jaxexport"), number=0)
    with pytest.raises(ValueError, match=r"--platforms \['cpu', 'gpu'\]: expected some of"):
        export.export_workdir(trained_runs["vit"], str(tmp_path / "v"), platforms=("cpu", "gpu"))
    tpu_only = str(tmp_path / "tpu.jaxexport")
    export.export_workdir(trained_runs["vit"], tpu_only, platforms=("tpu",))
    with pytest.raises(ValueError, match=r"holds programs for \['tpu'\]; this machine runs 'cpu'"):
        export.load(tpu_only)
    with pytest.raises(ValueError, match="holds no manifest"):
        np.savez(tmp_path / "other.npz", x=np.zeros(2))
        export.load(str(tmp_path / "other.npz"))
