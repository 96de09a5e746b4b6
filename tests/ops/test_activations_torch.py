"""attnjax.ops.activations.gelu against PyTorch's GELU (``torch.nn.functional.gelu``, exact) in
float32 and float64: values and the input's gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_close

from attnjax.ops.activations import gelu


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_values_and_gradients_equal_torch(dtype):
    # Both tails, the float32 underflow of Phi below about -5.5, and the unit scale densely.
    x = np.linspace(-12.0, 12.0, 24001, dtype=np.float32)
    weights = np.linspace(-1.0, 1.0, x.size).astype(np.float32)
    t = torch.tensor(x, dtype=dtype, requires_grad=True)
    expected = torch.nn.functional.gelu(t)
    (expected * torch.tensor(weights, dtype=dtype)).sum().backward()
    out = gelu(x)
    grad = jax.grad(lambda x: jnp.sum(gelu(x) * weights))(x)
    # Where 1 + erf cancels (x near -3), torch's own float32 GELU is up to 1e-6 from float64's:
    # two float32 answers may then differ by twice that.
    floor = 1e-6 if dtype == torch.float64 else 2e-6
    assert_close(out, expected.detach().numpy(), atol=floor, what="gelu(x)")
    assert_close(grad, t.grad.numpy(), atol=floor, what="d gelu(x) / dx")
