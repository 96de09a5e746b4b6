"""2-D convolution that stays on XLA:CPU's fast kernels when feature maps are small.

``conv_general_dilated(lhs, rhs, window_strides, padding, ...)`` has the signature of
``jax.lax.conv_general_dilated`` and is passed to ``flax.linen.Conv(conv_general_dilated=...)``.
For ``lhs [b, h, w, c_in]`` (NHWC) and ``rhs [kh, kw, c_in, c_out]`` (HWIO), no dilation and
one feature group, it computes the convolution as patches times a matrix::

    patches[b, i, j, (di, dj, c)] = padded_lhs[b, i * sh + di, j * sw + dj, c]
    out[b, i, j, :]               = patches[b, i, j, :] @ rhs.reshape(kh * kw * c_in, c_out)

whenever the kernel is larger than the input or the output along a spatial axis (a 3x3 conv on
2x2 maps, a 4x4 conv whose output is 3x3). There XLA:CPU lowers the convolution, or the one its
gradient needs (the output's gradient convolved with the kernel), to a generic loop instead of
its convolution library, many times slower (LPIPS's VGG16 on 32-pixel images, the PatchGAN
discriminator's last layers). The patches are at most ``kh * kw`` times a feature map that
small, and their gradient is slices and pads, with no convolution left for XLA to lower.

From 16x16 output maps and 64 x 64 channels, on XLA:CPU with fewer devices than cores, the
kernel gradient can instead be taken as ``kh * kw`` matrix products (threaded, where XLA's
convolutions ran on one thread before ``attnjax.xla_cpu``'s flags), the forward pass and the
input gradient staying on
``lax.conv_general_dilated``::

    d_rhs[di, dj] = padded_lhs[:, di::sh, dj::sw, :] (first h' x w' positions)^T @ d_out

each ``[c_in, c_out]``. Whether that beats the convolution XLA derives for it depends on the
processor (faster on one 2-core EPYC, 1.5x slower in a VQGAN step on a 2-core Xeon), so it is
timed against XLA's once per shape on the machine at hand, in a training run's first step
(``attnjax.ops.autotune``); with the timing off or outside a run, XLA's own runs. Smaller
maps, fewer channels and one CPU device per core (``attnjax.parallel.data_parallel.use_cpu_cores``,
every core already busy with its share of the batch) keep XLA's own without timing. Every other
case is ``lax.conv_general_dilated``. The measurements behind these rules:
benchmarks/results/cpu_rules.md. Outputs and gradients equal XLA's to float32 rounding
(``tests/ops/test_convolution.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attnjax.ops import autotune
from attnjax.ops.platform import cpu_cores

Array = jax.Array

_NHWC = ("NHWC", "HWIO", "NHWC")


def _pads(padding, in_spatial, kernel, strides) -> list[tuple[int, int]]:
    if isinstance(padding, str):
        return list(lax.padtype_to_pads(in_spatial, kernel, strides, padding))
    return [tuple(p) for p in padding]


def _is_nhwc(dimension_numbers, lhs, rhs) -> bool:
    if dimension_numbers is None:
        return False
    expected = lax.conv_dimension_numbers(lhs.shape, rhs.shape, _NHWC)
    return lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers) == expected


def output_spatial(
    in_spatial: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    pads: Sequence[tuple[int, int]],
) -> list[int]:
    """The output's spatial sizes of a convolution without dilation."""
    return [
        (n + lo + hi - k) // s + 1 for n, k, s, (lo, hi) in zip(in_spatial, kernel, strides, pads)
    ]


def needs_patches(
    in_spatial: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    pads: Sequence[tuple[int, int]],
) -> bool:
    """Whether the kernel is larger than the input or the output along some spatial axis."""
    out_spatial = output_spatial(in_spatial, kernel, strides, pads)
    return any(k > min(n, o) for n, o, k in zip(in_spatial, out_spatial, kernel))


def conv_as_patches(
    lhs: Array, rhs: Array, strides: Sequence[int], pads: Sequence[tuple[int, int]], precision=None
) -> Array:
    """NHWC ``lhs [b, h, w, c_in]`` * HWIO ``rhs [kh, kw, c_in, c_out]`` -> ``[b, h', w', c_out]``
    as one matrix product over ``kh * kw * c_in`` patch features."""
    kh, kw, c_in, c_out = rhs.shape
    (sh, sw), (pad_h, pad_w) = strides, pads
    padded = jnp.pad(lhs, ((0, 0), pad_h, pad_w, (0, 0)))
    out_h, out_w = (padded.shape[1] - kh) // sh + 1, (padded.shape[2] - kw) // sw + 1
    patches = jnp.concatenate(
        [
            padded[:, di : di + (out_h - 1) * sh + 1 : sh, dj : dj + (out_w - 1) * sw + 1 : sw, :]
            for di in range(kh)
            for dj in range(kw)
        ],
        axis=-1,
    )
    return jnp.einsum(
        "bhwk,ko->bhwo", patches, rhs.reshape(kh * kw * c_in, c_out), precision=precision
    )


