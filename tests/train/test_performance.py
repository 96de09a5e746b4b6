"""attnjax/train/performance.py and accelerators.py: FLOPs of a traced step, MFU's arithmetic,
the profile window's steps."""

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from attnjax.train import accelerators, performance


def test_traced_flops_count_a_matrix_product():
    a = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    b = jax.ShapeDtypeStruct((128, 32), jnp.float32)
    assert performance.traced_flops(lambda x, y: x @ y, a, b) == 2 * 64 * 128 * 32


def test_mfu_divides_the_step_rate_by_the_peak_it_names():
    config = ml_collections.ConfigDict({"peak_flops": 1e12})
    devices = jax.devices("cpu")[:1]
    utilization = performance.Utilization(devices, config, flops_per_step=2e11)
    assert utilization.source == "1 x config.peak_flops"
    scalars = utilization.scalars(steps_per_sec=2.0)
    assert scalars == pytest.approx({"train/tflops_per_device": 0.4, "train/mfu": 0.4})
    assert performance.Utilization(devices, config).scalars(2.0) == {}


def test_a_jitted_step_is_counted_once_from_its_trace():
    utilization = performance.Utilization(jax.devices("cpu")[:1])
    step = jax.jit(lambda x, w: jnp.tanh(x @ w))
    x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
    utilization.count(step, x, w)
    assert utilization.flops_per_step == 2 * 8 * 16 * 4
    utilization.count(step, jnp.ones((80, 16)), w)  # counted already: kept
    assert utilization.flops_per_step == 2 * 8 * 16 * 4


def test_a_cpu_peak_is_a_measured_matrix_product():
    peak, source = accelerators.peak_flops(jax.devices("cpu")[0])
    assert source.startswith("measured") and 1e8 < peak < 1e14


@pytest.mark.parametrize("text, steps", [("", None), ("3:6", range(3, 6)), ("4", range(4, 5))])
def test_profile_steps_are_a_range(text, steps):
    assert performance.parse_steps(text) == steps


@pytest.mark.parametrize("text", ["6:3", "0:2", "a:b"])
def test_bad_profile_steps_are_named(text):
    with pytest.raises(ValueError, match=f"config.profile_steps={text!r}"):
        performance.parse_steps(text)


def test_recomputed_blocks_are_not_model_flops():
    """A remat model's gradient runs each block's forward twice; MFU counts it once."""
    from attnjax.models import vit

    model = vit.ViT(
        num_classes=10, patch_size=4, width=32, depth=2, num_heads=2, mlp_dim=64, remat=True
    )
    images = jnp.ones((4, 16, 16, 3))
    params = jax.eval_shape(model.init, jax.random.key(0), images)["params"]

    def step_flops(module):
        loss = lambda p: module.apply({"params": p}, images).sum()  # noqa: E731
        return performance.traced_flops(jax.grad(loss), params)

    plain = performance.without_remat(model)
    assert plain.remat is False and model.remat is True
    assert step_flops(model) > step_flops(plain) == step_flops(model.clone(remat=False))
    # What is recomputed: the blocks' forward, the model's less its embedding and head.
    blocks = model.clone(depth=1).apply, model.clone(depth=2).apply
    one, two = (
        performance.traced_flops(lambda p: f({"params": p}, images), params) for f in blocks
    )
    # Each of the two blocks recomputed at most once; partial evaluation may keep some of it.
    assert two - one <= step_flops(model) - step_flops(plain) <= 2 * (two - one)
    both = {"a": model, "b": None}
    assert performance.without_remat(both)["a"].remat is False
    assert performance.without_remat({"b": plain}) == {"b": plain}
