"""attnjax/tasks/vqgan.py through the shared training loop: a short real run on the digits."""
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


def tiny(data_dir, **overrides):
    config = load_config("vqgan_digits")
    config.data.data_dir = data_dir
    config.data.eval_split = "test[:64]"
    config.model.ddconfig.update(ch_mult=(1,), num_res_blocks=1)  # f=1: the fewest layers to compile
    config.update(dict(batch_size=16, eval_batch_size=64, warmup_steps=1, log_every=2, eval_every=4,
                       checkpoint_every=4, quiet=True), **overrides)
    return config


def test_short_run_with_gan(digits_dir, tmp_path):
    """The digits config (l2 codes + re-seeding) with the PatchGAN from step 4: both sides of
    disc_start, the metrics and PNGs a person looks at, and a checkpoint that
    ``inference_model`` turns back into the evaluated autoencoder."""
    config = tiny(digits_dir, num_train_steps=8, eval_every=8, checkpoint_every=8)
    config.loss.update(disc_start=4, disc_weight=0.8)
    config.discriminator.update(ndf=8, n_layers=1)
    workdir = str(tmp_path)
    result = train_and_evaluate(config, workdir)

    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        train = [r for r in map(json.loads, f) if "train/loss" in r]
    assert [r["train/disc_factor"] for r in train] == [0.0, 0.0, 1.0, 1.0], "disc_start=4"
    assert all(r["train/disc_loss"] == 0.0 for r in train[:2]) and train[-1]["train/disc_loss"] > 0
    assert train[-1]["train/d_weight"] > 0
    assert train[-1]["train/nll_loss"] < 0.7 * train[0]["train/nll_loss"], "the autoencoder must learn"
    for key in ("eval/l1", "eval/psnr", "eval/codebook_usage", "eval/perplexity", "eval/g_loss", "eval/disc_loss"):
        assert np.isfinite(result[key]), key
    assert 0.5 < result["eval/codebook_usage"] <= 1, "l2 codes + re-seeding keep most codes alive"
    for name in ("reconstructions.png", "codebook.png"):
        assert os.path.getsize(os.path.join(workdir, name)) > 0

    loaded_config, variables = checkpoint.load(workdir, variables=True)
    model, inference_vars = vqgan_task.inference_model(loaded_config, variables)
    eval_batch = next(iter(data.make_datasets(config).eval))
    images = np.asarray(eval_batch["image"])
    rec, _ = model.apply(inference_vars, jnp.asarray(images))
    error = np.clip(np.asarray(rec) * 0.5 + 0.5, 0, 1) - (images * 0.5 + 0.5)
    psnr = np.mean(-10 * np.log10(np.mean(error**2, axis=(1, 2, 3))))
    assert_close(psnr, result["eval/psnr"], rtol=1e-4, what="PSNR of the reloaded autoencoder")


def test_lpips_weights_load_from_torchvision_and_lpips_files(tmp_path):
    """The perceptual term's weights: torchvision's VGG16 file + the lpips package's linear file."""
    import lpips as lpips_package

    torch.manual_seed(0)
    vgg = torchvision.models.vgg16()  # random: the file layout is what matters here
    vgg_path = str(tmp_path / "vgg16.pth")
    torch.save(vgg.state_dict(), vgg_path)
    linear = os.path.join(os.path.dirname(lpips_package.__file__), "weights", "v0.1", "vgg.pth")
    config = load_config("vqgan_digits")
    config.loss.perceptual_weight = 1.0
    config.lpips.update(vgg_path=vgg_path, linear_path=linear)
    model = vqgan_task.create_model(config)
    assert model["lpips"] is not None and vqgan_task.perceptual_weight(config) == 1.0
    params = vqgan_task._load_lpips_params(config)["params"]
    assert_close(params["net"]["features_28"]["kernel"],
                 vgg.features[28].weight.detach().numpy().transpose(2, 3, 1, 0), what="VGG16 conv5_3")
    shipped = torch.load(linear, map_location="cpu", weights_only=True)["lin4.model.1.weight"].numpy()
    assert_close(params["lin4"]["kernel"], shipped.transpose(2, 3, 1, 0), what="LPIPS lin4")


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
