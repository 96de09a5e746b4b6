"""The VQGAN rows of ``compare_torch.py``: taming's autoencoder step and its GAN step (disc +
LPIPS). Each returns (description, attnjax ``Jax`` step, torch step).
"""

from __future__ import annotations

import functools
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch_vs_jax import (
    LEARNING_RATE,
    Jax,
    device,
    jax_train_step,
    nchw,
    sync,
    torch_train_step,
)

from attnjax.convert.lpips import lpips_from_torch
from attnjax.convert.taming import nlayer_discriminator_from_taming, vqgan_from_taming
from attnjax.models import lpips

DDCONFIG = dict(
    ch=64,
    ch_mult=(1, 2, 2),
    num_res_blocks=2,
    attn_resolutions=(8,),
    in_channels=3,
    out_ch=3,
    resolution=32,
    z_channels=64,
    double_z=False,
    dropout=0.0,
)


def autoencoder_step(model, variables, images) -> Jax:
    """The attnjax side of the autoencoder rows: L1 + codebook loss, AdamW, compiled."""
    vq_state = variables.get("vq_state", {})

    def loss(params, images):
        (rec, aux), _ = model.apply(
            {"params": params, "vq_state": vq_state}, images, train=True, mutable=["vq_state"]
        )
        return jnp.mean(jnp.abs(rec - images)) + aux["loss"]

    step, state = jax_train_step(loss, variables["params"])
    return Jax(step, state, images, donate=True)


def vqgan_autoencoder(batch):
    from taming.modules.diffusionmodules.model import Decoder, Encoder
    from taming.modules.vqvae.quantize import VectorQuantizer

    torch.manual_seed(0)
    reference = torch.nn.ModuleDict(
        dict(
            encoder=Encoder(**DDCONFIG),
            decoder=Decoder(**DDCONFIG),
            quantize=VectorQuantizer(512, 64, beta=0.25),
            quant_conv=torch.nn.Conv2d(64, 64, 1),
            post_quant_conv=torch.nn.Conv2d(64, 64, 1),
        )
    )
    model, variables = vqgan_from_taming(reference.state_dict(), DDCONFIG, 512, 64)
    reference.to(device())
    images = np.random.default_rng(0).uniform(-1, 1, (batch, 32, 32, 3)).astype(np.float32)
    timages = nchw(images)

    def torch_loss():
        h = reference["quant_conv"](reference["encoder"](timages))
        quantized, codebook_loss, _ = reference["quantize"](h)
        rec = reference["decoder"](reference["post_quant_conv"](quantized))
        return (rec - timages).abs().mean() + codebook_loss

    return (
        f"VQGAN autoencoder train step 32px ch64 batch {batch}",
        autoencoder_step(model, variables, images),
        torch_train_step(reference, torch_loss),
    )


def _patch_taming_lpips():
    """taming's LPIPS builds a random VGG16 trunk (no download) and loads the linear layers the
    ``lpips`` package ships (the file taming would fetch)."""
    import lpips as lpips_package
    import taming.modules.losses.lpips as taming_lpips
    import torchvision

    shipped = os.path.join(os.path.dirname(lpips_package.__file__), "weights", "v0.1", "vgg.pth")
    taming_lpips.models = types.SimpleNamespace(
        vgg16=lambda pretrained: torchvision.models.vgg16(weights=None)
    )
    taming_lpips.LPIPS.load_from_pretrained = lambda self, name="vgg_lpips": self.load_state_dict(
        torch.load(shipped, map_location="cpu", weights_only=True), strict=False
    )


