"""attnjax.ops.dense: a Dense layer's product with the leading axes merged on a CPU, against torch's
linear in float64 (values and gradients), the compiled CPU gradient free of the input's transposed
copy, and a program lowered for a TPU keeping the product as written."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from attnjax.ops.dense import rows_dot_general

SHAPE, FEATURES = (8, 129, 128), 40  # 129 tokens: no tile size divides them; >= MERGE_MIN_ELEMENTS


def _layer(dot_general):
    return nn.Dense(FEATURES, dot_general=dot_general)


def _inputs():
    rng = np.random.default_rng(0)
    return rng.normal(size=SHAPE), rng.normal(size=SHAPE[:-1] + (FEATURES,))


def _loss(params, x, target, dot_general):
    return jnp.sum((_layer(dot_general).apply({"params": params}, x) - target) ** 2)


def _close(got, want):
    """Float32 against float64: within 1e-5 of the reference's largest magnitude."""
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.max(np.abs(want)))


def test_values_and_gradients_equal_torch_linear():
    x, target = _inputs()
    x32, target32 = jnp.asarray(x, jnp.float32), jnp.asarray(target, jnp.float32)
    params = _layer(rows_dot_general).init(jax.random.key(0), x32)["params"]
    loss, grads = jax.value_and_grad(_loss, argnums=(0, 1))(params, x32, target32, rows_dot_general)
    linear = torch.nn.Linear(SHAPE[-1], FEATURES, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(np.asarray(params["kernel"], np.float64).T.copy()))
        linear.bias.copy_(torch.from_numpy(np.asarray(params["bias"], np.float64)))
    inputs = torch.from_numpy(x).requires_grad_()
    reference = ((linear(inputs) - torch.from_numpy(target)) ** 2).sum()
    reference.backward()
    _close(float(loss), reference.item())
    _close(grads[0]["kernel"], linear.weight.grad.numpy().T)
    _close(grads[0]["bias"], linear.bias.grad.numpy())
    _close(grads[1], inputs.grad.numpy())


def test_other_contractions_pass_through_unchanged():
    x, w = jnp.ones((2, 3, 5)), jnp.ones((2, 5, 7))
    batched = (((2,), (1,)), ((0,), (0,)))  # not a Dense product: lax's own result
    assert jnp.array_equal(rows_dot_general(x, w, batched), lax.dot_general(x, w, batched))
    product = lambda a, b: rows_dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())))
    staged = lambda a: "cond" in str(jax.make_jaxpr(product)(a, jnp.ones((a.shape[-1], 7))))
    assert staged(jnp.ones(SHAPE))
    assert not staged(jnp.ones((SHAPE[0] * SHAPE[1], SHAPE[2])))  # already one matrix
    assert not staged(jnp.ones((2, 3, 5)))  # under MERGE_MIN_ELEMENTS: the copies cost less
    # Any batch (a shape-polymorphic export): no size to compare, the product as written.
    batch = jax.export.symbolic_shape("b")[0]
    assert not staged(jax.ShapeDtypeStruct((batch, *SHAPE[1:]), jnp.float32))


def _gradient_program(dot_general):
    x, target = (jnp.asarray(a, jnp.float32) for a in _inputs())
    params = _layer(dot_general).init(jax.random.key(0), x)["params"]
    grad = jax.jit(jax.grad(_loss), static_argnums=3)
    return grad.lower(params, x, target, dot_general)


def test_cpu_gradient_copies_no_operand_transposed():
    rows = SHAPE[0] * SHAPE[1]
    # An operand of the kernel's gradient copied into a transposed [features, rows] array: the
    # input (f32[24, 52]) or the output's gradient (f32[40, 52]), whichever XLA:CPU picks.
    transposed = re.compile(
        rf"= f32\[({SHAPE[-1]}|{FEATURES}),{rows}\]\S* (fusion|copy|transpose)\("
    )
    plain = _gradient_program(lax.dot_general).compile().as_text()
    merged = _gradient_program(rows_dot_general).compile().as_text()
    assert transposed.search(plain), "XLA:CPU no longer copies the input: the merge is moot"
    assert not transposed.search(merged), merged


def test_tpu_program_keeps_the_product_as_written():
    lowered = jax.jit(lambda x, w: rows_dot_general(x, w, (((2,), (0,)), ((), ())))).trace(
        jnp.ones(SHAPE), jnp.ones((SHAPE[-1], FEATURES))
    )
    tpu = lowered.lower(lowering_platforms=("tpu",)).as_text()
    cpu = lowered.lower(lowering_platforms=("cpu",)).as_text()
    three_d = f"tensor<{SHAPE[0]}x{SHAPE[1]}x{SHAPE[2]}xf32>, tensor<{SHAPE[2]}x{FEATURES}xf32>"
    assert three_d in tpu and "stablehlo.reshape" not in tpu
    rows = SHAPE[0] * SHAPE[1]
    assert f"tensor<{rows}x{SHAPE[2]}xf32>, tensor<{SHAPE[2]}x{FEATURES}xf32>" in cpu
