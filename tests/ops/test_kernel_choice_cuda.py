"""CUDA programs carry cuDNN flash attention (needs the jax CUDA plugin: `make test-cuda` runs
these in `.venv-gpu`), and a ViT exported for cpu, cuda and tpu carries each platform's kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, long_attention_programs, long_vit, lowered_text

from attnjax.inference import export
from attnjax.ops import attention

pytestmark = pytest.mark.cuda
CUDNN = "__cudnn$fmha"  # the custom calls of cuDNN's fused attention, forward and backward


@pytest.mark.parametrize("name", list(long_attention_programs()))
def test_models_carry_cudnn_in_bfloat16_and_not_in_float32(name):
    function, args = long_attention_programs(jnp.bfloat16)[name]
    text = lowered_text(function, args, "cuda")
    # The forward kernel (which also saves the softmax statistics for the backward), and the
    # backward kernel in a gradient.
    assert text.count(f"@{CUDNN}") == (2 if "backward" in name else 1)
    function, args = long_attention_programs(jnp.float32)[name]
    assert CUDNN not in lowered_text(function, args, "cuda")


@pytest.mark.parametrize("length, heads, depth", [(197, 12, 64), (1024, 8, 128), (16384, 8, 128)])
def test_cudnn_for_bfloat16_at_every_length(length, heads, depth):
    x = jax.ShapeDtypeStruct((1, length, heads, depth), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(attention.dot_product_attention(q, k, v, is_causal=True))

    text = lowered_text(jax.grad(loss, (0, 1, 2)), (x, x, x), "cuda")
    assert text.count(f"@{CUDNN}") == 2


def test_vit_exported_for_three_platforms():
    model = long_vit(dtype=jnp.bfloat16)
    images = np.random.default_rng(0).standard_normal((2, 32, 32, 3)).astype(np.float32)
    variables = model.init(jax.random.key(0), images)
    logits = lambda images: model.apply(variables, images)
    batch = jax.export.symbolic_shape("batch")[0]
    specs = [jax.ShapeDtypeStruct((batch, 32, 32, 3), jnp.float32)]
    programs = {p: export.export_for(logits, specs, p) for p in ("cpu", "cuda", "tpu")}
    assert CUDNN in programs["cuda"].mlir_module()
    assert "tpu_custom_call" in programs["tpu"].mlir_module()
    for platform in ("cpu", "cuda"):
        assert "tpu_custom_call" not in programs[platform].mlir_module()
    on_cpu = jax.export.deserialize(programs["cpu"].serialize()).call(images)
    assert_close(on_cpu, jax.jit(logits)(images), rtol=0, atol=0, what="exported CPU logits")
