"""Which attention kernel runs, decided per platform: the one place that asks.

``attention.dot_product_attention`` calls ``choose_implementation`` for each platform a program
may be lowered for (``PLATFORMS``) and stages the choices with ``jax.lax.platform_dependent``:
the kernel is picked for the platform the program is compiled for, not for the host that traces
it. A program traced on a CPU and compiled for a TPU carries the TPU's kernel.

* ``"cpu"``: a fixed rule below ``CPU_TIMED_FROM`` tokens: XLA's fused attention below
  ``EXPLICIT_MIN_LENGTH_CPU`` (einsum + softmax, ``"explicit"``, for a forward-only call, the
  fastest forward at every short shape measured), explicit from there. From ``CPU_TIMED_FROM``
  to ``CPU_TIMED_BELOW`` the fastest of XLA's, explicit and the blocked path, timed once per
  class of shapes on the machine (``attnjax.ops.autotune``): there which wins differs between
  processors, shapes and loads (benchmarks/results/cpu_rules.md). A differentiated call
  (training) takes the fastest forward + backward, a forward-only call (inference) the fastest
  forward: the two rank the paths differently. With the timing off: the rule, then blocked from
  ``BLOCKED_MIN_LENGTH_CPU``. From ``CPU_TIMED_BELOW`` the linear-memory ``"blocked"`` path,
  with taller tiles from ``CPU_LONG_BLOCK_FROM`` on a device of several cores.
* ``"tpu"``: Pallas splash attention (``attnjax.ops.splash``) when it serves the call and both
  lengths reach ``TPU_SPLASH_MIN_LENGTH``; below, the ``[L, S]`` scores are small and XLA's fused
  attention keeps them in one fusion without padding the lengths to the kernel's 128-row tiles.
* ``"cuda"``: cuDNN flash attention for float16/bfloat16 (``cudnn_eligible``), else XLA.
* every other platform, and the two above when their kernel does not apply: XLA's fused
  attention, blocked from ``BLOCKED_MIN_LENGTH_ACCELERATOR`` tokens (the ``[L, S]`` scores of
  8 float32 heads are 512 MiB there), einsum + softmax when ``Ev != E``.

The rules for accelerators are predictions from compiled programs (docs/accelerators.md), not
timings: no accelerator was measured.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnjax.ops.platform import cpu_cores

# Platforms that get a branch of their own; any other gets the "default" rule.
PLATFORMS = ("cpu", "cuda", "tpu")
DEFAULT = "default"

EXPLICIT_MIN_LENGTH_CPU = 64
BLOCKED_MIN_LENGTH_CPU = 512
CPU_TIMED_BELOW = 1024
# Below this many tokens the timing costs more than it can win: in every class of shorter calls
# timed (benchmarks/results/cpu_rules.md, 16-256 tokens) the fixed rule's path (XLA's below 64
# tokens, explicit from there) was the timing's choice or within 3% of it, forward and forward +
# backward, but for calls of a few ms at exactly 64 tokens, whose fastest path moved between
# runs; timing a class compiles three programs a rule (7-10 s of ViT-B/16's cold first step on
# the 2-core VM: benchmarks/results/attention_untimed_band.md).
CPU_TIMED_FROM = 512
BLOCKED_MIN_LENGTH_ACCELERATOR = 4096
TPU_SPLASH_MIN_LENGTH = 512

DEFAULT_QUERY_BLOCK = 128
DEFAULT_KEY_BLOCK = 128
# From 1024 tokens, on a CPU device that has several cores, a taller query tile reuses each
# key/value tile over more rows that XLA splits over the cores; with one device per core
# (train.py's CPU default) each device computes alone and 128 x 128 tiles, which skip more of the
# causal triangle, win instead (benchmarks/results/attention_tiles.md).
CPU_LONG_BLOCK_FROM = 1024
CPU_LONG_QUERY_BLOCK = 512
CPU_LONG_KEY_BLOCK = 256

# How a mask constrains the kernel: none, a key-padding mask ([batch, 1, 1, S] booleans), any
# other boolean mask, or a float mask added to the scores.
MASK_KINDS = (None, "key_padding", "boolean", "additive")


def cudnn_eligible(dtype, head_dim: int, value_dim: int | None = None) -> bool:
    """Whether cuDNN flash attention may take the call: float16/bfloat16, ``head_dim`` a multiple
    of 8 up to 128 (256 needs a Hopper GPU, unknown when compiling elsewhere), ``Ev == E``."""
    return (
        jnp.dtype(dtype) in (jnp.float16, jnp.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 128
        and (value_dim is None or value_dim == head_dim)
    )


def _fallback(query_length: int, key_length: int, head_dim: int, value_dim: int) -> str:
    if max(query_length, key_length) >= BLOCKED_MIN_LENGTH_ACCELERATOR:
        return "blocked"
    return "xla" if head_dim == value_dim else "explicit"


def choose_implementation(
    platform: str,
    dtype,
    query_length: int,
    key_length: int,
    head_dim: int,
    value_dim: int,
    *,
    mask_kind: str | None = None,
    splash_serves: bool = False,
) -> str:
    """The attention path for one platform: ``"xla"`` (``jax.nn.dot_product_attention``),
    ``"explicit"``, ``"blocked"``, ``"cudnn"`` or ``"splash"``.

    Args:
      platform: ``"cpu"``, ``"cuda"``, ``"tpu"``, or anything else for the default rule.
      dtype, query_length, key_length, head_dim, value_dim: of the call.
      mask_kind: one of ``MASK_KINDS``.
      splash_serves: ``attnjax.ops.splash.serves`` for this call (shapes, mask, mesh).
    """
    if mask_kind not in MASK_KINDS:
        raise ValueError(f"choose_implementation: mask_kind must be one of {MASK_KINDS}")
    length = max(query_length, key_length)
    if platform == "cpu":
        if length >= BLOCKED_MIN_LENGTH_CPU:
            return "blocked"
        if length >= EXPLICIT_MIN_LENGTH_CPU or head_dim != value_dim:
            return "explicit"
        return "xla"
    if platform == "tpu":
        if splash_serves and min(query_length, key_length) >= TPU_SPLASH_MIN_LENGTH:
            return "splash"
    elif platform == "cuda" and cudnn_eligible(dtype, head_dim, value_dim):
        return "cudnn"
    return _fallback(query_length, key_length, head_dim, value_dim)


def cpu_timed(length: int) -> bool:
    """Whether the CPU path of a call of ``length`` tokens (the longer of query and key) is timed
    on the processor: from ``CPU_TIMED_FROM`` to below ``CPU_TIMED_BELOW``."""
    return CPU_TIMED_FROM <= length < CPU_TIMED_BELOW


def cpu_chosen_by_use(length: int) -> bool:
    """Whether a CPU call of ``length`` tokens may run one path forward only and another where
    it is differentiated (timed, or XLA's rule against the explicit forward): below
    ``EXPLICIT_MIN_LENGTH_CPU`` and where ``cpu_timed``. Between them the explicit path serves
    both."""
    return length < EXPLICIT_MIN_LENGTH_CPU or cpu_timed(length)


def cudnn_fallback(query_length: int, key_length: int, head_dim: int, value_dim: int) -> str:
    """What a CUDA program carries where cuDNN refuses a call at trace time (some shapes and
    masks; or no jax CUDA plugin on the host, which lowering cuDNN needs)."""
    return _fallback(query_length, key_length, head_dim, value_dim)


def blocked_tiles(platform: str, query_length: int, key_length: int) -> tuple[int, int]:
    """(query_block, key_block) of the blocked path on a platform; on a CPU, for this process's
    CPU devices."""
    if (
        platform == "cpu"
        and max(query_length, key_length) >= CPU_LONG_BLOCK_FROM
        and cores_per_cpu_device() > 1
    ):
        return CPU_LONG_QUERY_BLOCK, CPU_LONG_KEY_BLOCK
    return DEFAULT_QUERY_BLOCK, DEFAULT_KEY_BLOCK


def cores_per_cpu_device() -> int:
    """The cores of this process over its local CPU devices (at least 1; 1 without a CPU
    backend)."""
    try:
        devices = len(jax.local_devices(backend="cpu"))
    except RuntimeError:  # JAX_PLATFORMS leaves the CPU out
        return 1
    return max(1, cpu_cores() // devices)


def cpu_shape_class(
    query_shape, key_shape, value_shape, dtype, is_causal: bool, mask_kind: str | None
) -> str:
    """The class of attention calls (``[batch, length, heads, dim]`` shapes) that one CPU timing
    stands for, ``autotune``'s key: both lengths rounded up to a power of two, ``batch * heads``
    (the rows the kernels loop over) up to a power of four, the rest as given. Timing per class
    instead of per shape bounds the timings a machine ever makes, and a new shape of a timed
    class costs nothing."""
    batch, length, heads, head_dim = query_shape
    return (
        f"queries {_up_to_power(length, 2)} keys {_up_to_power(key_shape[1], 2)} "
        f"rows {_up_to_power(batch * heads, 4)} dims {head_dim}/{value_shape[-1]} "
        f"{jnp.dtype(dtype).name} causal {bool(is_causal)} mask {mask_kind}"
    )


def _up_to_power(n: int, base: int) -> int:
    power = 1
    while power < n:
        power *= base
    return power
