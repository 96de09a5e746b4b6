"""attnjax runs without PyTorch: in a subprocess where ``import torch`` (and torchvision, timm,
lpips, taming) fails, every module outside attnjax/convert/ imports, and a VQGAN training step
with the LPIPS perceptual term runs from a converted weights file."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCKED = ("torch", "torchvision", "timm", "lpips", "taming")

# Runs first in the subprocess: a finder ahead of every other that refuses the PyTorch world, as
# an interpreter without those packages installed would.
BLOCKER = textwrap.dedent(f"""
    import sys

    class _Absent:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {BLOCKED!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, _Absent())
""")

STEP = textwrap.dedent("""
    import importlib, json, pathlib, sys
    from attnjax.train import collector
    collector.raise_thresholds()
    try:
        import torch
        sys.exit("torch imported although blocked")
    except ImportError:
        pass
    root = pathlib.Path(sys.argv[1])
    modules = []
    for path in sorted((root / "attnjax").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[:2] == ["attnjax", "convert"]:
            continue
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        importlib.import_module(".".join(parts))
        modules.append(".".join(parts))

    import jax, jax.numpy as jnp, ml_collections, numpy as np
    from attnjax.models import lpips
    from attnjax.tasks import vqgan

    lpips_model = lpips.LPIPS()
    probe = jnp.zeros((1, 16, 16, 3))
    weights = lpips.save_variables(jax.jit(lpips_model.init)(jax.random.key(7), probe, probe),
                                   pathlib.Path(sys.argv[2]) / "lpips.npz")
    config = ml_collections.ConfigDict(dict(
        seed=0, num_train_steps=10, learning_rate=1e-3, disc_learning_rate=1e-3, optimizer="adamw",
        b1=0.5, b2=0.9, weight_decay=0.0, warmup_steps=0, reseed_threshold=0.0,
        model=dict(ddconfig=dict(ch=32, ch_mult=(1,), num_res_blocks=1, attn_resolutions=(),
                                 in_channels=1, out_ch=1, resolution=16, z_channels=8,
                                 double_z=False, dropout=0.0),
                   n_embed=16, embed_dim=8, beta=0.25, quantizer=dict(legacy=False)),
        loss=dict(disc_start=0, disc_weight=0.0, disc_factor=1.0, codebook_weight=1.0,
                  perceptual_weight=0.5, disc_loss="hinge"),
        discriminator=dict(ndf=8, n_layers=1, norm="batch"), lpips=dict(weights=str(weights))))
    model = vqgan.create_model(config)
    images = np.random.default_rng(0).uniform(-1, 1, (4, 16, 16, 1)).astype(np.float32)
    state = vqgan.create_train_state(jax.random.key(0), config, model, {"image": images})
    step = jax.jit(lambda s, b, r: vqgan.train_step(s, b, r, config=config, model=model))
    new_state, metrics = step(state, {"image": images}, jax.random.key(1))

    autoencoder_vars = {"params": state.params["autoencoder"], "vq_state": state.quantizer_state}
    # jitted: op-by-op dispatch would compile each of VGG16's operations on its own
    rec, _ = jax.jit(model["autoencoder"].apply)(autoencoder_vars, jnp.asarray(images))
    rgb = lambda x: jnp.repeat(x, 3, axis=-1)
    distance = jax.jit(lpips_model.apply)(lpips.load_variables(weights), rgb(images), rgb(rec))
    expected = float(jnp.mean(jnp.abs(images - rec)) + 0.5 * jnp.mean(distance))
    print(json.dumps({"modules": modules, "nll_loss": float(metrics["nll_loss"]),
                      "expected_nll_loss": expected, "step": int(new_state.step),
                      "torch_loaded": any(m.split(".")[0] in ("torch", "torchvision")
                                          for m in sys.modules)}))
""")


def test_modules_import_and_a_vqgan_step_with_lpips_runs_without_torch(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", BLOCKER + STEP, str(ROOT), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert not report["torch_loaded"]
    assert {
        "attnjax.tasks.vqgan",
        "attnjax.train.loop",
        "attnjax.models.lpips",
        "attnjax.train.checkpoint",
        "attnjax.tasks.classification",
        "attnjax.tasks.prior",
    } <= set(report["modules"])
    assert report["step"] == 1
    assert abs(report["nll_loss"] - report["expected_nll_loss"]) <= 1e-4 * abs(
        report["expected_nll_loss"]
    )


def test_the_blocker_makes_import_torch_fail():
    result = subprocess.run(
        [sys.executable, "-c", BLOCKER + "import torch"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "No module named 'torch'" in result.stderr
