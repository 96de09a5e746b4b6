"""Scaled dot-product attention in two layouts, one set of semantics (PyTorch's
``scaled_dot_product_attention``).

* ``scaled_dot_product_attention``: PyTorch's layout, query ``[..., L, E]``, key ``[..., S, E]``,
  value ``[..., S, Ev]``, any leading (batch, head) dims with broadcasting.
* ``dot_product_attention``: JAX's layout, ``[batch, length, heads, head_dim]``, what
  ``attnjax.models.multihead.MultiHeadAttention`` uses after its projections (no transposes on
  the hot path).

Masks (``attnjax.ops.masks``): a boolean mask is True where a query may attend to a key; a float
mask is added to the scores (``-inf`` entries mask a key out). ``is_causal`` is PyTorch's top-left
aligned ``tril(ones(L, S))``. A query row whose keys are all masked returns zeros, never NaN
(PyTorch's ``nn.MultiheadAttention`` returns NaN there).

Which kernel runs is ``dot_product_attention``'s ``implementation``, by default picked per
platform by ``attnjax.ops.kernel_choice`` and staged with ``jax.lax.platform_dependent``, so
the choice is made for the platform the program is compiled for, not the host that traces it:
XLA's fused ``jax.nn.dot_product_attention``, cuDNN flash attention (CUDA), Pallas splash
attention (TPU, ``attnjax.ops.splash``), an explicit einsum + softmax (always when weights or
dropout are requested) or the linear-memory blocked path.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from attnjax.ops import autotune, explicit_attention, kernel_choice, splash
from attnjax.ops.blocked_attention import blocked_dot_product_attention
from attnjax.ops.masks import (
    as_4d,
    causal_mask,
    check_mask_shape,
    mask_kind,
    pad_axis,
    split_mask,
)

Array = jax.Array
_IMPLEMENTATIONS = (None, "xla", "cudnn", "explicit", "blocked", "splash")


def _check_dropout(dropout_rate, dropout_rng):
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng (a jax.random key)")


def check_ranks(where: str, expected: str, rank_ok: Callable[[int], bool], **arrays):
    for name, array in arrays.items():
        if not rank_ok(jnp.ndim(array)):
            raise ValueError(f"{where}: {name} must {expected}, got shape {jnp.shape(array)}")


def _fused_attention(query, key, value, keep, bias, scale, is_causal, implementation, fallback):
    if implementation == "cudnn":
        try:
            return _cudnn_attention(query, key, value, keep, bias, scale, is_causal)
        except (NotImplementedError, ValueError, RuntimeError):
            if fallback is None:
                raise
            # cuDNN rejects some shapes and masks at trace time, and cannot be lowered without
            # the jax CUDA plugin on the host: the CUDA program then carries the fallback.
            return None
    return jax.nn.dot_product_attention(
        query,
        key,
        value,
        bias,
        keep,
        scale=scale,
        is_causal=is_causal,
        implementation=implementation,
    )


def _cudnn_attention(query, key, value, keep, bias, scale, is_causal):
    """cuDNN flash attention. Its gradient takes even lengths only (jax's check, at
    differentiation time): odd lengths are padded by one and the padding declared as sequence
    lengths, which cuDNN masks itself."""
    batch, length, _, _ = query.shape
    key_length = key.shape[1]
    lengths = {}
    if length % 2 or key_length % 2:
        even_length, even_keys = length + length % 2, key_length + key_length % 2
        query = pad_axis(query, 1, even_length)
        key, value = pad_axis(key, 1, even_keys), pad_axis(value, 1, even_keys)
        keep = pad_axis(pad_axis(keep, 2, even_length, True), 3, even_keys, False)
        bias = pad_axis(pad_axis(bias, 2, even_length), 3, even_keys)
        lengths = {
            "query_seq_lengths": jnp.full((batch,), length, jnp.int32),
            "key_value_seq_lengths": jnp.full((batch,), key_length, jnp.int32),
        }
    out = jax.nn.dot_product_attention(
        query,
        key,
        value,
        None if bias is None else bias.astype(query.dtype),
        keep,
        scale=scale,
        is_causal=is_causal,
        implementation="cudnn",
        **lengths,
    )
    return out[:, :length]


def dot_product_attention(
    query,
    key,
    value,
    mask=None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    return_weights: bool = False,
    implementation: str | None = None,
):
    """Multi-head attention on ``[batch, length, heads, head_dim]`` arrays (JAX's layout).

    Args:
      query: ``[batch, L, heads, E]``.
      key: ``[batch, S, heads, E]``.
      value: ``[batch, S, heads, Ev]``.
      mask: boolean (True = attend) or float (added to the scores), broadcastable to
        ``[batch, heads, L, S]``.
      is_causal: also apply the top-left aligned causal mask ``tril(ones(L, S))``.
      scale: score scale, default ``1 / sqrt(E)``.
      dropout_rate, dropout_rng: dropout on the attention weights (explicit path).
      return_weights: also return the weights ``[batch, heads, L, S]`` (after dropout, as PyTorch).
      implementation: None (``attnjax.ops.kernel_choice`` picks per platform, dtype, shape and
        mask, resolved for the platform the program is compiled for), "xla", "cudnn",
        "explicit" (einsum + softmax), "blocked" (linear memory) or "splash" (Pallas TPU
        kernel; interpreted on CPU). Weights and dropout always use "explicit"; ``Ev != E``
        uses "explicit" or "blocked".

    Returns:
      ``[batch, L, heads, Ev]``, or ``(out, weights)``. Rows whose keys are all masked are zeros.
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    check_ranks(
        "dot_product_attention",
        "be [batch, length, heads, head_dim]",
        lambda n: n == 4,
        query=query,
        key=key,
        value=value,
    )
    batch, length, heads, depth = query.shape
    if key.shape[0] != batch or key.shape[2] != heads or key.shape[3] != depth:
        raise ValueError(
            f"dot_product_attention: key shape {key.shape} does not match query shape "
            f"{query.shape} in batch, heads or head_dim"
        )
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"dot_product_attention: value shape {value.shape} does not match key shape "
            f"{key.shape} in batch, length or heads"
        )
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {_IMPLEMENTATIONS}, got {implementation!r}"
        )
    _check_dropout(dropout_rate, dropout_rng)
    key_length = key.shape[1]
    check_mask_shape(mask, (batch, heads, length, key_length), "dot_product_attention")
    mask = None if mask is None else jnp.asarray(mask)
    scale = 1.0 / math.sqrt(depth) if scale is None else scale
    if return_weights or dropout_rate > 0.0:
        out, weights = explicit_attention.with_weights(
            query, key, value, mask, is_causal, scale, dropout_rate, dropout_rng
        )
        return (out, weights) if return_weights else out
    if implementation == "splash" and not splash.serves(
        batch, depth, value.shape[-1], mask_kind(mask)
    ):
        raise ValueError(
            "dot_product_attention: implementation='splash' takes no mask or a key-padding "
            f"mask ([batch, 1, 1, S] booleans), Ev == E and a batch that divides over the mesh; "
            f"got mask shape {None if mask is None else mask.shape}, query {query.shape}, "
            f"value {value.shape}"
        )
    if implementation is None:
        choices = platform_choices(query, key, value, mask, is_causal, timed=False)
    else:
        choices = {p: implementation for p in (*kernel_choice.PLATFORMS, kernel_choice.DEFAULT)}
    return _on_platforms(
        choices, query, key, value, mask, is_causal, scale, automatic=implementation is None
    )


