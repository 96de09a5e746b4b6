"""The transformer prior over VQGAN codes: cross-entropy on code sequences, class-conditional.

The data are the codes of a trained VQGAN (``config.vqgan_workdir``): its dataset encoded once
to token grids and cached on disk (``attnjax.tasks.vqgan_codes``), next to the VQGAN
(``<vqgan_workdir>/codes/``) unless ``config.codes_cache_dir`` says otherwise.
``config.data.train_shifts = s`` also encodes every training image shifted by each ``(dy, dx)``
in ``[-s, s]^2`` (zero fill): (2s + 1)^2 code sequences per image, an augmentation that costs
nothing per step.

Batches: ``{"codes": int32 [batch, num_tokens], "label": int32 [batch]}`` (+ ``"mask"`` at eval).
Metrics: ``loss`` (nats per token), ``bits_per_token``, ``accuracy`` (next-token top-1);
``eval/nll`` and ``eval/bits_per_token`` on the held-out split. After each evaluation,
``samples/<step>.png`` shows ``config.sampling.per_class`` samples per class (a row each),
sampled with ``config.sampling`` (temperature, top_k, top_p) and decoded by the VQGAN.

Config: ``vqgan_workdir``, ``vqgan_step`` (None: latest), ``num_classes`` (0: unconditional),
``class_dropout`` (the fraction of training sequences whose class token is replaced by the null
token, so that sampling can use classifier-free guidance ``sampling.guidance``; 0: off),
``model`` (``attnjax.models.gpt.GPT`` fields other than vocab/block size, which come from the
VQGAN),
``data.train_shifts``, ``sampling``, ``codes_cache_dir``, and the optimiser fields of
``attnjax.train.optim``.
"""

from __future__ import annotations

import grain
import jax
import jax.numpy as jnp
import numpy as np

from attnjax import data, storage
from attnjax.data.images import save_image_grid
from attnjax.models import gpt
from attnjax.models.gpt import null_tokens, prefix_tokens
from attnjax.models.sampling import sample
from attnjax.parallel import sharding
from attnjax.tasks import image_metrics
from attnjax.tasks import vqgan as vqgan_task

# The VQGAN side (its codes, images of its dataset): in vqgan_codes, importable from here too.
from attnjax.tasks.vqgan_codes import TrainedVQGAN as TrainedVQGAN
from attnjax.tasks.vqgan_codes import encode_split, load_vqgan
from attnjax.tasks.vqgan_codes import first_codes as first_codes
from attnjax.tasks.vqgan_codes import load_images as load_images
from attnjax.train import executables, hashed_init, optim, precision

# Config fields that define the model a checkpoint holds (a resumed run must agree on them).
IDENTITY_FIELDS = ("model_name", "model")
# Every array split over the fsdp axis, scalars and step counters whole; with a model axis, the
# attention, MLP, embedding and head split over it by their logical axes (Megatron's layout).
SHARDING_RULES = (
    sharding.WHOLE_SCALARS,
    *sharding.logical_rules(gpt.PARAM_AXES),
    sharding.SPLIT_REST,
)

TrainState = optim.TrainState


def _cache_dir(config, vqgan: TrainedVQGAN) -> str:
    return config.get("codes_cache_dir") or storage.join(vqgan.workdir, "codes")


# --------------------------------------------------------------------------------------------
# The task protocol (see attnjax/tasks/__init__.py)
# --------------------------------------------------------------------------------------------


def code_space(config) -> tuple[int, tuple[int, int]]:
    """``(codebook size, token grid (h, w))`` of the VQGAN's codes: from its run, or, where
    ``config.vqgan_workdir`` holds no checkpoints, from ``config.vqgan_codes`` (``n_embed`` and
    ``grid``), which lets ``attnjax.compile`` size a prior without a trained VQGAN."""
    given = config.get("vqgan_codes") or {}
    n_embed, grid = int(given.get("n_embed", 0)), tuple(given.get("grid", ()))
    workdir = config.get("vqgan_workdir") or ""
    if n_embed and all(grid) and not storage.isdir(storage.join(workdir, "checkpoints")):
        return n_embed, (int(grid[0]), int(grid[1]))
    vqgan = load_vqgan(workdir, config.get("vqgan_step"))
    trained = (vqgan.model.n_embed, tuple(vqgan.grid_shape))
    if n_embed and (n_embed, grid) != trained:
        raise ValueError(
            f"config.vqgan_codes={dict(n_embed=n_embed, grid=grid)} but the VQGAN in "
            f"{workdir!r} has n_embed={trained[0]}, grid={trained[1]}."
        )
    return trained


