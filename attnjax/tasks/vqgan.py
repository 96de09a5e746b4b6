"""VQGAN training: taming's autoencoder + PatchGAN objective, two Adam optimisers in one step.

Batches: ``{"image": float32 [batch, H, W, C], "label": ...}`` normalised with
``config.data.mean/std`` (``0.5/0.5`` gives taming's [-1, 1]); eval batches add ``"mask"``.

Train state: ``params = {"autoencoder", "discriminator"}`` and ``quantizer_state``, the
quantizer's non-trained state (its ``vq_state`` collection: EMA codebook, per-code usage), which
``checkpoint.load(..., variables=VARIABLE_FIELDS)`` returns with the params (see
``inference_model``).
Each step:

1. autoencoder update: ``vqgan_loss.generator_loss`` (L1 + LPIPS, codebook loss, and the
   adversarial term with taming's adaptive weight, times ``disc_factor`` = 0 before
   ``config.loss.disc_start``). As in taming, the discriminator runs from step 0 (a
   ``lax.cond`` skipping it made the XLA:CPU step over ten times slower, not faster);
2. discriminator update on the same reconstructions (taming recomputes them with the updated
   autoencoder; one forward pass less here), its loss also gated by ``disc_start``;
3. dead-code re-seeding (``vector_quantizer.reseed_dead_codes``) when
   ``config.reseed_threshold > 0``.

Config: ``model.ddconfig`` (taming's), ``model.n_embed``, ``model.embed_dim``, ``model.beta``,
``model.quantizer`` (``kind``: "vq", "fsq", "lfq" or "simvq", ``rotation_trick``, and the
``attnjax.models.quantizers.make_quantizer`` options of each kind: ``legacy``, ``l2_normalize``,
``lookup_dim``, ``ema_decay``, ``usage_decay``, ``fsq_levels``, ``lfq_*``; 0 switches a numeric
option off), ``reseed_threshold`` (kind "vq" only), ``loss``
(``disc_start``, ``disc_weight`` (0: no discriminator at all), ``disc_factor``,
``codebook_weight``, ``perceptual_weight`` (None: taming's 1 with LPIPS weights), ``disc_loss``),
``discriminator`` (``ndf``, ``n_layers``, ``norm``), ``lpips.weights`` (LPIPS variables
converted once to ``.npz``, see ``attnjax.models.lpips.load_variables``; "" turns the perceptual
term and ``eval/lpips`` off, and the log says so; torch is never needed here), ``fid``
(``eval/rfid`` at the end of training, ``attnjax.tasks.image_metrics``), ``disc_learning_rate``
and the ``attnjax.train.optim`` fields (taming: Adam, ``b1=0.5``, ``b2=0.9``, no weight decay).

Eval metrics: ``l1`` (on the model's pixel scale), ``psnr`` (per image, pixels in [0, 1],
averaged), ``perplexity`` and ``codebook_usage`` (fraction of codes used, per eval batch
weighted by its examples: an eval batch holding the whole split gives the split's usage),
``ssim`` (scikit-image's Gaussian SSIM, ``attnjax.metrics.ssim``; images of 11 pixels or more),
``lpips`` (LPIPS distance, when ``lpips.weights`` is set, whatever the perceptual weight),
``g_loss``/``disc_loss`` when there is a discriminator: the training step's loss functions and
settings (``disc_loss``, ``disc_factor`` and ``disc_start`` at the state's step) with the
discriminator in eval mode, per image, averaged.
"""

from __future__ import annotations

import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax.sharding import PartitionSpec as P

from attnjax import data, storage
from attnjax.data.images import save_image_grid
from attnjax.metrics import ssim
from attnjax.models import lpips, quantizers, vector_quantizer, vqgan
from attnjax.models.discriminator import NLayerDiscriminator
from attnjax.ops import vqgan_loss
from attnjax.parallel import sharding
from attnjax.tasks import image_metrics
from attnjax.train import executables, hashed_init, optim, precision

