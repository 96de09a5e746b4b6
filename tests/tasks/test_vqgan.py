"""attnjax/tasks/vqgan.py through the shared training loop: a short real run on the digits."""

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from absl import logging
from helpers import (
    assert_close,
    count_compilations,
    load_config,
    lpips_distance,
    pytorch_fid_statistics,
    tiny_vqgan_config,
)
from pytorch_fid.fid_score import calculate_frechet_distance

from attnjax import data
from attnjax.convert.lpips import lpips_from_torch
from attnjax.models import lpips
from attnjax.tasks import train_and_evaluate
from attnjax.tasks import vqgan as vqgan_task
from attnjax.train import checkpoint


def test_short_run_with_gan(digits_dir, inception_weights, tmp_path):
    """The digits config (l2 codes + re-seeding) with the PatchGAN from step 4: both sides of
    disc_start, the metrics and PNGs a person looks at, and a checkpoint that
    ``inference_model`` turns back into the evaluated autoencoder: its PSNR and SSIM (against
    scikit-image's) and its rFID (against pytorch-fid's, random Inception weights) are the
    run's."""
    config = tiny_vqgan_config(digits_dir, num_train_steps=8, eval_every=8, checkpoint_every=8)
    config.loss.update(disc_start=4, disc_weight=0.8)
    config.discriminator.update(ndf=8, n_layers=1)
    # 6 images in steps of 4: the last step padded; 64 features: no 2048-dim square root.
    config.fid.update(inception=inception_weights["npz"], num_images=6, dims=64, batch_size=4)
    workdir = str(tmp_path)
    result = train_and_evaluate(config, workdir)

    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        train = [r for r in map(json.loads, f) if "train/loss" in r]
    assert [r["train/disc_factor"] for r in train] == [0.0, 0.0, 1.0, 1.0], "disc_start=4"
    assert all(r["train/disc_loss"] == 0.0 for r in train[:2]) and train[-1]["train/disc_loss"] > 0
    assert train[-1]["train/d_weight"] > 0
    assert train[-1]["train/nll_loss"] < 0.7 * train[0]["train/nll_loss"], (
        "the autoencoder must learn"
    )
    for key in (
        "eval/l1",
        "eval/psnr",
        "eval/codebook_usage",
        "eval/perplexity",
        "eval/g_loss",
        "eval/disc_loss",
    ):
        assert np.isfinite(result[key]), key
    assert 0.5 < result["eval/codebook_usage"] <= 1, "l2 codes + re-seeding keep most codes alive"
    for name in ("reconstructions.png", "codebook.png"):
        assert os.path.getsize(os.path.join(workdir, name)) > 0

    loaded_config, variables = checkpoint.load(workdir, variables=vqgan_task.VARIABLE_FIELDS)
    model, inference_vars = vqgan_task.inference_model(loaded_config, variables)
    eval_batch = next(iter(data.make_datasets(config).eval))
    images = np.asarray(eval_batch["image"])
    rec, _ = model.apply(inference_vars, jnp.asarray(images))
    error = np.clip(np.asarray(rec) * 0.5 + 0.5, 0, 1) - (images * 0.5 + 0.5)
    psnr = np.mean(-10 * np.log10(np.mean(error**2, axis=(1, 2, 3))))
    assert_close(psnr, result["eval/psnr"], rtol=1e-4, what="PSNR of the reloaded autoencoder")

    pixels = images * 0.5 + 0.5
    reconstructions = np.clip(np.asarray(rec) * 0.5 + 0.5, 0, 1)
    ssim = np.mean([_skimage_ssim(a, b) for a, b in zip(reconstructions, pixels)])
    assert_close(result["eval/ssim"], ssim, rtol=1e-4, what="eval/ssim against scikit-image")

    assert result["eval/rfid_n"] == 6
    state = torch.load(inception_weights["pth"], weights_only=True)
    expected = calculate_frechet_distance(
        *pytorch_fid_statistics(state, reconstructions[:6], 64),
        *pytorch_fid_statistics(state, pixels[:6], 64),
    )
    assert_close(result["eval/rfid"], expected, rtol=1e-3, what="eval/rfid against pytorch-fid")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        logged = [r for r in map(json.loads, f) if "eval/rfid" in r]
    assert [(r["step"], r["eval/rfid"], r["eval/rfid_n"]) for r in logged] == [
        (8, float(result["eval/rfid"]), 6.0)
    ], "the end-of-run FID is logged once, at the last step"


