"""attnjax.ops.convolution against lax.conv_general_dilated and torch's conv2d (float64)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import lax

from attnjax.ops import autotune, convolution

DN = ("NHWC", "HWIO", "NHWC")

# (input [b, h, w, c_in], kernel, c_out, stride, padding): where the patches path is taken.
SMALL_MAPS = [
    ((3, 2, 2, 8), 3, 5, 1, ((1, 1), (1, 1))),  # 3x3 conv on 2x2 maps (LPIPS VGG at 32 px)
    ((2, 4, 4, 6), 4, 7, 1, ((1, 1), (1, 1))),  # PatchGAN's last layers: output 3x3 < kernel 4
    ((2, 3, 5, 4), 4, 3, 2, ((1, 1), (1, 1))),  # stride 2, odd sizes, output 1x2
    ((2, 1, 3, 4), 3, 2, 1, "SAME"),  # string padding
    ((1, 2, 2, 3), 3, 4, 2, ((0, 1), (0, 1))),  # taming's asymmetric downsampling pad
]


def _loss(conv, x, w, stride, padding):
    out = conv(x, w, (stride, stride), padding, dimension_numbers=DN)
    return jnp.sum(out * jnp.cos(out)), out


@pytest.mark.parametrize("shape,kernel,c_out,stride,padding", SMALL_MAPS)
def test_small_maps_take_patches_and_equal_lax_and_torch(shape, kernel, c_out, stride, padding):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((kernel, kernel, shape[-1], c_out)).astype(np.float32)
    pads = convolution._pads(padding, shape[1:3], (kernel, kernel), (stride, stride))
    assert convolution.needs_patches(shape[1:3], (kernel, kernel), (stride, stride), pads)

    # Jitted: one program each, not a compiled program per operation and shape.
    grad = jax.jit(
        jax.grad(
            lambda *a: _loss(convolution.conv_general_dilated, *a, stride, padding),
            (0, 1),
            has_aux=True,
        )
    )
    grad_ref = jax.jit(
        jax.grad(
            lambda *a: _loss(lax.conv_general_dilated, *a, stride, padding), (0, 1), has_aux=True
        )
    )
    (dx, dw), out = grad(x, w)
    (dx_ref, dw_ref), out_ref = grad_ref(x, w)
    for ours, ref in ((out, out_ref), (dx, dx_ref), (dw, dw_ref)):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

    # torch in float64 with the same explicit padding: an independent reference for the values.
    (top, bottom), (left, right) = pads
    padded = torch.nn.functional.pad(
        torch.from_numpy(x.astype(np.float64)).permute(0, 3, 1, 2), (left, right, top, bottom)
    )
    expected = (
        torch.nn.functional.conv2d(
            padded, torch.from_numpy(w.astype(np.float64)).permute(3, 2, 0, 1), stride=stride
        )
        .permute(0, 2, 3, 1)
        .numpy()
    )
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())

    # The point of the module: neither the step nor its gradient holds a convolution for XLA:CPU.
    hlo = grad.lower(x, w).as_text()
    assert "convolution" not in hlo


def test_large_maps_stay_on_lax():
    x = jnp.ones((2, 8, 8, 4))
    w = jnp.ones((3, 3, 4, 4))
    assert not convolution.needs_patches((8, 8), (3, 3), (1, 1), [(1, 1), (1, 1)])
    hlo = (
        jax.jit(
            lambda x, w: convolution.conv_general_dilated(
                x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=DN
            )
        )
        .lower(x, w)
        .as_text()
    )
    assert "convolution" in hlo


def test_flax_conv_with_it_equals_flax_conv():
    x = np.random.default_rng(1).standard_normal((2, 2, 2, 6)).astype(np.float32)
    plain = nn.Conv(5, (3, 3), padding="SAME")
    patched = nn.Conv(
        5, (3, 3), padding="SAME", conv_general_dilated=convolution.conv_general_dilated
    )
    variables = plain.init(jax.random.PRNGKey(0), x)
    np.testing.assert_allclose(
        patched.apply(variables, x), plain.apply(variables, x), rtol=1e-5, atol=1e-6
    )


# (input, kernel, c_out, stride, padding) with output maps of 16x16 and more: the kernel gradient
# is taken as matrix products.
LARGE_MAPS = [
    ((2, 16, 16, 64), 3, 64, 1, ((1, 1), (1, 1))),  # taming's 3x3 convs
    (
        (1, 33, 33, 64),
        3,
        64,
        2,
        ((0, 1), (0, 1)),
    ),  # its stride-2 downsampling with the asymmetric pad
    ((1, 16, 20, 128), 1, 64, 1, "VALID"),  # 1x1 (nin_shortcut), non-square
    ((1, 18, 17, 32), 4, 128, 1, "SAME"),  # even kernel, string padding
]


@pytest.mark.parametrize("shape,kernel,c_out,stride,padding", LARGE_MAPS)
def test_large_maps_take_the_product_kernel_gradient_and_equal_lax_and_torch(
    shape, kernel, c_out, stride, padding, monkeypatch
):
    monkeypatch.setattr(
        convolution, "_cores_left_idle", lambda: True
    )  # one CPU device, several cores
    monkeypatch.setattr(convolution, "kernel_gradient_path", lambda *a, **k: "products")
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((kernel, kernel, shape[-1], c_out)).astype(np.float32)
    loss = lambda conv: jax.grad(lambda *a: _loss(conv, *a, stride, padding), (0, 1), has_aux=True)
    (dx, dw), out = jax.jit(loss(convolution.conv_general_dilated))(x, w)
    (dx_ref, dw_ref), out_ref = jax.jit(loss(lax.conv_general_dilated))(x, w)
    for ours, ref in ((out, out_ref), (dx, dx_ref), (dw, dw_ref)):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

    # The kernel gradient against torch's conv2d backward in float64, an independent reference.
    pads = convolution._pads(padding, shape[1:3], (kernel, kernel), (stride, stride))
    (top, bottom), (left, right) = pads
    tx = torch.from_numpy(x.astype(np.float64)).permute(0, 3, 1, 2)
    tw = torch.from_numpy(w.astype(np.float64)).permute(3, 2, 0, 1).requires_grad_()
    tout = torch.nn.functional.conv2d(
        torch.nn.functional.pad(tx, (left, right, top, bottom)), tw, stride=stride
    )
    tout.backward(
        torch.from_numpy(
            np.asarray(jax.grad(lambda o: jnp.sum(o * jnp.cos(o)))(out_ref), np.float64)
        ).permute(0, 3, 1, 2)
    )
    np.testing.assert_allclose(
        dw, tw.grad.permute(2, 3, 1, 0).numpy(), rtol=1e-5, atol=1e-5 * np.abs(dw_ref).max()
    )

    # One convolution for the forward pass and one for the input gradient: none for the kernel's.
    hlo = jax.jit(loss(convolution.conv_general_dilated)).lower(x, w).as_text()
    assert hlo.count("convolution(") == 2, hlo.count("convolution(")


def test_one_device_per_core_keeps_xla_kernel_gradient(monkeypatch):
    """With every core holding a CPU device, the split batch keeps the cores busy: XLA's own."""
    monkeypatch.setattr(convolution, "_cores_left_idle", lambda: False)
    monkeypatch.setattr(convolution, "kernel_gradient_path", lambda *a, **k: "products")
    x, w = jnp.ones((2, 16, 16, 64)), jnp.ones((3, 3, 64, 64))
    grad = jax.grad(
        lambda *a: _loss(convolution.conv_general_dilated, *a, 1, "SAME"), (0, 1), has_aux=True
    )
    assert (
        jax.jit(grad).lower(x, w).as_text().count("convolution(") == 3
    )  # forward, input and kernel


