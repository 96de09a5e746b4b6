"""The transformer rows of ``compare_torch.py``: SDPA, multi-head attention, timm's ViT and
taming's GPT (training and sampling). Each returns (description, attnjax ``Jax`` step, torch step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from torch_vs_jax import (
    Jax,
    device,
    inference_step,
    jax_train_step,
    nchw,
    sync,
    to_torch,
    torch_train_step,
)

from attnjax.convert.taming import gpt_from_taming
from attnjax.convert.timm import vit_from_timm
from attnjax.convert.torch_nn import mha_from_torch
from attnjax.models import sampling, vit
from attnjax.ops import attention


def sdpa(length):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, length, 64), dtype=np.float32) for _ in range(3))

    def grads(_, q, k, v):
        return jax.grad(
            lambda *a: jnp.sum(attention.scaled_dot_product_attention(*a, is_causal=True)),
            (0, 1, 2),
        )(q, k, v)

    leaves = [to_torch(x).requires_grad_(True) for x in (q, k, v)]

    def torch_step():
        for t in leaves:
            t.grad = None
        torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True).sum().backward()
        sync()

    return (
        f"SDPA fwd+bwd causal 1x8x{length}x64",
        Jax(grads, (), q, k, v, split=(1, 1, 1)),
        torch_step,
    )


def mha():
    torch.manual_seed(0)
    reference = torch.nn.MultiheadAttention(256, 8, batch_first=True).to(device())
    module, variables = mha_from_torch(reference.cpu())
    reference.to(device())
    x = np.random.default_rng(0).standard_normal((16, 256, 256), dtype=np.float32)
    tx = to_torch(x)

    def loss(params, x):
        return jnp.sum(module.apply({"params": params}, x) ** 2)

    def torch_loss():
        return (reference(tx, tx, tx, need_weights=False)[0] ** 2).sum()

    step, state = jax_train_step(loss, variables["params"])
    return (
        "MHA train step 16x256 tokens, 256 wide, 8 heads",
        Jax(step, state, x, donate=True),
        torch_train_step(reference, torch_loss),
    )


def _timm_vit(config, image_size, num_classes):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(
        img_size=image_size,
        patch_size=config["patch_size"],
        embed_dim=config["width"],
        depth=config["depth"],
        num_heads=config["num_heads"],
        mlp_ratio=config["mlp_dim"] / config["width"],
        num_classes=num_classes,
        norm_layer=functools.partial(torch.nn.LayerNorm, eps=config.get("layer_norm_eps", 1e-6)),
    )


def vit_row(variant, image_size, batch, train, num_classes):
    config = vit.variant_config(variant)
    reference = _timm_vit(config, image_size, num_classes).eval()
    model, variables = vit_from_timm(reference, dropout_rate=0.0, attention_dropout_rate=0.0)
    reference.to(device())
    rng = np.random.default_rng(0)
    images = rng.standard_normal((batch, image_size, image_size, 3)).astype(np.float32)
    labels = rng.integers(0, num_classes, batch)
    timages, tlabels = nchw(images), to_torch(labels)
    what = "train step (AdamW)" if train else "inference"
    name = f"ViT {variant} {image_size}px {what}, batch {batch}"
    if not train:

        def forward(params, images):
            return model.apply({"params": params}, images)

        return (
            name,
            Jax(forward, variables["params"], images),
            inference_step(lambda: reference(timages)),
        )

    def loss(params, images, labels):
        logits = model.apply({"params": params}, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    step, state = jax_train_step(loss, variables["params"])
    return (
        name,
        Jax(step, state, images, labels, donate=True),
        torch_train_step(
            reference, lambda: torch.nn.functional.cross_entropy(reference(timages), tlabels)
        ),
    )


def _taming_gpt(n_layer, n_embd, block_size, vocab):
    from taming.modules.transformer import mingpt

    torch.manual_seed(0)
    return mingpt.GPT(vocab, block_size, n_layer=n_layer, n_head=8, n_embd=n_embd)


def gpt_train(batch, length):
    reference = _taming_gpt(8, 256, length, 1024)
    model, variables = gpt_from_taming(reference.state_dict(), n_head=8)
    reference.to(device()).train()
    tokens = np.random.default_rng(0).integers(0, 1024, (batch, length + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    tinputs, ttargets = to_torch(inputs), to_torch(targets)

    def loss(params, inputs, targets):
        logits = model.apply({"params": params}, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def torch_loss():
        logits, _ = reference(tinputs)
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ttargets.reshape(-1)
        )

    step, state = jax_train_step(loss, variables["params"])
    return (
        f"GPT train step 8 layers x 256, length {length}, batch {batch}",
        Jax(step, state, inputs, targets, donate=True),
        torch_train_step(reference, torch_loss),
    )


def gpt_sample(batch, steps):
    from taming.modules.transformer import mingpt

    reference = _taming_gpt(8, 256, steps + 1, 1024)
    model, variables = gpt_from_taming(reference.state_dict(), n_head=8)
    reference.to(device()).eval()
    prefix = np.random.default_rng(0).integers(0, 1024, (batch, 1))
    tprefix = to_torch(prefix)

    def sample(params, prefix, rng):
        return sampling.sample(model, params, prefix, rng, steps, temperature=1.0, top_k=100)

    torch_step = inference_step(
        lambda: mingpt.sample(reference, tprefix, steps, temperature=1.0, sample=True, top_k=100)
    )
    return (
        f"GPT sampling {steps} tokens, batch {batch} (KV cache vs taming's loop)",
        Jax(sample, variables["params"], prefix, jax.random.PRNGKey(0), split=(0, None)),
        torch_step,
    )
