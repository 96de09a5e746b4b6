"""Optimisers built from config fields, shared by every task.

Config fields (all top level, so ``--config.learning_rate=1e-3`` works)::

    optimizer        "adamw" | "sgd" (momentum, optionally Nesterov)
    learning_rate    peak rate, reached after ``warmup_steps``, then cosine decay to
                     ``learning_rate * min_lr_ratio`` at ``num_train_steps``
    weight_decay     decoupled for AdamW; for SGD added to the gradient before momentum; applied
                     only to leaves named in ``DECAY_NAMES`` (weights of Dense/Conv layers);
                     biases, norm scales, class tokens and position embeddings are left alone
    b1, b2, eps      Adam moments;  momentum, nesterov for SGD
    grad_clip_norm   global-norm clipping (0 disables)
    grad_accum_steps optax.MultiSteps: one update every k train steps (schedule counts updates)
    layer_decay      0 (default) or 1 disables; else layer-wise learning-rate decay (BEiT,
                     timm's ``param_groups_layer_decay``): a parameter at depth ``d`` of a model
                     whose deepest parameters are at depth ``D`` gets ``layer_decay ** (D - d)``
                     times the update, weight decay included; depths come from the task
                     (``make_optimizer``'s ``layer_depths``, e.g. ``attnjax.models.vit``'s), and
                     the ``learning_rate`` metric stays the rate at depth ``D``
    ema_decay        0 disables; else ``ema = decay * ema + (1 - decay) * params`` each step
    nonfinite        "stop" (default) | "skip": what a step with a non-finite loss or gradient
                     norm does (see ``guard_nonfinite``); ``max_skipped_steps`` in a row end a
                     "skip" run
"""

from __future__ import annotations

from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from attnjax.train import nonfinite

OPTIMIZERS = ("adamw", "sgd")
DECAY_NAMES = ("kernel",)


def decay_mask(params):
    """True for leaves whose last path entry is in ``DECAY_NAMES``."""

    def is_decayed(path, _):
        last = path[-1]
        name = getattr(last, "key", getattr(last, "name", None))
        return name in DECAY_NAMES

    return jax.tree_util.tree_map_with_path(is_decayed, params)


def make_schedule(config, learning_rate: float | None = None) -> optax.Schedule:
    """Linear warmup then cosine decay, as a function of the optimiser update count."""
    peak = config.learning_rate if learning_rate is None else learning_rate
    accum = max(config.get("grad_accum_steps", 1), 1)
    decay_steps = max(config.num_train_steps // accum, 1)
    warmup = min(config.get("warmup_steps", 0) // accum, decay_steps - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=warmup,
        decay_steps=decay_steps,
        end_value=peak * config.get("min_lr_ratio", 0.0),
    )


def learning_rate_at(config, step, schedule: optax.Schedule | None = None):
    """Learning rate used by the update that train step ``step`` contributes to."""
    schedule = schedule or make_schedule(config)
    return schedule(step // max(config.get("grad_accum_steps", 1), 1))


def scale_by_layer_decay(
    layer_decay: float, layer_depths: Callable[[Any], Any]
) -> optax.GradientTransformation:
    """Multiplies each update by ``layer_decay ** (D - depth)``, ``D`` the deepest depth.

    ``layer_depths(tree)`` gives each leaf's depth as an int array that broadcasts against it (a
    scalar, or one depth per slice of a stacked leaf); it reads only the tree's paths and shapes,
    so the factors are constants of the compiled step. Stateless.
    """

    def update(updates, state, params=None):
        del params
        depths = layer_depths(updates)
        deepest = max(int(np.max(d)) for d in jax.tree.leaves(depths))
        scale = lambda u, d: u * np.asarray(layer_decay ** (deepest - np.asarray(d)), u.dtype)
        return jax.tree.map(scale, updates, depths), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(
    config,
    learning_rate: float | None = None,
    b1: float | None = None,
    layer_depths: Callable[[Any], Any] | None = None,
) -> optax.GradientTransformation:
    """The optax transformation described by the config (see module docstring).

    ``learning_rate``/``b1`` override the config's (e.g. a task's second optimiser).
    ``layer_depths`` is the task's depth rule for ``config.layer_decay`` (see
    ``scale_by_layer_decay``); a task without one refuses a ``layer_decay`` that is on.
    """
    name = config.optimizer
    schedule = make_schedule(config, learning_rate)
    weight_decay = config.get("weight_decay", 0.0)
    if name == "adamw":
        tx = optax.adamw(
            schedule,
            b1=config.get("b1", 0.9) if b1 is None else b1,
            b2=config.get("b2", 0.999),
            eps=config.get("eps", 1e-8),
            weight_decay=weight_decay,
            mask=decay_mask,
        )
    elif name == "sgd":
        tx = optax.chain(
            optax.add_decayed_weights(weight_decay, mask=decay_mask),
            optax.sgd(
                schedule,
                momentum=config.get("momentum", 0.9),
                nesterov=config.get("nesterov", False),
            ),
        )
    else:
        raise ValueError(
            f"config.optimizer={name!r} is not supported; expected one of {OPTIMIZERS}."
        )
    layer_decay = config.get("layer_decay", 0.0)
    if not isinstance(layer_decay, (int, float)) or not (layer_decay == 0 or 0 < layer_decay <= 1):
        raise ValueError(f"config.layer_decay={layer_decay!r}; expected 0 (off) or in (0, 1].")
    if layer_decay not in (0, 1):
        if layer_depths is None:
            raise ValueError(
                f"config.layer_decay={layer_decay!r}; this task's parameters have no layer "
                "depths, set 0 (off)."
            )
        # After the whole update, weight decay included: the group's rate scales both (timm).
        tx = optax.chain(tx, scale_by_layer_decay(layer_decay, layer_depths))
    if config.get("grad_clip_norm", 0.0):
        tx = optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), tx)
    accum = config.get("grad_accum_steps", 1)
    if accum > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=accum)
    return tx