def platform_choices(query, key, value, mask, is_causal: bool, timed: bool = True) -> dict:
    """``{platform: implementation}`` for ``kernel_choice.PLATFORMS`` and ``"default"``, as
    ``dot_product_attention`` resolves them for a differentiated call (``timed``: the CPU path
    timed where the rule says so; else the rule's default)."""
    batch, length, _, depth = query.shape
    key_length, value_dim = key.shape[1], value.shape[-1]
    kind = mask_kind(mask)
    choices = {
        platform: kernel_choice.choose_implementation(
            platform,
            query.dtype,
            length,
            key_length,
            depth,
            value_dim,
            mask_kind=kind,
            splash_serves=platform == "tpu" and splash.serves(batch, depth, value_dim, kind),
        )
        for platform in (*kernel_choice.PLATFORMS, kernel_choice.DEFAULT)
    }
    if timed and kernel_choice.cpu_timed(max(length, key_length)):
        choices["cpu"] = timed_cpu_path(query, key, value, mask, is_causal, choices["cpu"])
    return choices


def _on_platforms(choices: dict, query, key, value, mask, is_causal, scale, automatic=True):
    """Runs each platform's choice; one branch per distinct kernel, staged with
    ``jax.lax.platform_dependent`` when they differ (resolved when the program is lowered)."""
    branches: dict = {}
    per_platform = {}
    for platform, implementation in choices.items():
        how = _how(platform, implementation, query, key, value, automatic)
        if how not in branches:
            branches[how] = functools.partial(_attend, *how, is_causal=is_causal, scale=scale)
        per_platform[platform] = branches[how]
    if len(branches) == 1:
        return next(iter(branches.values()))(query, key, value, mask)
    default = per_platform.pop(kernel_choice.DEFAULT)
    return jax.lax.platform_dependent(query, key, value, mask, default=default, **per_platform)


