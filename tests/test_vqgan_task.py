"""attnjax/tasks/vqgan.py through the shared training loop: short real runs on the digits."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torchvision
from absl import logging

from conftest import assert_close
from test_data import load_config

from attnjax import checkpoint, data
from attnjax.tasks import vqgan as vqgan_task
from attnjax.tasks.loop import train_and_evaluate


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tfds"))
    data.load_source("digits", "train", path)
    return path


def tiny(data_dir, **overrides):
    config = load_config("vqgan_digits")
    config.data.data_dir = data_dir
    config.model.ddconfig.update(ch_mult=(1, 2), num_res_blocks=1)
    config.update(dict(batch_size=16, eval_batch_size=360, warmup_steps=1, log_every=2, eval_every=4,
                       checkpoint_every=4, quiet=True), **overrides)
    return config


def test_everything_on_short_run(digits_dir, tmp_path):
    """GAN from step 2 (both sides of disc_start), LPIPS from weight files, EMA codebook in a
    low-dimensional lookup space with re-seeding: metrics, PNGs, and a checkpoint that
    ``inference_model`` turns back into the evaluated autoencoder."""
    torch.manual_seed(0)
    vgg_path = str(tmp_path / "vgg16.pth")
    torch.save(torchvision.models.vgg16().state_dict(), vgg_path)  # random: the structure matters here
    import lpips as lpips_package

    linear = os.path.join(os.path.dirname(lpips_package.__file__), "weights", "v0.1", "vgg.pth")
    config = tiny(digits_dir, num_train_steps=4)
    config.loss.update(disc_start=2, disc_weight=0.8, perceptual_weight=1.0)
    config.lpips.update(vgg_path=vgg_path, linear_path=linear)
    config.model.quantizer.update(ema_decay=0.9, lookup_dim=8, l2_normalize=False)
    workdir = str(tmp_path / "run")
    result = train_and_evaluate(config, workdir)

    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = [r for r in records if "train/loss" in r]
    assert [r["train/disc_factor"] for r in train] == [0.0, 1.0], "disc_start=2: off for steps 0-1, on after"
    assert train[-1]["train/d_weight"] > 0 and train[-1]["train/disc_loss"] > 0
    for key in ("eval/l1", "eval/psnr", "eval/codebook_usage", "eval/perplexity", "eval/g_loss", "eval/disc_loss"):
        assert np.isfinite(result[key]), key
    assert 0 < result["eval/codebook_usage"] <= 1
    for name in ("reconstructions.png", "codebook.png"):
        assert os.path.getsize(os.path.join(workdir, name)) > 0

    loaded_config, variables = checkpoint.load(workdir, variables=True)
    model, inference_vars = vqgan_task.inference_model(loaded_config, variables)
    assert "embedding" in inference_vars["vq_state"]["quantize"], "the EMA codebook must come back"
    eval_batch = next(iter(data.make_datasets(config).eval))
    images = jnp.asarray(eval_batch["image"])
    rec, aux = model.apply(inference_vars, images)
    pixels = np.clip(np.asarray(rec) * 0.5 + 0.5, 0, 1) - (np.asarray(images) * 0.5 + 0.5)
    psnr = np.mean(-10 * np.log10(np.mean(pixels**2, axis=(1, 2, 3))))
    assert_close(psnr, result["eval/psnr"], rtol=1e-4, what="PSNR of the reloaded autoencoder")


def test_default_digits_run_learns_and_uses_the_codebook(digits_dir, tmp_path):
    config = tiny(digits_dir, num_train_steps=40, eval_every=40, checkpoint_every=40)
    result = train_and_evaluate(config, str(tmp_path))
    assert result["eval/psnr"] > 14.0, "40 steps of L1 training must beat a blank image (~10 dB)"
    assert result["eval/codebook_usage"] > 0.5, "l2 codes + re-seeding keep most codes alive"
    assert result["train/reseeded_codes"] >= 0


def test_perceptual_weight_without_weights_is_zero_and_logged(monkeypatch):
    config = load_config("vqgan_digits")
    config.loss.perceptual_weight = 1.0
    warnings = []
    monkeypatch.setattr(logging, "warning", lambda msg, *args: warnings.append(msg % args))
    model = vqgan_task.create_model(config)
    assert model["lpips"] is None and vqgan_task.perceptual_weight(config) == 0.0
    assert any("WITHOUT the perceptual" in w for w in warnings)


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
    shapes = jax.eval_shape(lambda x: model["autoencoder"].init(jax.random.PRNGKey(0), x),
                            jax.ShapeDtypeStruct((1, size, size, channels), jnp.float32))
    factor = 2 ** (len(config.model.ddconfig.ch_mult) - 1)
    assert shapes["params"]["quantize"]["embedding"].shape == (config.model.n_embed, config.model.embed_dim)
    assert size // factor in (4, 8, 16)