def _skimage_ssim(image, reference):
    from skimage.metrics import structural_similarity

    return structural_similarity(
        image,
        reference,
        gaussian_weights=True,
        sigma=1.5,
        use_sample_covariance=False,
        data_range=1.0,
        channel_axis=-1,
    )


def test_lpips_weights_come_from_a_converted_file(tmp_path):
    """The perceptual term reads the .npz that ``lpips.save_variables`` wrote, array for array."""
    model = lpips.LPIPS()
    images = jnp.zeros((1, 16, 16, 3))
    variables = jax.jit(model.init)(jax.random.PRNGKey(5), images, images)
    path = lpips.save_variables(variables, tmp_path / "lpips.npz")
    config = load_config("vqgan_digits")
    config.model.ddconfig.update(ch_mult=(1,), num_res_blocks=1)
    config.loss.perceptual_weight = 1.0
    config.lpips.weights = str(path)
    task_model = vqgan_task.create_model(config)
    assert task_model["lpips"] is not None and vqgan_task.perceptual_weight(config) == 1.0
    batch = {"image": np.zeros((2, 16, 16, 1), np.float32)}
    state = vqgan_task.create_train_state(jax.random.PRNGKey(0), config, task_model, batch)
    chex.assert_trees_all_close(state.lpips_params, variables, rtol=0, atol=0)


def test_eval_losses_are_the_training_losses_with_the_configs_settings(
    digits_dir, lpips_reference, tmp_path
):
    """eval/g_loss and eval/disc_loss follow config.loss (vanilla loss, disc_factor 0.5), over the
    real examples only, with the discriminator in eval mode; eval/lpips is the ``lpips``
    package's distance whenever LPIPS weights are given, here with perceptual weight 0."""
    config = tiny_vqgan_config(digits_dir)
    config.loss.update(
        disc_weight=0.8, disc_loss="vanilla", disc_factor=0.5, disc_start=0, perceptual_weight=0.0
    )
    _, lpips_variables = lpips_from_torch(lpips_reference.state_dict())
    config.lpips.weights = lpips.save_variables(lpips_variables, tmp_path / "lpips.npz")
    config.discriminator.update(ndf=8, n_layers=1)
    model = vqgan_task.create_model(config)
    batch = next(iter(data.make_datasets(config).eval))
    state = vqgan_task.create_train_state(jax.random.PRNGKey(0), config, model, batch)
    mask = np.r_[np.ones(40), np.zeros(24)].astype(np.float32)
    sums = jax.jit(lambda s, b: vqgan_task.eval_step(s, b, config=config, model=model))(
        state, {**batch, "mask": mask}
    )

    autoencoder_vars = {"params": state.params["autoencoder"], "vq_state": state.quantizer_state}
    real_images = jnp.asarray(batch["image"][:40])
    rec, _ = model["autoencoder"].apply(autoencoder_vars, real_images)
    disc_vars = {"params": state.params["discriminator"], "batch_stats": state.batch_stats}
    real = np.asarray(model["discriminator"].apply(disc_vars, real_images), np.float64)
    fake = np.asarray(model["discriminator"].apply(disc_vars, rec), np.float64)
    softplus = lambda v: np.logaddexp(0.0, v)
    expected_d = 0.5 * 0.5 * (np.mean(softplus(-real)) + np.mean(softplus(fake)))
    assert float(sums["count"]) == 40
    assert_close(float(sums["disc_loss"]) / 40, expected_d, rtol=1e-5, what="eval/disc_loss")
    assert_close(float(sums["g_loss"]) / 40, -np.mean(fake), rtol=1e-5, what="eval/g_loss")
    rgb = lambda x: np.repeat(np.asarray(x), 3, axis=-1)
    distance = lpips_distance(lpips_reference, rgb(rec), rgb(real_images))
    assert_close(float(sums["lpips"]) / 40, np.mean(distance), rtol=1e-4, what="eval/lpips")