# Config fields that define the model a checkpoint holds (a resumed run must agree on them).
IDENTITY_FIELDS = ("model",)
# Train-state fields besides the params that inference needs (the discriminator's BatchNorm
# statistics and the quantizer's state), returned by ``checkpoint.load(..., variables=...)``.
VARIABLE_FIELDS = ("batch_stats", "quantizer_state")
# The codebook and its usage statistics (1024 x 256 floats for ImageNet f16) stay whole: with
# them split, the dead-code re-seeding's random picks came out differently from the unsplit
# run's (XLA:CPU), and whole they cost 1 MiB. The autoencoder, discriminator and LPIPS constants
# are split over the fsdp axis.
CODEBOOK_WHOLE = (r"(^|/)vq_state/|(^|/)quantize/embedding$", P())
SHARDING_RULES = (sharding.WHOLE_SCALARS, CODEBOOK_WHOLE, sharding.SPLIT_REST)


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any  # {"autoencoder", "discriminator" (or None)}
    opt_state: Any
    quantizer_state: Any = None  # the autoencoder's "vq_state" collection
    disc_opt_state: Any = None
    batch_stats: Any = None  # the discriminator's BatchNorm statistics
    lpips_params: Any = None  # constants, present only with a perceptual term


def perceptual_weight(config) -> float:
    """The perceptual weight in effect: 0 without LPIPS weights; with them
    ``config.loss.perceptual_weight``, taming's 1.0 where that is None (one flag, the weights,
    switches the term on)."""
    if not config.get("lpips", {}).get("weights"):
        return 0.0
    weight = config.loss.get("perceptual_weight")
    weight = 1.0 if weight is None else float(weight)
    return max(weight, 0.0)


def _quantizer_options(config) -> dict:
    options = dict(config.model.get("quantizer", {}))
    for key in ("lookup_dim", "ema_decay", "usage_decay"):
        options[key] = options.get(key) or None
    return options


def _reseeds(config) -> bool:
    """Dead-code re-seeding applies to the learned codebook of kind "vq" only."""
    return (
        config.get("reseed_threshold", 0.0) > 0
        and config.model.get("quantizer", {}).get("kind", "vq") == "vq"
    )


def create_model(config) -> dict:
    """``{"autoencoder": VQGAN, "discriminator": NLayerDiscriminator | None,
    "lpips": LPIPS | None}``."""
    if _reseeds(config) and not config.model.get("quantizer", {}).get("usage_decay"):
        raise ValueError(
            "config.reseed_threshold > 0 needs config.model.quantizer.usage_decay > 0 "
            "(re-seeding reads the tracked per-code usage)"
        )
    autoencoder = create_autoencoder(config)
    discriminator = None
    if config.loss.get("disc_weight", 0.0) > 0:
        discriminator = NLayerDiscriminator(
            **config.discriminator.to_dict(), dtype=precision.compute_dtype(config)
        )
    if (config.loss.get("perceptual_weight") or 0.0) > 0 and not perceptual_weight(config):
        logging.warning(
            "config.loss.perceptual_weight=%g but config.lpips.weights is empty: "
            "training WITHOUT the perceptual (LPIPS) term, i.e. perceptual weight 0.",
            config.loss.perceptual_weight,
        )
    # With weights, LPIPS is the perceptual term (when weighted) and the eval/lpips metric.
    lpips_model = lpips.LPIPS() if config.get("lpips", {}).get("weights") else None
    return {"autoencoder": autoencoder, "discriminator": discriminator, "lpips": lpips_model}


def create_autoencoder(config) -> vqgan.VQGAN:
    return vqgan.create_vqgan(
        config.model.ddconfig.to_dict(),
        config.model.n_embed,
        config.model.embed_dim,
        beta=config.model.get("beta", 0.25),
        quantizer=_quantizer_options(config),
        quantizer_factory=quantizers.make_quantizer,
        dtype=precision.compute_dtype(config),
        remat=config.model.get("remat", False),
    )