def create_model(config) -> gpt.GPT:
    """A ``GPT`` over the VQGAN's codes: vocab = codes + class tokens, block = the token grid."""
    n_embed, (height, width) = code_space(config)
    return gpt.GPT(
        vocab_size=gpt.vocab_size(n_embed, config.num_classes, trained_with_null_class(config)),
        block_size=height * width,
        dtype=precision.compute_dtype(config),
        **config.model.to_dict(),
    )


class _Records:
    """Random access to ``{"codes": [n], "label": []}`` examples of in-memory arrays."""

    def __init__(self, codes, labels):
        self.codes, self.labels = codes, labels

    def __len__(self):
        return len(self.codes)

    def __getitem__(self, index):
        return {"codes": self.codes[index], "label": self.labels[index]}


def make_datasets(config, *, process_index: int = 0, process_count: int = 1) -> data.Datasets:
    """Grain pipelines over the cached codes (train: shuffled, repeated; eval: padded)."""
    vqgan = load_vqgan(config.vqgan_workdir, config.get("vqgan_step"))
    cache_dir = _cache_dir(config, vqgan)
    split = vqgan.config.data
    train_codes, train_labels = encode_split(
        vqgan, split.train_split, shifts=config.data.get("train_shifts", 0), cache_dir=cache_dir
    )
    eval_codes, eval_labels = encode_split(vqgan, split.eval_split, cache_dir=cache_dir)
    _check_labels(config, train_labels, eval_labels)
    eval_batch = data.per_process_batch_size(
        config.get("eval_batch_size") or config.batch_size, process_count, "config.eval_batch_size"
    )

    train = grain.MapDataset.source(_Records(train_codes, train_labels))
    if len(train) < config.batch_size:
        raise ValueError(
            f"config.batch_size={config.batch_size} is larger than the {len(train)} code sequences."
        )
    train = data.process_batches(
        train.seed(config.seed).shuffle().repeat(None),
        config.batch_size,
        process_index,
        process_count,
    )

    evaluation = data.padded_eval_dataset(
        _Records(eval_codes, eval_labels),
        eval_batch,
        process_index=process_index,
        process_count=process_count,
    )
    return data.Datasets(
        train=train,
        eval=evaluation,
        num_train_examples=len(train_codes),
        num_eval_examples=len(eval_codes),
    )


def _check_labels(config, *label_arrays):
    if config.num_classes <= 0:
        return
    largest = max(int(labels.max()) for labels in label_arrays)
    if largest >= config.num_classes:
        raise ValueError(
            f"config.num_classes={config.num_classes} but the VQGAN's dataset has label {largest}"
        )


def create_train_state(rng, config, model, example_batch) -> TrainState:
    image_metrics.check_config(config)  # before training, not after it
    sharding.check_model_axis(  # minGPT's MLP is 4 x n_embd wide
        config, n_head=model.n_head, mlp_dim=4 * model.n_embd, vocab_size=model.padded_vocab_size
    )
    codes = example_batch["codes"][:1]
    init = executables.jit(
        config,
        "init",
        hashed_init.hashed_together(lambda r, x: model.init(r, x)["params"]),
        keep_outputs=True,
    )
    params = init(rng, codes)
    tx = optim.make_optimizer(config)
    ema = params if config.get("ema_decay", 0.0) else None
    return TrainState(
        step=np.zeros((), np.int32),  # a host value: no program compiled for it
        params=params,
        opt_state=executables.jit(config, "optimizer_init", tx.init)(params),
        ema_params=ema,
    )