def _how(platform: str, implementation: str, query, key, value, automatic: bool) -> tuple:
    """What distinguishes two branches: the kernel and its platform-specific setting (the
    blocked path's tiles, whether splash is interpreted, what replaces a cuDNN that refuses
    the call, where the choice was automatic)."""
    length, key_length = query.shape[1], key.shape[1]
    if platform == "cpu" and automatic and kernel_choice.cpu_chosen_by_use(max(length, key_length)):
        return ("timed", implementation)
    if implementation == "blocked":
        return ("blocked", kernel_choice.blocked_tiles(platform, length, key_length))
    if implementation == "splash":
        return ("splash", platform == "cpu")
    if implementation == "cudnn" and automatic:
        dims = (query.shape[-1], value.shape[-1])
        return ("cudnn", kernel_choice.cudnn_fallback(length, key_length, *dims))
    return (implementation, None)


def _attend(implementation, setting, query, key, value, mask, *, is_causal, scale):
    """One kernel on ``[batch, length, heads, dim]`` arrays, rows with no allowed key zeroed."""
    length, key_length, depth = query.shape[1], key.shape[1], query.shape[-1]
    if implementation == "timed":
        return _timed_on_cpu(setting, query, key, value, mask, is_causal, scale)
    if implementation == "blocked":
        query_block, key_block = setting
        return blocked_dot_product_attention(
            query,
            key,
            value,
            mask,
            is_causal=is_causal,
            scale=scale,
            query_block=query_block,
            key_block=key_block,
        )
    keep, bias = split_mask(mask, "dot_product_attention")
    keep, bias = as_4d(keep), as_4d(bias)
    if implementation == "splash":
        key_valid = None if keep is None else keep[:, 0, 0, :]
        out = splash.splash_attention(
            query, key, value, key_valid, is_causal=is_causal, scale=scale, interpret=setting
        )
        return _zero_rows_without_keys(out, keep)
    explicit = value.shape[-1] != depth or implementation == "explicit"
    # A plain square causal mask goes to the kernel as a flag (cuDNN then skips the masked
    # blocks); anything else is folded into the boolean mask.
    kernel_causal = is_causal and keep is None and length == key_length and not explicit
    if is_causal and not kernel_causal:
        causal = as_4d(causal_mask(length, key_length))
        keep = causal if keep is None else jnp.logical_and(keep, causal)
    if explicit:
        # [batch?, heads?, L, 1]
        row_valid = None if keep is None else jnp.any(keep, axis=-1, keepdims=True)
        return explicit_attention.explicit_attention(
            query, key, value, keep, bias, row_valid, scale, 0.0, None, False
        )[0]
    fallback = setting if implementation == "cudnn" else None
    out = _fused_attention(
        query, key, value, keep, bias, scale, kernel_causal, implementation, fallback
    )
    if out is None:
        return _attend(
            *_how("cuda", fallback, query, key, value, True),
            query,
            key,
            value,
            mask,
            is_causal=is_causal,
            scale=scale,
        )
    return _zero_rows_without_keys(out, keep)


