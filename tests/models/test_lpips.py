"""attnjax.models.lpips against the ``lpips`` package (0.1.4): a random VGG16 trunk (no download)
and the linear-layer weights the package ships, converted by attnjax.convert.lpips."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, lpips_distance

from attnjax.convert.lpips import lpips_from_torch


def test_lpips_matches_the_lpips_package(lpips_reference):
    reference = lpips_reference
    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (3, 32, 32, 3)).astype(np.float32)
    b = np.clip(a + rng.normal(0, 0.3, a.shape), -1, 1).astype(np.float32)
    expected = lpips_distance(reference, a, b)
    model, variables = lpips_from_torch(reference.state_dict())
    ours = model.apply(variables, jnp.asarray(a), jnp.asarray(b))
    assert_close(ours, expected, what="LPIPS distance")
    assert_close(
        model.apply(variables, jnp.asarray(a), jnp.asarray(a)), np.zeros(3), what="LPIPS(x, x)"
    )


def test_bad_inputs_raise(lpips_reference):
    model, variables = lpips_from_torch(lpips_reference.state_dict())
    with pytest.raises(ValueError, match="at least 16x16"):
        model.apply(variables, jnp.zeros((1, 8, 8, 3)), jnp.zeros((1, 8, 8, 3)))
    with pytest.raises(ValueError, match="height, width, 3"):
        model.apply(variables, jnp.zeros((1, 16, 16, 1)), jnp.zeros((1, 16, 16, 1)))