@flax.struct.dataclass
class TrainState:
    """State of a one-model, one-optimiser task (classification, prior)."""

    step: jax.Array
    params: Any
    opt_state: Any
    ema_params: Any = None


def apply_gradients(state: TrainState, grads, metrics: dict, *, config, tx, axis_name=None):
    """One optimiser step from ``grads``; returns ``(new_state, metrics)``.

    Under pmap (``axis_name`` set) gradients and metrics are first averaged over the devices, so
    every replica applies the same update. Adds ``grad_norm`` and ``learning_rate`` to the
    metrics and advances the parameter EMA when the state keeps one.
    """
    if axis_name is not None:
        grads, metrics = jax.lax.pmean((grads, metrics), axis_name)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(
        metrics,
        grad_norm=optax.tree.norm(grads),
        learning_rate=learning_rate_at(config, state.step),
    )
    ema = state.ema_params
    if ema is not None:
        ema = ema_update(ema, params, config.ema_decay)
    new_state = state.replace(
        step=state.step + 1, params=params, opt_state=opt_state, ema_params=ema
    )
    new_state, metrics["nonfinite"] = guard_nonfinite(
        state, new_state, metrics["loss"], metrics["grad_norm"], config.get("nonfinite", "stop")
    )
    return new_state, metrics


def guard_nonfinite(old_state, new_state, loss, grad_norm, mode: str):
    """Keeps ``old_state`` (all but its step) when ``loss`` or ``grad_norm`` is not finite.

    Returns ``(state, nonfinite)``, ``nonfinite`` a float32 scalar (1.0 for a dropped update)
    that the step reports as a metric: the host reads it lazily with the other metrics, so the
    guard costs no device-to-host sync per step. A dropped update in both modes means the
    state never holds NaN or inf, whatever is saved; the training loop stops the run at the
    first flagged step in mode "stop", and after ``max_skipped_steps`` in a row in "skip".
    """
    if mode not in nonfinite.MODES:
        raise ValueError(f"config.nonfinite={mode!r}; expected one of {nonfinite.MODES}.")
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, old_state)
    # The step still advances: a skipped batch is consumed, so learning rate and data stay
    # aligned with an uninterrupted run's step count.
    return kept.replace(step=new_state.step), (~finite).astype(jnp.float32)


def ema_update(ema_params, params, decay: float):
    """``decay * ema + (1 - decay) * params``, leaf by leaf."""
    return jax.tree.map(
        lambda e, p: decay * e + (1.0 - decay) * p.astype(e.dtype), ema_params, params
    )