# Only output maps of at least this many positions, with at least this many input x output
# channels, time the matrix-product kernel gradient against XLA's: below them it lost on every
# processor measured (benchmarks/results/cpu_rules.md), and timing costs compiles.
PRODUCT_KERNEL_GRAD_MIN_POSITIONS = 16 * 16
PRODUCT_KERNEL_GRAD_MIN_CHANNELS = 64 * 64


KERNEL_GRADIENT_PATHS = ("xla", "products")
_forced_kernel_gradient: str | None = None


@contextlib.contextmanager
def forced_kernel_gradient(path: str | None) -> Iterator[None]:
    """Within the block, every convolution the kernel-gradient rule covers (large maps, idle
    cores or not) traces with ``path`` (``"xla"`` or ``"products"``) instead of the timed
    choice; ``None`` restores the rule. For comparing the two in whole models
    (benchmarks/vqgan_conv_paths.py)."""
    global _forced_kernel_gradient
    if path not in (None, *KERNEL_GRADIENT_PATHS):
        raise ValueError(
            f"forced_kernel_gradient: path={path!r}, expected one of {KERNEL_GRADIENT_PATHS} "
            "or None"
        )
    previous, _forced_kernel_gradient = _forced_kernel_gradient, path
    try:
        yield
    finally:
        _forced_kernel_gradient = previous


def _cores_left_idle() -> bool:
    """Whether XLA:CPU would leave cores idle during a one-threaded convolution: fewer CPU
    devices than cores. With one device per core
    (``attnjax.parallel.data_parallel.use_cpu_cores``) the split batch keeps every core busy, and
    XLA's own kernel gradient is the faster one (benchmarks/results/cpu_rules.md)."""
    if jax.default_backend() != "cpu":
        return False
    return jax.local_device_count() < cpu_cores()


def _product_kernel_gradient(lhs, d_out, kernel, strides, pads, precision):
    """``d_rhs [kh, kw, c_in, c_out]`` of an NHWC/HWIO convolution as ``kh * kw`` products."""
    kh, kw = kernel
    (sh, sw), (pad_h, pad_w) = strides, pads
    padded = jnp.pad(lhs, ((0, 0), pad_h, pad_w, (0, 0)))
    out_h, out_w = d_out.shape[1:3]
    d_rhs = jnp.stack(
        [
            jnp.einsum(
                "bhwc,bhwo->co",
                padded[
                    :, di : di + (out_h - 1) * sh + 1 : sh, dj : dj + (out_w - 1) * sw + 1 : sw, :
                ],
                d_out,
                precision=precision,
            )
            for di in range(kh)
            for dj in range(kw)
        ]
    )
    return d_rhs.reshape(kh, kw, lhs.shape[-1], d_out.shape[-1])


def kernel_gradient_candidates(lhs_shape, rhs_shape, strides, pads, dtype, precision=None):
    """``{"xla": build, "products": build}``: each ``build()`` compiles the forward pass and both
    gradients of an NHWC/HWIO convolution, with that kernel gradient, on random operands and
    returns a call that blocks until done and returns ``(d_lhs, d_rhs)``. The whole backward
    pass, not the kernel gradient alone: the two gradients compete for the same cores and
    caches, and alone XLA's looked faster than it runs in a train step."""
    strides, pads = tuple(strides), tuple(map(tuple, pads))
    out_spatial = output_spatial(lhs_shape[1:3], rhs_shape[:2], strides, pads)
    out_shape = (lhs_shape[0], *out_spatial, rhs_shape[3])

    def build(products: bool):
        def conv(lhs, rhs):
            if products:
                return conv_with_product_kernel_grad(lhs, rhs, strides, pads, precision)
            return lax.conv_general_dilated(
                lhs, rhs, strides, pads, dimension_numbers=_NHWC, precision=precision
            )

        def grads(lhs, rhs, d_out):
            return jax.vjp(conv, lhs, rhs)[1](d_out)

        rng = np.random.default_rng(0)
        args = [
            rng.standard_normal(s).astype(jnp.dtype(dtype))
            for s in (lhs_shape, rhs_shape, out_shape)
        ]
        compiled = jax.jit(grads).lower(*args).compile()
        return lambda: jax.block_until_ready(compiled(*args))

    return {"xla": lambda: build(False), "products": lambda: build(True)}


