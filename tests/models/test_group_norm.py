"""attnjax.models.group_norm against torch.nn.GroupNorm (values and every gradient) and against
Flax's nn.GroupNorm with the same parameters."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_relative, nchw, nhwc, relative_to_max

from attnjax.models.group_norm import GroupNorm, group_norm

# (shape, groups): VQGAN's widths at 32 groups, one group, one channel per group, a 1-d map; an
# offset mean, where a one-pass variance would lose digits.
CASES = [((3, 8, 8, 64), 32, 0.0), ((2, 5, 7, 32), 1, 0.0), ((2, 4, 4, 16), 16, 0.0)]
CASES += [((2, 9, 48), 4, 0.0), ((2, 6, 6, 32), 8, 30.0)]


def _inputs(shape, channels, offset):
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 2 + offset).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, channels).astype(np.float32)
    bias = rng.standard_normal(channels).astype(np.float32)
    return x, scale, bias


@pytest.mark.parametrize("shape,groups,offset", CASES)
def test_values_and_gradients_match_torch(shape, groups, offset):
    channels = shape[-1]
    x, scale, bias = _inputs(shape, channels, offset)
    d_out = np.random.default_rng(1).standard_normal(shape).astype(np.float32)

    reference = torch.nn.GroupNorm(groups, channels, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_(torch.from_numpy(scale))
        reference.bias.copy_(torch.from_numpy(bias))
    channels_first = lambda a: nchw(a) if a.ndim == 4 else torch.from_numpy(a.swapaxes(1, 2))
    back = lambda t: nhwc(t) if t.ndim == 4 else t.detach().numpy().swapaxes(1, 2)
    tx = channels_first(x).requires_grad_(True)
    out = reference(tx)
    out.backward(channels_first(d_out))

    @jax.jit  # one program per case: the eager ops would each compile on their own
    def forward_backward(x, scale, bias):
        y, vjp = jax.vjp(lambda *a: group_norm(*a, groups, 1e-6), x, scale, bias)
        return y, vjp(d_out)

    y, (dx, d_scale, d_bias) = forward_backward(x, scale, bias)
    assert_relative(y, back(out), what="output")
    assert_relative(dx, back(tx.grad), what="input gradient")
    assert_relative(d_scale, reference.weight.grad.numpy(), what="scale gradient")
    assert_relative(d_bias, reference.bias.grad.numpy(), what="bias gradient")


def test_module_loads_flax_groupnorm_parameters_and_agrees():
    x, _, _ = _inputs((2, 8, 8, 64), 64, 0.0)
    flax_norm = nn.GroupNorm(num_groups=32, epsilon=1e-6, use_fast_variance=False)
    variables = flax_norm.init(jax.random.key(0), x)
    rng = np.random.default_rng(2)
    variables = jax.tree.map(lambda p: p + rng.standard_normal(p.shape, np.float32), variables)
    ours = GroupNorm(num_groups=32, epsilon=1e-6)
    assert jax.tree.map(jnp.shape, ours.init(jax.random.key(0), x)) == jax.tree.map(
        jnp.shape, variables
    )
    assert_relative(ours.apply(variables, x), flax_norm.apply(variables, x))


def test_bfloat16_output_with_float32_statistics():
    x, _, _ = _inputs((2, 8, 8, 64), 64, 3.0)
    ours = GroupNorm(num_groups=32, epsilon=1e-6, dtype=jnp.bfloat16)
    variables = ours.init(jax.random.key(0), x)
    y = ours.apply(variables, jnp.asarray(x, jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    exact = ours.clone(dtype=jnp.float32).apply(variables, jnp.asarray(x, jnp.bfloat16))
    # Only the final rounding to bfloat16 differs: 8 bits of mantissa.
    assert relative_to_max(y, exact) < 2**-7


def test_channels_that_do_not_split_into_the_groups_are_refused():
    x = np.zeros((1, 4, 4, 48), np.float32)
    with pytest.raises(ValueError, match="48 channels do not split into 32 groups"):
        GroupNorm(num_groups=32).init(jax.random.key(0), x)