def test_few_channels_keep_xla_kernel_gradient():
    x, w = jnp.ones((2, 16, 16, 32)), jnp.ones((3, 3, 32, 32))
    grad = jax.grad(
        lambda *a: _loss(convolution.conv_general_dilated, *a, 1, "SAME"), (0, 1), has_aux=True
    )
    assert (
        jax.jit(grad).lower(x, w).as_text().count("convolution(") == 3
    )  # forward, input and kernel


def test_untimed_large_maps_keep_xla_kernel_gradient(monkeypatch):
    """With the timing off (as in the suite), the kernel gradient is XLA's on every machine."""
    monkeypatch.setattr(convolution, "_cores_left_idle", lambda: True)
    monkeypatch.setattr(autotune, "_enabled", False)
    x, w = jnp.ones((2, 16, 16, 64)), jnp.ones((3, 3, 64, 64))
    grad = jax.grad(
        lambda *a: _loss(convolution.conv_general_dilated, *a, 1, "SAME"), (0, 1), has_aux=True
    )
    assert jax.jit(grad).lower(x, w).as_text().count("convolution(") == 3


def test_forced_kernel_gradient_overrides_the_timed_choice_and_the_cores(monkeypatch):
    """forced_kernel_gradient picks the path for every large map, untimed, busy cores or not;
    small maps keep XLA's; the rule comes back after the block."""
    monkeypatch.setattr(convolution, "kernel_gradient_path", lambda *a, **k: pytest.fail("timed"))
    monkeypatch.setattr(convolution, "_cores_left_idle", lambda: False)

    def convolutions(shape):
        x, w = jnp.ones(shape), jnp.ones((3, 3, shape[-1], shape[-1]))
        grad = jax.grad(
            lambda *a: _loss(convolution.conv_general_dilated, *a, 1, "SAME"), (0, 1), has_aux=True
        )
        return jax.jit(grad).lower(x, w).as_text().count("convolution(")

    with convolution.forced_kernel_gradient("products"):
        assert convolutions((2, 16, 16, 64)) == 2  # forward and input gradient
        assert convolutions((2, 8, 8, 64)) == 3  # below the rule's map size
    with convolution.forced_kernel_gradient("xla"):
        assert convolutions((2, 16, 16, 64)) == 3
    assert convolutions((2, 16, 16, 64)) == 3  # busy cores: XLA's, untimed
    with pytest.raises(ValueError, match=r"path='matmul', expected one of \('xla', 'products'\)"):
        with convolution.forced_kernel_gradient("matmul"):
            pass


def test_kernel_gradient_candidates_agree_and_the_timed_choice_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune.ENV_CACHE, str(tmp_path / "cpu_rules.json"))
    monkeypatch.setattr(autotune, "_enabled", True)
    monkeypatch.setattr(autotune, "_windows", 1)  # as inside a training run's first step
    monkeypatch.setattr(autotune, "_choices", {})
    shapes = ((2, 8, 9, 16), (3, 3, 16, 8), (2, 2), ((0, 1), (1, 1)), jnp.float32)
    candidates = convolution.kernel_gradient_candidates(*shapes)
    xla, products = (candidates[name]()() for name in ("xla", "products"))
    for ours, ref in zip(products, xla):  # the input and the kernel gradient
        ref = np.asarray(ref)
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())

    choice = convolution.kernel_gradient_path(*shapes)
    assert choice in ("xla", "products")
    monkeypatch.setattr(autotune, "_choices", {})
    monkeypatch.setattr(autotune, "time_candidates", lambda *a: pytest.fail("timed twice"))
    assert convolution.kernel_gradient_path(*shapes) == choice  # read back from the disk cache
