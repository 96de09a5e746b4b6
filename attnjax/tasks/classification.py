"""Image classification with a ViT: cross-entropy with label smoothing, accuracy, optional EMA.

Batches: ``{"image": float32 [batch, H, W, C], "label": int32 [batch]}`` (+ ``"mask"`` at eval).
Config: ``model_name`` ("vit"), ``model`` (kwargs of ``attnjax.models.vit.create_vit``, ``variant``
for a named variant), ``compute_dtype`` ("float32" or "bfloat16" activations), ``init_from``
(optional pretrained params, see ``load_pretrained``) and ``init_head``, ``label_smoothing``, and
the optimiser fields of ``attnjax.train.optim``. A run of image files records its class names in
``config.data.class_names`` (so in ``config.json``): label ``i`` is the ``i``-th.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from attnjax import data, storage
from attnjax.convert import vit_checkpoint
from attnjax.data.images import save_labelled_grid
from attnjax.metrics.features import FeatureExtractor
from attnjax.models import vit
from attnjax.ops import positional
from attnjax.parallel import sharding
from attnjax.train import checkpoint, executables, hashed_init, optim, precision

MODELS = {"vit": vit.create_vit}
# Config fields that define the model a checkpoint holds (a resumed run must agree on them).
IDENTITY_FIELDS = ("model_name", "model")
# Train-state fields besides the params that inference needs: none, the ViT keeps no statistics.
VARIABLE_FIELDS = ()
# Every array split over the fsdp axis, scalars and the class-count head bias whole; with a
# model axis, the attention and MLP layers split over it by their logical axes (Megatron's layout).
SHARDING_RULES = (
    sharding.WHOLE_SCALARS,
    *sharding.logical_rules(vit.PARAM_AXES),
    sharding.SPLIT_REST,
)


TrainState = optim.TrainState


def create_model(config) -> nn.Module:
    name = config.get("model_name", "vit")
    if name not in MODELS:
        raise ValueError(
            f"config.model_name={name!r} is not a known classifier; expected one of "
            f"{sorted(MODELS)}."
        )
    kwargs = config.model.to_dict()
    variant = kwargs.pop("variant", None) or None
    if precision.compute_dtype(config) is not None:
        kwargs.setdefault("dtype", precision.compute_dtype(config))
    return MODELS[name](variant, **kwargs)


def complete_config(config) -> None:
    """Image files: their class names (class folders, sorted) into ``config.data.class_names``,
    and their count into ``config.model.num_classes`` where that is 0."""
    names = data.class_names(config.data)
    if names:
        with config.data.unlocked():  # train.py's config is locked, and older ones lack the field
            config.data.class_names = tuple(names)
    if config.model.get("num_classes", None) != 0:
        return
    classes = data.num_classes(config.data)
    if classes < 2:
        raise ValueError(
            f"config.model.num_classes=0 takes the class folders of config.data.name="
            f"{config.data.name!r}, which has {classes}; expected at least 2 classes"
        )
    config.model.num_classes = classes


def label_smoothed_cross_entropy(logits, labels, label_smoothing: float = 0.0):
    """Per-example softmax cross-entropy against one-hot labels smoothed by ``label_smoothing``.

    logits ``[batch, num_classes]``, labels int ``[batch]`` -> ``[batch]`` (float32).
    """
    num_classes = logits.shape[-1]
    targets = optax.smooth_labels(jax.nn.one_hot(labels, num_classes), label_smoothing)
    return optax.softmax_cross_entropy(logits.astype(jnp.float32), targets)


def _read_params(path: str, model) -> dict:
    """Flat ``{"a/b/kernel": array}`` of attnjax ViT params from a timm state-dict file or either
    ``.npz`` layout."""
    if path.endswith(vit_checkpoint.STATE_DICT_SUFFIXES):
        return vit_checkpoint.read_params(path, model.num_heads)
    with np.load(path, allow_pickle=False) as npz:
        flat = {k: npz[k] for k in npz.files if k != vit_checkpoint.METADATA}
    if any(k == "embedding/kernel" or k.endswith("/embedding/kernel") for k in flat):
        # A Google (big_vision / original ViT) checkpoint: convert its names first, with the
        # numpy-only reader (imported here: most runs never read one).
        from attnjax.convert import google_npz

        _, variables = google_npz.load_google_npz(path, scan_layers=model.scan_layers)
        return flax.traverse_util.flatten_dict(variables["params"], sep="/")
    return {k.removeprefix("params/"): v for k, v in flat.items()}


def _adapt_position_table(
    old: np.ndarray, new_shape: tuple, new_prefix: int, path: str
) -> np.ndarray:
    """A checkpoint's learned position table ``[1, tokens, width]`` fitted to the model's.

    The checkpoint's own prefix-token count is what its table holds beyond a square grid (a
    big_vision table covers only the patches, an original-ViT table the class token too). The
    grid is resampled when its size differs. A class-token row the checkpoint lacks is added as
    zeros: the class token then enters the encoder exactly as it did in the checkpoint.
    """
    tokens = old.shape[1]
    old_prefix = tokens - math.isqrt(tokens) ** 2
    if old_prefix > new_prefix:
        raise ValueError(
            f"config.init_from={path!r}: its position table covers {old_prefix} prefix token(s) "
            f"({tokens} = {old_prefix} + {math.isqrt(tokens)}^2), the model's covers {new_prefix}; "
            "build the model with the checkpoint's class_token/no_embed_class settings."
        )
    grid = math.isqrt(new_shape[1] - new_prefix)
    if tokens - old_prefix != grid * grid:
        old = np.asarray(
            positional.resize_position_embedding(old, (grid, grid), num_prefix_tokens=old_prefix)
        )
    zeros = np.zeros((1, new_prefix - old_prefix, old.shape[2]), old.dtype)
    return np.concatenate([old[:, :old_prefix], zeros, old[:, old_prefix:]], axis=1)


def load_pretrained(config, model, params):
    """Replaces ``params`` by the checkpoint at ``config.init_from`` (if set).

    ``init_from`` is an ``.npz`` either of attnjax params flattened with "/"-joined keys
    (``pos_embed/pos_embedding``, ``blocks_0/attn/query/kernel``, ...; what
    ``python -m attnjax.convert.vit_checkpoint`` writes), a Google ViT checkpoint, or a timm
    state dict (``.pth``/``.pt``/``.bin``/``.safetensors``, converted on the way). The head
    stays freshly initialised (new classes) unless ``config.init_head`` is True and the
    checkpoint's head has the model's shape (timm's rule: the same class count); a position
    table of another grid size or prefix-token count is fitted by ``_adapt_position_table``.
    Any other missing or mismatched parameter is an error (a silent partial load would train
    from scratch unnoticed).
    """
    path = config.get("init_from", "")
    if not path:
        return params
    if not os.path.exists(path):
        raise FileNotFoundError(f"config.init_from={path!r} does not exist.")
    flat_old = _read_params(path, model)
    flat_new = flax.traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
    head = [k for k in flat_new if k.startswith("head/")]
    keep_head = bool(config.get("init_head", False)) and all(
        k in flat_old and np.shape(flat_old[k]) == flat_new[k].shape for k in head
    )
    missing = sorted(k for k in flat_new if k not in flat_old and not k.startswith("head/"))
    if missing:
        raise ValueError(
            f"config.init_from={path!r} lacks {len(missing)} parameter(s) of the "
            f"model, e.g. {missing[:4]}; is it the same architecture?"
        )
    for key, value in flat_new.items():
        if key.startswith("head/") and not keep_head:
            continue
        old = np.asarray(flat_old[key])
        if old.shape != value.shape and key.endswith("pos_embedding"):
            old = _adapt_position_table(
                old, value.shape, int(model.class_token and not model.no_embed_class), path
            )
        if old.shape != value.shape:
            raise ValueError(
                f"config.init_from: {key} has shape {old.shape}, the model expects {value.shape}."
            )
        flat_new[key] = old.astype(value.dtype)
    logging.info(
        "init_from %s: loaded %d arrays, %s head",
        path,
        len(flat_new) - (0 if keep_head else len(head)),
        "its" if keep_head else "a fresh",
    )
    return flax.traverse_util.unflatten_dict(flat_new, sep="/")


def make_optimizer(config) -> optax.GradientTransformation:
    """The config's optimiser; ``config.layer_decay`` goes by the ViT's ``layer_depths``."""
    return optim.make_optimizer(config, layer_depths=vit.layer_depths)


def create_train_state(rng, config, model, example_batch) -> TrainState:
    sharding.check_model_axis(
        config,
        num_heads=model.num_heads,
        mlp_dim=model.mlp_dim or int(model.width * model.mlp_ratio),
    )
    images = example_batch["image"][:1]
    init = hashed_init.hashed_together(lambda r, x: model.init(r, x, train=False)["params"])
    params = executables.jit(config, "init", init, keep_outputs=True)(rng, images)
    params = load_pretrained(config, model, params)
    tx = make_optimizer(config)
    ema = params if config.get("ema_decay", 0.0) else None
    # One compiled init instead of dozens of eagerly dispatched (and compiled) small ops.
    return TrainState(
        step=np.zeros((), np.int32),  # a host value: no program compiled for it
        params=params,
        opt_state=executables.jit(config, "optimizer_init", tx.init)(params),
        ema_params=ema,
    )


def abstract_batch(config, batch_size: int) -> dict:
    """A train batch's shapes and dtypes, for compiling without data (``attnjax.compile``)."""
    model = create_model(config)  # its variant may fix the image size
    size = config.data.get("image_size") or model.image_size
    if not size:
        raise ValueError(
            "config.model.image_size and config.data.image_size are unset (native size); "
            "set one to compile without the data."
        )
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    channels = model.in_channels
    return {
        "image": jax.ShapeDtypeStruct((batch_size, height, width, channels), jnp.float32),
        "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }


def train_step(state: TrainState, batch, rng, *, config, model, axis_name=None):
    tx = make_optimizer(config)

    def loss_fn(params):
        logits = model.apply({"params": params}, batch["image"], train=True, rngs={"dropout": rng})
        loss = label_smoothed_cross_entropy(
            logits, batch["label"], config.get("label_smoothing", 0.0)
        )
        return loss.mean(), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    metrics = {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}
    return optim.apply_gradients(state, grads, metrics, config=config, tx=tx, axis_name=axis_name)


def eval_step(state: TrainState, batch, *, config, model):
    params = state.params if state.ema_params is None else state.ema_params
    logits = model.apply({"params": params}, batch["image"], train=False)
    mask = batch["mask"]
    loss = label_smoothed_cross_entropy(logits, batch["label"], config.get("label_smoothing", 0.0))
    correct = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
    return {
        "loss": jnp.sum(loss * mask),
        "accuracy": jnp.sum(correct * mask),
        "count": jnp.sum(mask),
    }


@functools.lru_cache(maxsize=4)
def _predict_fn(model):
    """One compiled ``apply`` per model (every eval batch has the same shape)."""
    return jax.jit(functools.partial(model.apply, train=False))


def write_images(state: TrainState, batch, *, config, model, workdir, step):
    """``eval_images.png``: the first eval images labelled ``predicted/true`` (red when wrong)."""
    params = state.params if state.ema_params is None else state.ema_params
    n = min(32, int(np.sum(batch["mask"])))
    predictions = np.asarray(
        jnp.argmax(_predict_fn(model)({"params": params}, batch["image"]), -1)
    )[:n]
    labels = np.asarray(batch["label"][:n])
    save_labelled_grid(
        data.denormalize(np.asarray(batch["image"][:n]), config.data),
        [f"{p}/{t}" for p, t in zip(predictions, labels)],
        storage.join(workdir, "eval_images.png"),
        title=f"predicted/true, step {step}",
        alarms=predictions != labels,
    )


def finalize(state: TrainState, metrics, *, config, model, workdir):
    """``data/unreadable_files``: the files ``config.data.skip_unreadable`` left out."""
    return data.unreadable_metrics(config.data)


def make_predict(workdir: str, **load_kwargs) -> tuple[Any, Any]:
    """``(config, predict)`` for a classification run: ``predict(images) -> logits``.

    ``images``: float ``[batch, H, W, C]`` normalised like the run's eval data
    (``attnjax.data``); ``logits``: ``[batch, num_classes]``. ``predict`` is jit-compiled with
    the parameters closed over (one compilation per input shape). ``load_kwargs`` go to
    ``attnjax.train.checkpoint.load`` (``step``, ``best``, ``use_ema``).
    """
    config, model_variables = checkpoint.load(workdir, variables=VARIABLE_FIELDS, **load_kwargs)
    model = create_model(config)

    @jax.jit
    def predict(images):
        return model.apply(model_variables, images, train=False)

    return config, predict


PRE_LOGITS = "pre_logits"


def feature_extractor(workdir: str, batch_size: int = 256, **load_kwargs) -> FeatureExtractor:
    """A classification run's pre-logits ``[b, width]`` (the pooled features its head reads) as
    a ``FeatureExtractor`` output named ``PRE_LOGITS``: a domain FID's network.

    It takes images ``[b, H, W, C]`` in [0, 1] at the run's size and channels and normalises
    them as the run's data were."""
    config, variables = checkpoint.load(workdir, variables=VARIABLE_FIELDS, **load_kwargs)
    model = create_model(config)

    def pre_logits(variables, images):
        normalised = data.normalize(images, config.data)
        return {PRE_LOGITS: model.apply(variables, normalised, return_aux=True)[1][PRE_LOGITS]}

    return FeatureExtractor(pre_logits, variables, batch_size)