def inference_model(config, variables):
    """``(VQGAN, variables for its apply)`` from
    ``checkpoint.load(workdir, variables=VARIABLE_FIELDS)``."""
    return create_autoencoder(config), _autoencoder_variables(
        variables["params"], variables.get("quantizer_state")
    )


def _autoencoder_variables(params, quantizer_state) -> dict:
    return {"params": params["autoencoder"], "vq_state": quantizer_state or {}}


def _optimizers(config):
    autoencoder = optim.make_optimizer(config)
    disc = optim.make_optimizer(
        config, learning_rate=config.get("disc_learning_rate", config.learning_rate)
    )
    return autoencoder, disc


def _keyed(init, index: int):
    """``init`` given the ``index``-th key of ``jax.random.split(rng)``, as the autoencoder (0)
    and the discriminator (1) always took theirs; its hashes batched (``hashed_init``)."""
    return hashed_init.hashed_together(
        lambda rng, images: init(jax.random.split(rng)[index], images)
    )


def create_train_state(rng, config, model, example_batch) -> TrainState:
    image_metrics.check_config(config)  # before training, not after it
    # Host arrays go to the kept programs as they are, and the key is split inside them: no
    # small program compiled for a slice, a split or a copy at every start.
    images = example_batch["image"]
    init = executables.jit(config, "init", _keyed(model["autoencoder"].init, 0), keep_outputs=True)
    variables = init(rng, images[:1])
    params = {"autoencoder": variables["params"], "discriminator": None}
    tx, disc_tx = _optimizers(config)
    disc_opt_state = batch_stats = lpips_params = None
    if model["discriminator"] is not None:
        # A whole batch: ActNorm initialises itself from its statistics, as taming's does.
        disc_init = executables.jit(
            config, "discriminator_init", _keyed(model["discriminator"].init, 1), keep_outputs=True
        )
        disc_vars = disc_init(rng, images)
        params["discriminator"] = disc_vars["params"]
        batch_stats = disc_vars.get("batch_stats", {})
        disc_opt_state = executables.jit(config, "discriminator_optimizer_init", disc_tx.init)(
            params["discriminator"]
        )
    if model["lpips"] is not None:
        lpips_params = lpips.load_variables(config.lpips.weights)
        logging.info("LPIPS weights from %s", config.lpips.weights)
    return TrainState(
        step=np.zeros((), np.int32),  # a host value: no program compiled for it
        params=params,
        quantizer_state=variables.get("vq_state", {}),
        opt_state=executables.jit(config, "optimizer_init", tx.init)(params["autoencoder"]),
        disc_opt_state=disc_opt_state,
        batch_stats=batch_stats,
        lpips_params=lpips_params,
    )