def kernel_gradient_path(lhs_shape, rhs_shape, strides, pads, dtype, precision=None) -> str:
    """``"products"`` or ``"xla"``: the faster kernel gradient of this convolution on this
    processor, timed once (``attnjax.ops.autotune``); ``"xla"`` with the timing off."""
    strides, pads = tuple(strides), tuple(map(tuple, pads))
    key = (
        f"{jnp.dtype(dtype).name} lhs {tuple(lhs_shape)} rhs {tuple(rhs_shape)} "
        f"strides {strides} pads {pads} precision {precision}"
    )
    candidates = kernel_gradient_candidates(lhs_shape, rhs_shape, strides, pads, dtype, precision)
    return autotune.choose("conv_kernel_gradient", key, candidates, default="xla")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def conv_with_product_kernel_grad(
    lhs: Array, rhs: Array, strides: tuple, pads: tuple, precision=None
) -> Array:
    """NHWC/HWIO ``lax.conv_general_dilated`` whose kernel gradient is ``kh * kw`` matrix
    products."""
    return lax.conv_general_dilated(
        lhs, rhs, strides, pads, dimension_numbers=_NHWC, precision=precision
    )


def _product_kernel_grad_fwd(lhs, rhs, strides, pads, precision):
    return conv_with_product_kernel_grad(lhs, rhs, strides, pads, precision), (lhs, rhs)


def _product_kernel_grad_bwd(strides, pads, precision, residuals, d_out):
    lhs, rhs = residuals
    _, input_vjp = jax.vjp(
        lambda x: lax.conv_general_dilated(
            x, rhs, strides, pads, dimension_numbers=_NHWC, precision=precision
        ),
        lhs,
    )
    (d_lhs,) = input_vjp(d_out)
    d_rhs = _product_kernel_gradient(lhs, d_out, rhs.shape[:2], strides, pads, precision)
    return d_lhs, d_rhs.astype(rhs.dtype)


conv_with_product_kernel_grad.defvjp(_product_kernel_grad_fwd, _product_kernel_grad_bwd)


def _kernel_gradient_for(lhs, rhs, strides, pads, precision) -> str:
    """The kernel gradient a plain NHWC convolution traces with: XLA's outside the rule's shapes,
    else the forced path, else XLA's when every core is busy, else the timed choice."""
    out_h, out_w = output_spatial(lhs.shape[1:3], rhs.shape[:2], strides, pads)
    large = (
        out_h * out_w >= PRODUCT_KERNEL_GRAD_MIN_POSITIONS
        and rhs.shape[2] * rhs.shape[3] >= PRODUCT_KERNEL_GRAD_MIN_CHANNELS
    )
    if not large or min(min(p) for p in pads) < 0:
        return "xla"
    if _forced_kernel_gradient is not None:
        return _forced_kernel_gradient
    if not _cores_left_idle():
        return "xla"
    return kernel_gradient_path(lhs.shape, rhs.shape, strides, pads, lhs.dtype, precision)


def conv_general_dilated(
    lhs: Array,
    rhs: Array,
    window_strides: Sequence[int],
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision=None,
    preferred_element_type=None,
) -> Array:
    """``lax.conv_general_dilated``, as patches times a matrix where XLA:CPU's kernels do not apply,
    with a matrix-product kernel gradient on large maps where that is faster here."""
    plain = (
        lhs.ndim == 4
        and _is_nhwc(dimension_numbers, lhs, rhs)
        and feature_group_count == 1
        and batch_group_count == 1
        and preferred_element_type is None
        and all(d == 1 for d in (lhs_dilation or (1, 1)))
        and all(d == 1 for d in (rhs_dilation or (1, 1)))
    )
    if plain:
        pads = _pads(padding, lhs.shape[1:3], rhs.shape[:2], window_strides)
        if needs_patches(lhs.shape[1:3], rhs.shape[:2], window_strides, pads):
            return conv_as_patches(lhs, rhs, window_strides, pads, precision)
        if _kernel_gradient_for(lhs, rhs, window_strides, pads, precision) == "products":
            return conv_with_product_kernel_grad(
                lhs, rhs, tuple(window_strides), tuple(map(tuple, pads)), precision
            )
    return lax.conv_general_dilated(
        lhs,
        rhs,
        window_strides,
        padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count,
        batch_group_count=batch_group_count,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