def _zero_rows_without_keys(out, keep):
    if keep is None:
        return out
    # [batch?, heads?, L, 1] -> [batch?, L, heads?, 1], to match the output layout.
    row_valid = jnp.any(keep, axis=-1, keepdims=True)
    return jnp.where(jnp.swapaxes(row_valid, 1, 2), out, 0.0)


def _timed_on_cpu(default: str, query, key, value, mask, is_causal: bool, scale):
    """The CPU path where ``kernel_choice.cpu_chosen_by_use``, by how the call is used: where
    differentiated (training), the fastest forward + backward (``timed_cpu_path``); where not,
    the fastest forward (``forward_cpu_path``). The two rank the paths differently: at 17 tokens
    XLA's fused attention is the fastest with its backward and the slowest without it
    (benchmarks/results/cpu_rules.md)."""

    def run(path):
        return lambda *args: _attend(
            *_how("cpu", path, query, key, value, False), *args, is_causal=is_causal, scale=scale
        )

    # jax.vjp's function is a pytree of the chosen path's residuals.
    attend = jax.custom_vjp(lambda *a: run(forward_cpu_path(*a, is_causal, default))(*a))
    attend.defvjp(
        lambda *a: jax.vjp(run(timed_cpu_path(*a, is_causal, default)), *a),
        lambda vjp, d_out: vjp(d_out),
    )
    return attend(query, key, value, mask)


def forward_cpu_path(query, key, value, mask, is_causal: bool, default: str) -> str:
    """The path of a forward-only call: explicit below ``kernel_choice.CPU_TIMED_FROM`` tokens
    (the timing's choice at every class measured there; 1.1-2.6x XLA's below 64 tokens), from
    there the fastest forward, timed once per class of shapes; ``default`` with the timing off or
    the class never timed. JAX traces a ``custom_vjp``'s primal also where the call is
    differentiated: a train step's shapes get this timing too."""
    if max(query.shape[1], key.shape[1]) < kernel_choice.CPU_TIMED_FROM:
        return "explicit"
    key_text, candidates = cpu_path_candidates(query, key, value, mask, is_causal, False)
    return autotune.choose("cpu_attention_forward", key_text, candidates, default=default)


def timed_cpu_path(query, key, value, mask, is_causal: bool, default: str) -> str:
    """``"xla"`` (where ``E == Ev``), ``"explicit"`` or ``"blocked"``, whichever runs this call's
    forward and backward fastest on this processor, timed once per class of shapes (which wins
    depends on the caches, the batch and the mask: ``kernel_choice.cpu_shape_class``); ``default``
    with the timing off, the class never timed, or below ``kernel_choice.CPU_TIMED_FROM`` tokens."""
    if max(query.shape[1], key.shape[1]) < kernel_choice.CPU_TIMED_FROM:
        return default
    key_text, candidates = cpu_path_candidates(query, key, value, mask, is_causal)
    return autotune.choose("cpu_attention", key_text, candidates, default=default)


def cpu_path_candidates(query, key, value, mask, is_causal: bool, backward=True) -> tuple:
    """``(key, {path: build})`` for ``autotune.choose``: each ``build()`` compiles the path's
    forward (and backward) for this call's shapes and returns a call that blocks until done."""
    shapes = [(x.shape, x.dtype) for x in (query, key, value)]
    mask_shape = None if mask is None else jnp.shape(mask)
    mask_dtype = None if mask is None else jnp.result_type(mask)

    def build(implementation):
        def grads(q, k, v, m, d_out):
            def attend(q, k, v):
                return dot_product_attention(
                    q, k, v, m, is_causal=is_causal, implementation=implementation
                )

            if not backward:
                return attend(q, k, v)
            # A cotangent from outside, as in a train step: a constant one lets XLA fold it.
            return jax.vjp(attend, q, k, v)[1](d_out)

        rng = np.random.default_rng(0)
        args = [rng.standard_normal(shape).astype(dtype) for shape, dtype in shapes]
        # Everything allowed: the paths' speed does not hang on the mask's values.
        allowed = None
        if mask is not None:
            fill = np.ones if jnp.issubdtype(mask_dtype, jnp.bool_) else np.zeros
            allowed = fill(mask_shape, mask_dtype)
        d_out = rng.standard_normal((*query.shape[:3], value.shape[-1]))
        args += [allowed, d_out.astype(jnp.promote_types(query.dtype, value.dtype))]
        compiled = jax.jit(grads).lower(*args).compile()
        return lambda: jax.block_until_ready(compiled(*args))

    key_text = kernel_choice.cpu_shape_class(
        query.shape, key.shape, value.shape, query.dtype, is_causal, mask_kind(mask)
    )
    names = ["explicit", "blocked"] + (["xla"] if query.shape[-1] == value.shape[-1] else [])
    return key_text, {name: (lambda name=name: build(name)) for name in names}