def abstract_batch(config, batch_size: int) -> dict:
    """A train batch's shapes and dtypes, for compiling without data (``attnjax.compile``): the
    data pipeline's batch, labels included (the step does not read them), so that the program
    compiled is the one train.py runs."""
    ddconfig = config.model.ddconfig
    size = config.data.get("image_size") or ddconfig.resolution
    shape = (batch_size, size, size, ddconfig.in_channels)
    return {
        "image": jax.ShapeDtypeStruct(shape, jnp.float32),
        "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }


def _rgb(x):
    return jnp.repeat(x, 3, axis=-1) if x.shape[-1] == 1 else x


def _perceptual_fn(state, model, config):
    if not perceptual_weight(config):
        return None
    return lambda a, b: model["lpips"].apply(state.lpips_params, _rgb(a), _rgb(b))


def _autoencoder_gradients(state: TrainState, x, rng, *, autoencoder, model, config):
    """The autoencoder's loss (``vqgan_loss.generator_loss``) and its gradient ->
    ``((loss, (log, stats, rec, latents, vq_state)), grads)``."""
    disc, step, loss_config = model["discriminator"], state.step, config.loss
    perceptual = _perceptual_fn(state, model, config)
    disc_start = int(loss_config.get("disc_start", 0))

    def discriminator(images):
        variables = {"params": state.params["discriminator"], "batch_stats": state.batch_stats}
        return disc.apply(variables, images, train=True, mutable=["batch_stats"])[0]

    def loss_fn(ae_params):
        variables = {"params": ae_params, "vq_state": state.quantizer_state}
        (rec, aux), updated = autoencoder.apply(
            variables, x, train=True, mutable=["vq_state", "intermediates"], rngs={"dropout": rng}
        )
        features = updated["intermediates"]["decoder"]["pre_conv_out"][0]
        loss, log = vqgan_loss.generator_loss(
            x,
            rec,
            aux["loss"],
            discriminator=discriminator if disc is not None else None,
            step=step,
            last_layer=(features, ae_params["decoder"]["conv_out"]["kernel"]),
            perceptual=perceptual,
            perceptual_weight=perceptual_weight(config),
            codebook_weight=loss_config.get("codebook_weight", 1.0),
            disc_start=disc_start,
            disc_factor=loss_config.get("disc_factor", 1.0),
            disc_weight=loss_config.get("disc_weight", 0.0),
        )
        stats = {k: aux[k] for k in ("perplexity", "codebook_usage")}
        return loss, (log, stats, rec, aux["latents"], updated.get("vq_state", {}))

    return jax.value_and_grad(loss_fn, has_aux=True)(state.params["autoencoder"])


def train_step(state: TrainState, batch, rng, *, config, model, axis_name=None):
    autoencoder, disc = model["autoencoder"], model["discriminator"]
    if axis_name is not None:
        # Under pmap the quantizer's batch statistics (usage, LFQ's entropy of the mean code
        # distribution) must span every device's examples, not one device's.
        autoencoder = autoencoder.clone(
            quantizer={**(autoencoder.quantizer or {}), "axis_name": axis_name}
        )
    tx, disc_tx = _optimizers(config)
    x, step, loss_config = batch["image"], state.step, config.loss
    (loss, (log, stats, rec, latents, vq_state)), grads = _autoencoder_gradients(
        state, x, rng, autoencoder=autoencoder, model=model, config=config
    )
    metrics = {"loss": loss, **log, **stats}
    if axis_name is not None:
        grads, metrics, vq_state = jax.lax.pmean((grads, metrics, vq_state), axis_name)
        latents = jax.lax.all_gather(latents, axis_name, tiled=True)
    updates, opt_state = tx.update(grads, state.opt_state, state.params["autoencoder"])
    params = dict(
        state.params, autoencoder=optax.apply_updates(state.params["autoencoder"], updates)
    )
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["learning_rate"] = optim.learning_rate_at(config, step)

    disc_opt_state, batch_stats = state.disc_opt_state, state.batch_stats
    if disc is not None:
        params, disc_opt_state, batch_stats, disc_metrics = _discriminator_update(
            state, params, x, jax.lax.stop_gradient(rec), disc, disc_tx, loss_config, axis_name
        )
        metrics.update(disc_metrics)

    if _reseeds(config):
        # The same key on every device: the reseeded codebook must stay replicated.
        key = jax.random.fold_in(jax.random.PRNGKey(config.seed + 1), step)
        autoencoder_params, vq_state, reseeded = vector_quantizer.reseed_dead_codes(
            params["autoencoder"], vq_state, latents, key, config.reseed_threshold
        )
        params = dict(params, autoencoder=autoencoder_params)
        metrics["reseeded_codes"] = reseeded.astype(jnp.float32)
    new_state = state.replace(
        step=step + 1,
        params=params,
        quantizer_state=vq_state,
        opt_state=opt_state,
        disc_opt_state=disc_opt_state,
        batch_stats=batch_stats,
    )
    new_state, metrics["nonfinite"] = optim.guard_nonfinite(
        state, new_state, metrics["loss"], metrics["grad_norm"], config.get("nonfinite", "stop")
    )
    return new_state, metrics


def _discriminator_loss(logits_real, logits_fake, step, loss_config):
    """``vqgan_loss.discriminator_loss`` with the config's settings (training and eval share it)."""
    return vqgan_loss.discriminator_loss(
        logits_real,
        logits_fake,
        step=step,
        disc_start=int(loss_config.get("disc_start", 0)),
        disc_factor=loss_config.get("disc_factor", 1.0),
        kind=loss_config.get("disc_loss", "hinge"),
    )


def _discriminator_update(state, params, x, rec, disc, disc_tx, loss_config, axis_name):

    def d_loss_fn(d_params):
        # Real and fake in separate calls, as taming: each gets its own batch statistics.
        real, updated = disc.apply(
            {"params": d_params, "batch_stats": state.batch_stats},
            x,
            train=True,
            mutable=["batch_stats"],
        )
        fake, updated = disc.apply(
            {"params": d_params, **updated}, rec, train=True, mutable=["batch_stats"]
        )
        loss, log = _discriminator_loss(real, fake, state.step, loss_config)
        return loss, (log, updated["batch_stats"])

    # Before disc_start the loss is 0 x the d-loss: zero gradients, and Adam's update of zero
    # moments is zero, so the discriminator stays put (its BatchNorm statistics move, as taming's).
    (_, (log, batch_stats)), grads = jax.value_and_grad(d_loss_fn, has_aux=True)(
        params["discriminator"]
    )
    if axis_name is not None:
        grads, log, batch_stats = jax.lax.pmean((grads, log, batch_stats), axis_name)
    updates, opt_state = disc_tx.update(grads, state.disc_opt_state, params["discriminator"])
    return (
        dict(params, discriminator=optax.apply_updates(params["discriminator"], updates)),
        opt_state,
        batch_stats,
        log,
    )


def _to_unit_range(images, data_config):
    return data.denormalize(images, data_config)


def eval_step(state: TrainState, batch, *, config, model):
    autoencoder, disc = model["autoencoder"], model["discriminator"]
    x, mask = batch["image"], batch["mask"]
    rec, aux = autoencoder.apply(_autoencoder_variables(state.params, state.quantizer_state), x)
    per_image = lambda v: jnp.mean(v, axis=tuple(range(1, v.ndim)))
    l1 = per_image(jnp.abs(x - rec))
    mse = per_image(
        (_to_unit_range(x, config.data) - jnp.clip(_to_unit_range(rec, config.data), 0.0, 1.0)) ** 2
    )
    psnr = -10.0 * jnp.log10(jnp.maximum(mse, 1e-10))
    count = jnp.sum(mask)
    sums = {"l1": jnp.sum(l1 * mask), "psnr": jnp.sum(psnr * mask), "count": count}
    sums.update(_similarities(state, x, rec, mask, config=config, model=model))
    indices = aux["indices"]
    codebook = vector_quantizer.codebook_statistics(indices, autoencoder.n_embed, mask)
    sums["perplexity"] = codebook["perplexity"] * count
    sums["codebook_usage"] = codebook["codebook_usage"] * count
    if disc is not None:
        disc_vars = {"params": state.params["discriminator"], "batch_stats": state.batch_stats}
        real, fake = disc.apply(disc_vars, x), disc.apply(disc_vars, rec)
        # One image at a time through the training losses: their batch means are means over
        # images too, so sum / count over the real examples is the loss of the whole eval set.
        one = lambda a: a[None]
        g_loss = jax.vmap(lambda f: vqgan_loss.adversarial_generator_loss(one(f)))(fake)
        d_loss = jax.vmap(
            lambda r, f: _discriminator_loss(one(r), one(f), state.step, config.loss)[0]
        )(real, fake)
        sums["g_loss"] = jnp.sum(g_loss * mask)
        sums["disc_loss"] = jnp.sum(d_loss * mask)
    return sums


def _similarities(state: TrainState, x, rec, mask, *, config, model) -> dict:
    """Sums over the real examples of ``ssim`` (pixels in [0, 1], the reconstruction clipped as
    for PSNR; images at least as large as its 11-pixel window) and ``lpips`` (with LPIPS
    weights; on the model's scale, as the perceptual term reads it)."""
    sums = {}
    if min(x.shape[1:3]) >= len(ssim.gaussian_window(1.5, 3.5)):
        pixels = _to_unit_range(x, config.data)
        rec_pixels = jnp.clip(_to_unit_range(rec, config.data), 0.0, 1.0)
        sums["ssim"] = jnp.sum(ssim.ssim(rec_pixels, pixels, data_range=1.0) * mask)
    if model["lpips"] is not None:
        distance = model["lpips"].apply(state.lpips_params, _rgb(rec), _rgb(x))
        sums["lpips"] = jnp.sum(distance * mask)
    return sums


_COMPILED: dict = {}


def compiled_method(model: vqgan.VQGAN, method_name: str):
    """``jit(partial(model.apply, method=...))``, built once per module and method so that an
    evaluation reuses the compiled function. Modules holding config dicts are not hashable:
    they are keyed by identity, and kept here so that the identity is never reused."""
    key = (id(model), method_name)
    if key not in _COMPILED:
        _COMPILED[key] = (
            model,
            jax.jit(functools.partial(model.apply, method=getattr(type(model), method_name))),
        )
    return _COMPILED[key][1]


def write_images(state: TrainState, batch, *, config, model, workdir, step):
    """``reconstructions.png``: rows of 16 inputs, each followed by its row of reconstructions."""
    n = min(32, int(np.sum(batch["mask"])))
    x = jnp.asarray(batch["image"][:n])
    variables = _autoencoder_variables(state.params, state.quantizer_state)
    rec, _ = compiled_method(model["autoencoder"], "__call__")(variables, x)
    inputs, recs = (np.asarray(_to_unit_range(a, config.data)) for a in (x, rec))
    columns = 16
    pairs = []
    for start in range(0, n, columns):
        pairs += [inputs[start : start + columns], recs[start : start + columns]]
    save_image_grid(
        np.concatenate(pairs), storage.join(workdir, "reconstructions.png"), columns, scale=4
    )


def decode_every_code(model: vqgan.VQGAN, variables, grid_shape) -> np.ndarray:
    """Each code decoded alone (a token grid filled with it): ``[n_embed, H, W, C]``."""
    indices = jnp.broadcast_to(
        jnp.arange(model.n_embed)[:, None, None], (model.n_embed, *grid_shape)
    )
    return np.asarray(compiled_method(model, "decode_indices")(variables, indices))


def finalize(state: TrainState, metrics, *, config, model, workdir):
    """``codebook.png``: every code decoded alone, in index order; ``eval/rfid`` when
    ``config.fid`` names a feature network."""
    autoencoder = model["autoencoder"]
    size = config.data.image_size // autoencoder.downsample_factor
    variables = _autoencoder_variables(state.params, state.quantizer_state)
    decoded = np.asarray(
        _to_unit_range(decode_every_code(autoencoder, variables, (size, size)), config.data)
    )
    save_image_grid(decoded, storage.join(workdir, "codebook.png"), 16, scale=3)
    counts = data.unreadable_metrics(config.data)
    if not image_metrics.enabled(config) or jax.process_index() != 0:
        return counts
    return {**counts, **reconstruction_fid(autoencoder, variables, config)}


def reconstruction_fid(autoencoder: vqgan.VQGAN, variables, config) -> dict:
    """``eval/rfid``: the reconstructions of the first ``config.fid.num_images`` eval images
    against those images (``attnjax.tasks.image_metrics``), and ``eval/rfid_n``."""
    images = image_metrics.first_images(config.data, config.data.eval_split, config.fid.num_images)
    reconstruct = compiled_method(autoencoder, "__call__")
    reconstructions = image_metrics.in_batches(
        lambda x: reconstruct(variables, x)[0], images, config.fid.batch_size
    )
    pixels = [np.asarray(_to_unit_range(x, config.data)) for x in (reconstructions, images)]
    value = image_metrics.fid(config, *pixels, "eval/rfid")
    return {"eval/rfid": value, "eval/rfid_n": len(images)}