def abstract_batch(config, batch_size: int) -> dict:
    """A train batch's shapes and dtypes, for compiling without data (``attnjax.compile``)."""
    _, (height, width) = code_space(config)
    return {
        "codes": jax.ShapeDtypeStruct((batch_size, height * width), jnp.int32),
        "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }


def sample_step(state: TrainState, batch, rng, *, config, model):
    """Code grids ``[batch, h, w]`` for ``batch["label"]`` with ``config.sampling``: the sampler
    as ``attnjax.compile`` compiles it (what sampling costs per eval batch)."""
    n_embed, grid = code_space(config)
    labels = batch["label"] if config.num_classes else None
    return sample_codes(
        model,
        _eval_params(state),
        labels,
        rng,
        grid_shape=grid,
        codebook_size=n_embed,
        num_classes=config.num_classes,
        num_samples=batch["label"].shape[0],
        temperature=config.sampling.temperature,
        top_k=config.sampling.get("top_k"),
        top_p=config.sampling.get("top_p"),
        guidance=sampling_guidance(config),
    )


def trained_with_null_class(config) -> bool:
    return config.num_classes > 0 and config.get("class_dropout", 0.0) > 0


def sampling_guidance(config) -> float | None:
    """``config.sampling.guidance`` when the prior was trained for it (a null class), else None."""
    return config.sampling.get("guidance") if trained_with_null_class(config) else None


def _codebook_size(config, model) -> int:
    return model.vocab_size - gpt.vocab_size(0, config.num_classes, trained_with_null_class(config))


def _prefix(config, model, batch, rng=None):
    """The prefix column; in training (``rng`` given) the class is hidden with ``class_dropout``."""
    codebook_size = _codebook_size(config, model)
    batch_size = batch["codes"].shape[0]
    prefix = gpt.prefix_tokens(batch["label"], codebook_size, config.num_classes, batch_size)
    if rng is not None and trained_with_null_class(config):
        hidden = jax.random.bernoulli(rng, config.class_dropout, (batch_size, 1))
        prefix = jnp.where(
            hidden, gpt.null_tokens(codebook_size, config.num_classes, batch_size), prefix
        )
    return prefix


def train_step(state: TrainState, batch, rng, *, config, model, axis_name=None):
    tx = optim.make_optimizer(config)
    codes = batch["codes"]
    dropout_rng, class_rng = jax.random.split(rng)
    prefix = _prefix(config, model, batch, class_rng)

    def loss_fn(params):
        logits = gpt.sequence_logits(
            model, params, codes, prefix, deterministic=False, rngs={"dropout": dropout_rng}
        )
        return gpt.cross_entropy(logits, codes), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    metrics = {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == codes)}
    state, metrics = optim.apply_gradients(
        state, grads, metrics, config=config, tx=tx, axis_name=axis_name
    )
    metrics["bits_per_token"] = gpt.bits_per_token(metrics["loss"])
    return state, metrics


def _eval_params(state: TrainState):
    return state.params if state.ema_params is None else state.ema_params


def eval_step(state: TrainState, batch, *, config, model):
    codes, mask = batch["codes"], batch["mask"]
    logits = gpt.sequence_logits(model, _eval_params(state), codes, _prefix(config, model, batch))
    nll = jax.vmap(lambda row, c: gpt.cross_entropy(row[None], c[None]))(logits, codes)
    correct = jnp.mean((jnp.argmax(logits, -1) == codes).astype(jnp.float32), axis=-1)
    return {
        "nll": jnp.sum(nll * mask),
        "bits_per_token": jnp.sum(gpt.bits_per_token(nll) * mask),
        "accuracy": jnp.sum(correct * mask),
        "count": jnp.sum(mask),
    }


def sample_codes(
    model: gpt.GPT,
    params,
    labels,
    rng,
    *,
    grid_shape,
    codebook_size: int,
    num_classes: int,
    num_samples: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    guidance: float | None = None,
):
    """Code grids ``[b, h, w]`` sampled in raster order; traceable (arguments as
    ``sample_images``)."""
    height, width = grid_shape
    batch = num_samples if labels is None else len(labels)
    prefix = prefix_tokens(labels, codebook_size, num_classes, batch)
    null_prefix = None if guidance is None else null_tokens(codebook_size, num_classes, batch)
    codes = sample(
        model,
        params,
        prefix,
        rng,
        height * width,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        num_codes=codebook_size,
        guidance=guidance,
        null_prefix=null_prefix,
    )
    return codes.reshape(batch, height, width)


def sample_images(
    model: gpt.GPT,
    params,
    vqgan,
    vqgan_variables,
    labels,
    rng,
    *,
    grid_shape,
    codebook_size: int,
    num_classes: int,
    num_samples: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    guidance: float | None = None,
    mean=0.5,
    std=0.5,
    path: str | None = None,
    nrow: int | None = None,
    scale: int = 1,
):
    """Sample code grids and decode them with the VQGAN: ``(codes [b, h, w], images [b, H, W, C])``.

    Args:
      model, params: the prior.
      vqgan, vqgan_variables: a ``VQGAN`` module (``decode_indices([b, h, w]) -> [b, H, W, C]``)
        and its variables; its decoding is compiled once per module, not at every call.
      labels: ``[b]`` class ids for a class-conditional prior; None for an unconditional one
        (then ``num_samples`` gives the batch).
      rng: PRNG key of the sampler.
      grid_shape: the token grid ``(h, w)``; ``h * w`` tokens are sampled in raster order.
      codebook_size, num_classes: the prior's vocabulary (see ``attnjax.models.gpt.prefix_tokens``).
      temperature, top_k, top_p, guidance: the sampler's (guidance needs a prior trained with
        a null class; see ``attnjax.models.gpt.vocab_size``).
      mean, std: the VQGAN's pixel normalisation; images are returned as ``x * std + mean``
        (in [0, 1] for a well trained model).
      path: if given, the images are saved there as a PNG grid of ``nrow`` columns.
    """
    codes = sample_codes(
        model,
        params,
        labels,
        rng,
        grid_shape=grid_shape,
        codebook_size=codebook_size,
        num_classes=num_classes,
        num_samples=num_samples,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        guidance=guidance,
    )
    decoded = vqgan_task.compiled_method(vqgan, "decode_indices")(vqgan_variables, codes)
    images = np.asarray(decoded) * np.asarray(std, np.float32) + np.asarray(mean, np.float32)
    if path is not None:
        save_image_grid(images, path, nrow or len(codes), scale)
    return codes, images