def test_bfloat16_train_step_keeps_float32_state(digits_dir):
    """config.compute_dtype=bfloat16: the autoencoder and the discriminator compute in bf16; the
    state (parameters, optimiser, quantizer, batch statistics) stays float32, and the step's
    reconstruction loss is the float32 model's to bf16 rounding."""
    config = tiny_vqgan_config(digits_dir, compute_dtype="bfloat16")
    config.loss.update(disc_weight=0.8, disc_start=0)
    config.discriminator.update(ndf=8, n_layers=1)
    model = vqgan_task.create_model(config)
    assert model["autoencoder"].dtype == model["discriminator"].dtype == jnp.bfloat16
    batch = next(iter(data.make_datasets(config).train))
    state = vqgan_task.create_train_state(jax.random.PRNGKey(0), config, model, batch)
    step = jax.jit(lambda s, b, r: vqgan_task.train_step(s, b, r, config=config, model=model))
    new_state, metrics = step(state, batch, jax.random.PRNGKey(1))
    assert {
        x.dtype for x in jax.tree.leaves(new_state) if jnp.issubdtype(x.dtype, jnp.floating)
    } == {jnp.dtype(jnp.float32)}
    assert np.isfinite(float(metrics["loss"])) and float(metrics["disc_loss"]) > 0

    full = model["autoencoder"].clone(dtype=None)
    variables = {"params": state.params["autoencoder"], "vq_state": state.quantizer_state}
    rec, _ = full.apply(variables, jnp.asarray(batch["image"]), train=False)
    l1 = float(jnp.mean(jnp.abs(rec - batch["image"])))
    assert_close(float(metrics["nll_loss"]), l1, rtol=2e-2, what="bf16 step's L1 vs float32")


def test_image_writing_compiles_once(digits_dir, tmp_path):
    """A second evaluation's PNGs reuse the compiled decoder: no new XLA compilation."""
    config = tiny_vqgan_config(digits_dir)
    model = vqgan_task.create_model(config)
    batch = next(iter(data.make_datasets(config).eval))
    state = vqgan_task.create_train_state(jax.random.PRNGKey(0), config, model, batch)
    write = lambda s, step: vqgan_task.write_images(
        s, batch, config=config, model=model, workdir=str(tmp_path), step=step
    )
    write(state, 1)
    changed = state.replace(params=jax.tree.map(lambda x: x * 1.01, state.params))
    with count_compilations() as compiled:
        write(changed, 2)
    assert compiled == [], f"the second write_images compiled again: {compiled}"


def test_perceptual_weight_without_weights_is_zero_and_logged(monkeypatch):
    config = load_config("vqgan_digits")
    config.loss.perceptual_weight = 1.0
    warnings = []
    monkeypatch.setattr(logging, "warning", lambda msg, *args: warnings.append(msg % args))
    model = vqgan_task.create_model(config)
    assert model["lpips"] is None and vqgan_task.perceptual_weight(config) == 0.0
    assert any("WITHOUT the perceptual" in w for w in warnings)


def test_lpips_weights_alone_switch_the_perceptual_term_on_at_tamings_weight():
    """perceptual_weight unset (None): 1.0 with LPIPS weights, 0 without; a value set is kept,
    0 included (eval/lpips without the term)."""
    for name in ("vqgan_digits", "vqgan_folder"):
        config = load_config(name)
        assert config.loss.perceptual_weight is None
        assert vqgan_task.perceptual_weight(config) == 0.0
        config.lpips.weights = "lpips_vgg.npz"
        assert vqgan_task.perceptual_weight(config) == 1.0, name
        for weight in (0.0, 0.5):
            config.loss.perceptual_weight = weight
            assert vqgan_task.perceptual_weight(config) == weight, (name, weight)
    for name in ("vqgan_cifar10", "vqgan_imagenet_f16"):
        assert load_config(name).loss.perceptual_weight == 1.0, name


def test_bad_config_raises():
    config = load_config("vqgan_digits")
    config.model.quantizer.usage_decay = 0.0
    with pytest.raises(ValueError, match="usage_decay"):
        vqgan_task.create_model(config)
    config = load_config("vqgan_digits")
    config.model.ddconfig.ch = 16
    model = vqgan_task.create_model(config)
    with pytest.raises(ValueError, match="multiple of 32"):
        model["autoencoder"].init(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 1)))


@pytest.mark.parametrize("name", ["vqgan_digits", "vqgan_cifar10", "vqgan_imagenet_f16"])
def test_configs_build(name):
    config = load_config(name)
    model = vqgan_task.create_model(config)
    size = config.data.image_size or 32
    channels = config.model.ddconfig.in_channels
    shapes = jax.eval_shape(
        lambda x: model["autoencoder"].init(jax.random.PRNGKey(0), x),
        jax.ShapeDtypeStruct((1, size, size, channels), jnp.float32),
    )
    factor = 2 ** (len(config.model.ddconfig.ch_mult) - 1)
    assert shapes["params"]["quantize"]["embedding"].shape == (
        config.model.n_embed,
        config.model.embed_dim,
    )
    assert size // factor in (4, 8, 16)