def vqgan_gan_step(batch, directory):
    """Generator + discriminator step with LPIPS (attnjax.tasks.vqgan vs VQLPIPSWithDiscriminator).

    Both sides start from the same weights: taming's random autoencoder, discriminator and LPIPS
    (random VGG16 trunk, shipped linear layers) are converted into the attnjax train state.
    """
    import ml_collections
    from taming.modules.diffusionmodules.model import Decoder, Encoder
    from taming.modules.losses.vqperceptual import VQLPIPSWithDiscriminator
    from taming.modules.vqvae.quantize import VectorQuantizer

    from attnjax.tasks import vqgan

    _patch_taming_lpips()
    torch.manual_seed(0)
    autoencoder = torch.nn.ModuleDict(
        dict(
            encoder=Encoder(**DDCONFIG),
            decoder=Decoder(**DDCONFIG),
            quantize=VectorQuantizer(512, 64, beta=0.25),
            quant_conv=torch.nn.Conv2d(64, 64, 1),
            post_quant_conv=torch.nn.Conv2d(64, 64, 1),
        )
    )
    loss = VQLPIPSWithDiscriminator(
        disc_start=0, disc_weight=0.8, disc_in_channels=3, disc_num_layers=3, disc_ndf=64
    )
    _, ae_variables = vqgan_from_taming(autoencoder.state_dict(), DDCONFIG, 512, 64)
    _, disc_variables = nlayer_discriminator_from_taming(loss.discriminator.state_dict())
    _, lpips_variables = lpips_from_torch(loss.perceptual_loss.state_dict())
    lpips_path = lpips.save_variables(
        lpips_variables, os.path.join(directory, "lpips_random_vgg.npz")
    )
    autoencoder.to(device()), loss.to(device())

    config = ml_collections.ConfigDict(
        dict(
            seed=0,
            model=dict(
                ddconfig=DDCONFIG, n_embed=512, embed_dim=64, beta=0.25, quantizer=dict(legacy=True)
            ),
            loss=dict(
                disc_start=0,
                disc_weight=0.8,
                disc_factor=1.0,
                disc_loss="hinge",
                codebook_weight=1.0,
                perceptual_weight=1.0,
            ),
            discriminator=dict(ndf=64, n_layers=3, norm="batch"),
            lpips=dict(weights=lpips_path),
            optimizer="adamw",
            learning_rate=LEARNING_RATE,
            disc_learning_rate=LEARNING_RATE,
            warmup_steps=0,
            min_lr_ratio=1.0,
            weight_decay=0.0,
            b1=0.5,
            b2=0.9,
            grad_clip_norm=0.0,
            grad_accum_steps=1,
            num_train_steps=1000,
            reseed_threshold=0.0,
        )
    )
    model = vqgan.create_model(config)
    images = np.random.default_rng(0).uniform(-1, 1, (batch, 32, 32, 3)).astype(np.float32)
    state = vqgan.create_train_state(jax.random.PRNGKey(0), config, model, {"image": images})
    params = {"autoencoder": ae_variables["params"], "discriminator": disc_variables["params"]}
    # Fresh Adam moments are zeros of the parameters' shapes, so the initial optimiser states
    # already fit the converted weights; only the tree layout must agree.
    if jax.tree.structure(params) != jax.tree.structure(state.params):
        raise ValueError(
            "vqgan_gan_step: converted taming weights do not match the task's parameter tree"
        )
    state = state.replace(
        **jax.tree.map(
            jnp.asarray,
            dict(
                params=params,
                batch_stats=disc_variables["batch_stats"],
                quantizer_state=ae_variables.get("vq_state", {}),
            ),
        )
    )
    jax_step = functools.partial(vqgan.train_step, config=config, model=model)

    ae_opt = torch.optim.Adam(autoencoder.parameters(), lr=LEARNING_RATE, betas=(0.5, 0.9))
    d_opt = torch.optim.Adam(loss.discriminator.parameters(), lr=LEARNING_RATE, betas=(0.5, 0.9))
    timages = nchw(images)
    last_layer = autoencoder["decoder"].conv_out.weight

    def torch_step():
        quantized, codebook_loss, _ = autoencoder["quantize"](
            autoencoder["quant_conv"](autoencoder["encoder"](timages))
        )
        rec = autoencoder["decoder"](autoencoder["post_quant_conv"](quantized))
        ae_opt.zero_grad(set_to_none=True)
        g_loss, _ = loss(codebook_loss, timages, rec, 0, 10, last_layer=last_layer, split="train")
        g_loss.backward()
        ae_opt.step()
        d_opt.zero_grad(set_to_none=True)
        d_loss, _ = loss(
            codebook_loss, timages, rec.detach(), 1, 10, last_layer=last_layer, split="train"
        )
        d_loss.backward()
        d_opt.step()
        sync()

    def step(state, batch, rng):
        return jax_step(state, batch, rng)[0]

    return (
        f"VQGAN GAN step (disc + LPIPS) 32px ch64 batch {batch}, same weights",
        Jax(step, state, {"image": images}, jax.random.PRNGKey(1), donate=True, split=(0, None)),
        torch_step,
    )