def sample_grid(
    state_or_params, config, model, rng, path: str | None = None, per_class: int | None = None
):
    """Samples of every class with ``config.sampling``: ``(labels [n], images [n, H, W, C])``.

    ``per_class`` (default ``config.sampling.per_class``) samples of each class in turn, pixels
    in [0, 1] for a well trained VQGAN; with ``path``, saved there as a PNG with a row per class.
    """
    params = (
        _eval_params(state_or_params)
        if isinstance(state_or_params, TrainState)
        else state_or_params
    )
    vqgan = load_vqgan(config.vqgan_workdir, config.get("vqgan_step"))
    sampling = config.sampling
    per_class = per_class or sampling.per_class
    classes = max(config.num_classes, 1)
    labels = (
        np.repeat(np.arange(classes, dtype=np.int32), per_class) if config.num_classes else None
    )
    images = _sample_as_configured(
        model,
        params,
        vqgan,
        config,
        labels,
        rng,
        classes * per_class,
        path=path,
        nrow=per_class,
        scale=sampling.get("png_scale", 1),
    )
    return labels, images


def _sample_as_configured(model, params, vqgan, config, labels, rng, number: int, **picture):
    """``number`` images sampled with ``config.sampling`` and decoded by ``vqgan``, pixels in
    [0, 1]; ``picture``: ``sample_images``' ``path``, ``nrow`` and ``scale``."""
    sampling = config.sampling
    return sample_images(
        model,
        params,
        vqgan.model,
        vqgan.variables,
        labels,
        rng,
        grid_shape=vqgan.grid_shape,
        codebook_size=vqgan.model.n_embed,
        num_classes=config.num_classes,
        num_samples=number,
        temperature=sampling.temperature,
        top_k=sampling.get("top_k"),
        top_p=sampling.get("top_p"),
        guidance=sampling_guidance(config),
        mean=vqgan.config.data.mean,
        std=vqgan.config.data.std,
        **picture,
    )[1]


def write_images(state: TrainState, batch, *, config, model, workdir, step):
    """``samples/<step>.png``: class-conditional samples, one row per class."""
    if jax.process_index() != 0:
        return
    storage.makedirs(storage.join(workdir, "samples"))
    path = storage.join(workdir, "samples", f"{int(step):06d}.png")
    sample_grid(state, config, model, jax.random.key(config.seed), path)


def finalize(state: TrainState, metrics, *, config, model, workdir):
    """``eval/fid`` when ``config.fid`` names a feature network."""
    if not image_metrics.enabled(config) or jax.process_index() != 0:
        return {}
    return sample_fid(_eval_params(state), config, model)


def sample_fid(params, config, model: gpt.GPT) -> dict:
    """``eval/fid``: ``config.fid.num_images`` samples (classes in turn, ``config.sampling``)
    against as many images of the VQGAN's eval split (``attnjax.tasks.image_metrics``), with
    ``eval/fid_n`` and ``eval/fid_real_n``."""
    vqgan = load_vqgan(config.vqgan_workdir, config.get("vqgan_step"))
    classes = config.num_classes
    key = jax.random.key(config.seed + 4)

    def sample_batch(indices):
        labels = (indices % classes).astype(np.int32) if classes else None
        rng = jax.random.fold_in(key, int(indices[0]))
        return _sample_as_configured(model, params, vqgan, config, labels, rng, len(indices))

    samples = image_metrics.in_batches(
        sample_batch, np.arange(config.fid.num_images), config.fid.batch_size
    )
    data_config = vqgan.config.data
    real = image_metrics.first_images(data_config, data_config.eval_split, config.fid.num_images)
    value = image_metrics.fid(config, samples, data.denormalize(real, data_config), "eval/fid")
    return {"eval/fid": value, "eval/fid_n": len(samples), "eval/fid_real_n": len(real)}