def _fold_leading(x, leading: tuple):
    """``[..., A, B]`` broadcastable to ``leading + (A, B)`` -> ``[batch, heads, A, B]``: the last
    leading dim plays the heads, the others are flattened into the batch. Singleton dims stay
    singletons (``[1, 1, A, B]`` for an ``[A, B]`` mask), so nothing is copied per batch and
    head."""
    x = x.reshape((1,) * (len(leading) + 2 - x.ndim) + x.shape)
    heads = x.shape[-3] if leading else 1
    if all(d == 1 for d in x.shape[:-3]):
        return x.reshape(1, heads, *x.shape[-2:])
    x = jnp.broadcast_to(x, leading[:-1] + x.shape[-3:])
    return x.reshape(-1, heads, *x.shape[-2:])


def scaled_dot_product_attention(
    query,
    key,
    value,
    mask=None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    return_weights: bool = False,
    implementation: str | None = None,
):
    """Attention with ``torch.nn.functional.scaled_dot_product_attention``'s semantics and layout.

    ``softmax(query @ key^T * scale + mask) @ value`` over the last two axes.

    Args:
      query: ``[..., L, E]``.
      key: ``[..., S, E]``.
      value: ``[..., S, Ev]``; the leading dims of the three broadcast together.
      mask: broadcastable to ``[..., L, S]``. Unlike PyTorch, a mask may be combined with
        ``is_causal``.
      is_causal, scale, dropout_rate, dropout_rng: as ``dot_product_attention``'s.
      return_weights: also return the weights ``[..., L, S]``.
      implementation: as ``dot_product_attention``'s.

    Returns:
      ``[..., L, Ev]``, or ``(out, weights)``. A query row whose keys are all masked gives zeros
      and zero weights (as torch 2.13's SDPA does; ``nn.MultiheadAttention`` gives NaN).
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    check_ranks(
        "scaled_dot_product_attention",
        "have rank >= 2 ([..., length, dim])",
        lambda n: n >= 2,
        query=query,
        key=key,
        value=value,
    )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"scaled_dot_product_attention: query and key feature sizes differ: query shape "
            f"{query.shape}, key shape {key.shape}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"scaled_dot_product_attention: key and value lengths differ: key shape {key.shape}, "
            f"value shape {value.shape}"
        )
    try:
        leading = tuple(np.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2]))
    except ValueError:
        raise ValueError(
            "scaled_dot_product_attention: leading dims do not broadcast: query shape "
            f"{query.shape}, key shape {key.shape}, value shape {value.shape}"
        ) from None
    length, key_length = query.shape[-2], key.shape[-2]
    if mask is not None:
        mask = jnp.asarray(mask)
        check_mask_shape(mask, leading + (length, key_length), "scaled_dot_product_attention")

    def to_bthd(x):
        return jnp.swapaxes(
            _fold_leading(jnp.broadcast_to(x, leading + x.shape[-2:]), leading), 1, 2
        )

    mask = None if mask is None else _fold_leading(mask, leading)
    result = dot_product_attention(
        to_bthd(query),
        to_bthd(key),
        to_bthd(value),
        mask,
        is_causal=is_causal,
        scale=scale,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        return_weights=return_weights,
        implementation=implementation,
    )
    out, weights = result if return_weights else (result, None)
    out = jnp.swapaxes(out, 1, 2).reshape(leading + (length, value.shape[-1]))
    if return_weights:
        return out, weights.reshape(leading + (length, key_length))
    return out
