"""attnjax.ops.activations.gelu against the exact GELU in float64 (scipy's erf; values and
gradients), the dtype kept, and the compiled CPU program free of erfc's two-branch expansion.
PyTorch's GELU: test_activations_torch.py."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_close
from scipy import special

from attnjax.ops.activations import gelu


def gelu_inputs():
    """The whole range: where Phi underflows in float32, both tails, zero and the unit scale."""
    rng = np.random.default_rng(0)
    sweep = np.linspace(-12.0, 12.0, 4001)
    return np.concatenate([sweep, 2.0 * rng.standard_normal(20000), [0.0, -0.0]]).astype(np.float32)


def test_values_and_gradients_equal_float64():
    x = gelu_inputs()
    wide = x.astype(np.float64)
    cdf = 0.5 * (1.0 + special.erf(wide / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * wide * wide) / math.sqrt(2.0 * math.pi)
    out = gelu(x)
    grad = jax.vmap(jax.grad(gelu))(x)
    assert out.dtype == jnp.float32 and grad.dtype == jnp.float32
    assert_close(out, wide * cdf, what="gelu(x)")
    assert_close(grad, cdf + wide * pdf, what="d gelu(x) / dx")


def test_keeps_the_input_dtype():
    x = jnp.linspace(-4.0, 4.0, 101, dtype=jnp.bfloat16)
    out = gelu(x)
    assert out.dtype == jnp.bfloat16
    wide = np.asarray(x, np.float64)
    expected = 0.5 * wide * (1.0 + special.erf(wide / math.sqrt(2.0)))
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=2e-2, atol=2e-2)


def test_integers_become_the_default_float():
    out = gelu(jnp.arange(-3, 4))
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, gelu(jnp.arange(-3.0, 4.0)))


def _operations(f):
    program = (
        jax.jit(jax.value_and_grad(lambda x: jnp.sum(f(x))))
        .lower(jnp.ones((64, 512), jnp.float32))
        .compile()
        .as_text()
    )
    plumbing = {"parameter", "constant", "broadcast", "bitcast", "fusion", "tuple"}
    return [op for op in re.findall(r"= \S+ ([\w-]+)\(", program) if op not in plumbing]


def test_compiled_gradient_is_one_branch_without_divisions():
    ours = _operations(gelu)
    erfc_form = _operations(lambda x: jax.nn.gelu(x, approximate=False))
    assert not {"select", "divide"} & set(ours), ours
    assert {"select", "divide"} <= set(erfc_form), erfc_form  # what the rewrite avoids
    assert 2 * len(ours) < len(erfc_form), (len(ours), len(erfc_form))
