"""Training tasks: what a run optimises, selected by ``config.task``.

The generic loop (``attnjax.train.loop``: progress bar, logging, eval
schedule, checkpoints, resume, data parallelism) is written once; a task is a module that
supplies the model-specific parts as free functions. ``train.py`` only parses flags.

A task module provides (``model`` is whatever ``create_model`` returns: one ``nn.Module`` or
any container of them, e.g. a dict ``{"autoencoder": ..., "discriminator": ...}``)::

    create_model(config) -> model

    create_train_state(rng, config, model, example_batch) -> state
        ``state`` is a ``flax.struct.dataclass`` pytree of arrays with at least ``step``
        (int32 scalar) and ``params``; anything else the task needs (``opt_state`` or several,
        ``batch_stats``, ``ema_params``, ...). ``example_batch`` is one host batch (dict of
        numpy arrays, leading dim = per-process batch) for shape inference. Static things
        (the model, the optax transformation) stay out of the state: rebuild them from the
        config (``attnjax.train.optim.make_optimizer``) inside the step functions.

    train_step(state, batch, rng, *, config, model, axis_name=None) -> (state, metrics)
        Pure and jit-able. ``batch`` is a dict of arrays ``[batch, ...]``; ``rng`` is a key
        already folded with the step (and, under pmap, with the device index). With
        ``axis_name=None`` the batch is the global batch (jit + NamedSharding: XLA inserts the
        collectives); with ``axis_name="data"`` it runs under ``jax.pmap`` on one device's
        slice and must ``lax.pmean`` gradients, batch statistics and metrics over that axis.
        ``metrics``: dict of float scalars, logged as ``train/<name>`` (include
        ``learning_rate``). Several optimisers may be stepped here; gating by step
        (e.g. a discriminator start) is ``jnp.where``/``lax.cond`` on ``state.step``.

    eval_step(state, batch, *, config, model) -> sums
        Pure and jit-able. ``batch["mask"]`` is 1.0 for real examples and 0.0 for the padding
        that completes the last eval batch; return a dict of per-example metric SUMS over the
        real examples plus ``"count"`` (the number of real examples). The loop adds the sums
        across batches and devices and logs ``eval/<name> = sum / count``. Use EMA params here
        when the task keeps them.

Optional::

    SHARDING_RULES: tuple of (regex, spec) pairs
        How the train state is laid out over the mesh (``attnjax.parallel.sharding``; its
        ``WHOLE_SCALARS`` and ``SPLIT_REST`` are the usual building blocks). Defaults to
        everything replicated; ``config.partition_rules`` overrides it.

    IDENTITY_FIELDS: tuple of config field names
        The fields besides ``task`` that define the model a checkpoint holds: resuming in a
        workdir whose checkpoints disagree on one of them is refused. Defaults to
        ``("model",)``.

    VARIABLE_FIELDS: tuple of train-state field names
        The fields besides ``params`` that inference needs (BatchNorm statistics, a
        quantizer's state): ``attnjax.train.checkpoint.load(workdir, variables=...)`` takes
        them. Not read by the loop.

    make_datasets(config, *, process_index, process_count) -> attnjax.data.Datasets
        Defaults to ``attnjax.data.make_datasets`` (TFDS ``data_source`` + grain). A task whose
        data is derived (e.g. VQGAN code indices, cached on disk) builds its own grain pipeline
        and returns the same ``Datasets`` (an infinite, batched train ``grain.MapDataset``
        whose iterator state is checkpointed, and a finite padded eval ``MapDataset`` from
        ``attnjax.data.padded_eval_dataset``).

    complete_config(config) -> None
        Called before the loop starts: fills in fields the data decides (the classifier's class
        count from a folder's class folders), so that ``config.json`` holds them.

    write_images(state, batch, *, config, model, workdir, step) -> None
        Called after each evaluation with the first eval batch (host numpy); writes PNGs under
        ``workdir`` (e.g. reconstructions, samples, predicted vs true labels).

    finalize(state, metrics, *, config, model, workdir) -> dict
        Called once after the last step with the final eval metrics; may write end-of-run
        artefacts and return extra metrics to merge into the result.

Config fields the loop reads for every task: ``seed``, ``num_train_steps``, ``batch_size``
(global), ``log_every``, ``eval_every``, ``checkpoint_every``, ``max_to_keep``,
``best_metric`` (``""`` or an ``eval/`` metric name, e.g. ``"eval/accuracy"``) with
``best_mode`` (``"max"``/``"min"``), ``parallel`` (``"jit"``/``"pmap"``), ``distributed``.
"""

from __future__ import annotations

import importlib
import types

from attnjax.train import loop

# Task name -> module path; modules are imported on demand so that a classification run never
# imports the VQGAN or prior code.
TASKS = {
    "classification": "attnjax.tasks.classification",
    "vqgan": "attnjax.tasks.vqgan",
    "prior": "attnjax.tasks.prior",
}

REQUIRED = ("create_model", "create_train_state", "train_step", "eval_step")


def train_and_evaluate(config, workdir: str) -> dict:
    """Trains ``config.task`` in ``workdir`` with the shared loop (``attnjax.train.loop``),
    resuming from the workdir's latest checkpoint if any; returns the final metrics."""
    if "task" not in config:
        raise ValueError("config lacks the training-loop field 'task'.")
    task = get_task(config.task)
    if hasattr(task, "complete_config"):
        task.complete_config(config)
    return loop.train_and_evaluate(config, workdir, task)


def get_task(name: str) -> types.ModuleType:
    """Returns the task module registered as ``name`` (``config.task``)."""
    if name not in TASKS:
        raise ValueError(
            f"config.task={name!r} is not a known task; expected one of {sorted(TASKS)}."
        )
    module = importlib.import_module(TASKS[name])
    missing = [fn for fn in REQUIRED if not hasattr(module, fn)]
    if missing:
        raise ValueError(
            f"task module {TASKS[name]} lacks {missing}; see attnjax/tasks/__init__.py."
        )
    return module
