"""The VQGAN objective of taming-transformers' ``VQLPIPSWithDiscriminator``, as pure functions.

Autoencoder (generator) loss::

    nll    = mean(|x - x_rec| + perceptual_weight * LPIPS(x, x_rec))
    g_loss = -mean(D(x_rec))
    lambda = clip(||grad_W nll|| / (||grad_W g_loss|| + 1e-4), 0, 1e4) * disc_weight   (no gradient)
    loss   = nll + lambda * disc_factor * g_loss + codebook_weight * codebook_loss

with ``W`` the decoder's last conv kernel (the adaptive weight balances the two gradients where
they enter the image) and ``disc_factor`` zero before ``disc_start``. Discriminator loss::

    d_loss = disc_factor * hinge_or_vanilla(D(x), D(x_rec))

Images are ``[batch, height, width, channels]`` in [-1, 1]. taming's ``pixelloss_weight`` is
stored but never used there, so it has no counterpart here.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

Array = jax.Array


def hinge_d_loss(logits_real: Array, logits_fake: Array) -> Array:
    return 0.5 * (
        jnp.mean(jax.nn.relu(1.0 - logits_real)) + jnp.mean(jax.nn.relu(1.0 + logits_fake))
    )


def vanilla_d_loss(logits_real: Array, logits_fake: Array) -> Array:
    return 0.5 * (jnp.mean(jax.nn.softplus(-logits_real)) + jnp.mean(jax.nn.softplus(logits_fake)))


D_LOSSES = {"hinge": hinge_d_loss, "vanilla": vanilla_d_loss}


def adversarial_generator_loss(logits_fake: Array) -> Array:
    """``g_loss = -mean(D(x_rec))``: the generator's adversarial term (before its weights)."""
    return -jnp.mean(logits_fake)


def disc_factor_at(step, disc_start: int, disc_factor: float = 1.0) -> Array:
    """``disc_factor`` from ``disc_start`` on, 0 before (taming's ``adopt_weight``)."""
    return jnp.where(step < disc_start, 0.0, disc_factor)


def nll_loss(
    inputs: Array,
    reconstructions: Array,
    perceptual: Callable | None = None,
    perceptual_weight: float = 0.0,
) -> Array:
    """Mean over pixels of ``|x - x_rec| + perceptual_weight * LPIPS(x, x_rec)`` (per image)."""
    rec = jnp.abs(inputs - reconstructions)
    if perceptual is not None and perceptual_weight > 0:
        rec = rec + perceptual_weight * perceptual(inputs, reconstructions)[:, None, None, None]
    return jnp.mean(rec)


def last_layer_grad(output_grad: Array, features: Array, kernel: Array) -> Array:
    """Gradient with respect to the last conv's ``kernel``, given the gradient at its ``output``.

    ``output = conv3x3(features, kernel) + bias`` (SAME padding), ``features [b, h, w, c_in]``,
    ``kernel [3, 3, c_in, c_out]``. The conv is linear in its kernel, so the chain rule needs only
    ``output_grad`` and the transpose of ``kernel -> conv(features, kernel)``.
    """

    def conv(k):
        return jax.lax.conv_general_dilated(
            features, k, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    (grad,) = jax.linear_transpose(conv, kernel)(output_grad)
    return grad


def adaptive_weight(nll_grad: Array, g_grad: Array, disc_weight: float) -> Array:
    weight = jnp.linalg.norm(nll_grad) / (jnp.linalg.norm(g_grad) + 1e-4)
    return jax.lax.stop_gradient(jnp.clip(weight, 0.0, 1e4)) * disc_weight


def generator_loss(
    inputs: Array,
    reconstructions: Array,
    codebook_loss: Array,
    *,
    discriminator: Callable[[Array], Array] | None,
    step,
    last_layer: tuple[Array, Array],
    perceptual: Callable | None = None,
    perceptual_weight: float = 0.0,
    codebook_weight: float = 1.0,
    disc_start: int = 0,
    disc_factor: float = 1.0,
    disc_weight: float = 1.0,
) -> tuple[Array, dict[str, Array]]:
    """The autoencoder's loss (taming's ``optimizer_idx == 0`` branch) and its log.

    Args:
      inputs, reconstructions: ``[b, H, W, C]``.
      codebook_loss: the quantizer's loss (scalar).
      discriminator: ``images -> logits``; ``None`` trains without the adversarial term.
      step: the global step (``disc_start`` gating).
      last_layer: ``(features entering the decoder's conv_out, its kernel)``.
      perceptual: ``(x, y) -> [b]`` LPIPS distances, used when ``perceptual_weight > 0``.

    The adaptive weight needs the gradients of ``nll`` and ``g_loss`` at the reconstructions, and
    so does the update: each is computed once (one LPIPS and one discriminator backward pass,
    where taming runs each twice) and enters the returned loss through
    ``sum(sg(d_loss/d_rec) * (rec - sg(rec)))``, which is 0 in value and has exactly that gradient.
    """
    rec = jax.lax.stop_gradient(reconstructions)
    nll, rec_grad = jax.value_and_grad(
        lambda r: nll_loss(inputs, r, perceptual, perceptual_weight)
    )(rec)
    loss = nll + codebook_weight * codebook_loss
    log = {"nll_loss": nll, "quant_loss": codebook_loss}
    if discriminator is not None:
        g_loss, g_grad = jax.value_and_grad(lambda r: adversarial_generator_loss(discriminator(r)))(
            rec
        )
        features, kernel = jax.lax.stop_gradient(last_layer)
        d_weight = adaptive_weight(
            last_layer_grad(rec_grad, features, kernel),
            last_layer_grad(g_grad, features, kernel),
            disc_weight,
        )
        factor = disc_factor_at(step, disc_start, disc_factor)
        loss = loss + d_weight * factor * g_loss
        rec_grad = rec_grad + d_weight * factor * g_grad
        log.update(g_loss=g_loss, d_weight=d_weight, disc_factor=factor)
    loss = loss + jnp.sum(jax.lax.stop_gradient(rec_grad) * (reconstructions - rec))
    log["total_loss"] = loss
    return loss, log


def discriminator_loss(
    logits_real: Array,
    logits_fake: Array,
    *,
    step,
    disc_start: int = 0,
    disc_factor: float = 1.0,
    kind: str = "hinge",
) -> tuple[Array, dict[str, Array]]:
    """The discriminator's loss (taming's ``optimizer_idx == 1`` branch) and its log."""
    if kind not in D_LOSSES:
        raise ValueError(
            f"discriminator_loss: kind must be one of {sorted(D_LOSSES)}, got {kind!r}"
        )
    d_loss = disc_factor_at(step, disc_start, disc_factor) * D_LOSSES[kind](
        logits_real, logits_fake
    )
    return d_loss, {
        "disc_loss": d_loss,
        "logits_real": jnp.mean(logits_real),
        "logits_fake": jnp.mean(logits_fake),
    }
