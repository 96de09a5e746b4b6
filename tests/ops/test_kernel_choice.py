"""attnjax/ops/kernel_choice.py: the attention kernel is chosen for the platform a program is
lowered for, not the host that traces it: Pallas splash in TPU programs, XLA or the blocked path
in CPU ones, from one trace."""

import jax
import jax.numpy as jnp
import pytest
from helpers import long_attention_programs, lowered_text

from attnjax.ops import attention, autotune, kernel_choice

TPU_KERNEL = "tpu_custom_call"  # how a Pallas TPU kernel appears in StableHLO


@pytest.mark.parametrize(
    "platform, dtype, lengths, dims, mask_kind, serves, expected",
    [
        ("cpu", jnp.float32, (63, 63), (64, 64), None, False, "xla"),
        ("cpu", jnp.float32, (65, 65), (64, 64), None, False, "explicit"),
        ("cpu", jnp.float32, (1, 512), (64, 32), None, False, "blocked"),
        ("cpu", jnp.float32, (8, 8), (64, 32), None, False, "explicit"),
        ("tpu", jnp.bfloat16, (197, 197), (64, 64), None, True, "xla"),
        ("tpu", jnp.bfloat16, (1024, 1024), (64, 64), "key_padding", True, "splash"),
        ("tpu", jnp.float32, (16384, 16384), (128, 128), None, True, "splash"),
        ("tpu", jnp.bfloat16, (1024, 1024), (64, 64), "additive", False, "xla"),
        ("tpu", jnp.bfloat16, (1, 4096), (64, 64), None, True, "blocked"),  # decoding a token
        ("cuda", jnp.bfloat16, (197, 197), (64, 64), None, False, "cudnn"),
        ("cuda", jnp.bfloat16, (1024, 1024), (256, 256), None, False, "xla"),
        ("cuda", jnp.float32, (1024, 1024), (64, 64), None, False, "xla"),
        ("cuda", jnp.float32, (16384, 16384), (64, 64), None, False, "blocked"),
        ("rocm", jnp.bfloat16, (1024, 1024), (64, 64), None, True, "xla"),
    ],
)
def test_rule(platform, dtype, lengths, dims, mask_kind, serves, expected):
    chosen = kernel_choice.choose_implementation(
        platform, dtype, *lengths, *dims, mask_kind=mask_kind, splash_serves=serves
    )
    assert chosen == expected


def _attention(is_causal, mask=None):
    def loss(q, k, v):
        out = attention.dot_product_attention(q, k, v, mask, is_causal=is_causal)
        return jnp.sum(out.astype(jnp.float32))

    return jax.grad(loss, (0, 1, 2))


# The closing table's shapes: ViT-B/16 (197 tokens, 12 heads of 64), and 1k/4k/16k causal.
SHAPES = [(197, 12, 64, False), (1024, 8, 128, True), (4096, 8, 128, True), (16384, 8, 128, True)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("length, heads, depth, is_causal", SHAPES)
def test_one_trace_carries_each_platforms_kernel(length, heads, depth, is_causal, dtype):
    x = jax.ShapeDtypeStruct((1, length, heads, depth), dtype)
    traced = jax.jit(_attention(is_causal)).trace(x, x, x)
    tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    splash = length >= kernel_choice.TPU_SPLASH_MIN_LENGTH
    # Forward, and the backward's dq and dk/dv kernels.
    assert tpu.count(TPU_KERNEL) == (3 if splash else 0)
    assert TPU_KERNEL not in cpu
    # CPU: blocked (a loop over tiles) from 512 tokens; below, explicit or XLA (no loop).
    assert ("stablehlo.while" in cpu) == (length >= kernel_choice.BLOCKED_MIN_LENGTH_CPU)


def test_key_padding_mask_goes_to_the_tpu_kernel_and_a_general_mask_does_not():
    x = jax.ShapeDtypeStruct((2, 1024, 2, 64), jnp.bfloat16)
    padding = jnp.ones((2, 1, 1, 1024), bool)
    general = jnp.ones((2, 1, 1024, 1024), bool)
    assert TPU_KERNEL in lowered_text(_attention(True, padding), (x, x, x), "tpu")
    assert TPU_KERNEL not in lowered_text(_attention(True, general), (x, x, x), "tpu")


@pytest.mark.parametrize("name", list(long_attention_programs()))
def test_models_carry_the_tpu_kernel_forward_and_backward(name):
    function, args = long_attention_programs()[name]
    tpu_calls = lowered_text(function, args, "tpu").count(TPU_KERNEL)
    assert tpu_calls == (3 if "backward" in name else 1)
    assert TPU_KERNEL not in lowered_text(function, args, "cpu")


def test_tpu_program_compiles_with_libtpu(tpu_devices):
    """A real TPU compile (v5e, compile-only devices): the kernel's tiles fit its VMEM, and the
    batch is split over a 2 x 2 mesh (a Mosaic kernel cannot be partitioned by XLA: it runs
    under the shard_map the mesh context gives)."""
    devices = tpu_devices("v5e:2x2")
    mesh = jax.make_mesh(
        (2, 2), ("data", "fsdp"), devices=devices, axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    x = jax.ShapeDtypeStruct((4, 2048, 8, 128), jnp.bfloat16, sharding=batch)

    def on_mesh(q, k, v):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return _attention(True)(q, k, v)

    compiled = jax.jit(on_mesh).lower(x, x, x).compile()
    text = compiled.as_text()
    assert "all-gather" not in text  # each device attends over its own examples
    # Arguments and outputs: q, k, v and their gradients, one example of four per device.
    per_device = 2048 * 8 * 128 * 2
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes == 3 * per_device
    # (plus the output tuple's table of pointers)
    assert 3 * per_device <= memory.output_size_in_bytes < 3 * per_device + 1024
    assert text.count(f'custom_call_target="{TPU_KERNEL}"') == 3


def test_one_cpu_timing_serves_every_shape_of_its_class(monkeypatch, tmp_path):
    """Lengths up to the next power of two and batch x heads up to the next power of four share
    a class: one timing (faked here) chooses for all of them, and a class never timed takes
    the rule's default without timing."""
    monkeypatch.setenv(autotune.ENV_CACHE, str(tmp_path / "cpu_rules.json"))
    monkeypatch.setattr(autotune, "_enabled", True)
    monkeypatch.setattr(autotune, "_choices", {})
    timed = []

    def time_candidates(candidates):
        timed.append(sorted(candidates))
        return {name: 0.5 if name == "blocked" else 1.0 for name in candidates}

    monkeypatch.setattr(autotune, "time_candidates", time_candidates)

    def path(batch, length, heads):
        shape = jax.ShapeDtypeStruct((batch, length, heads, 32), jnp.float32)
        return attention.timed_cpu_path(shape, shape, shape, None, True, "explicit")

    with autotune.timing_window():
        assert path(2, 600, 4) == "blocked" and len(timed) == 1
        # Below CPU_TIMED_FROM the rule's path, untimed even inside the window.
        assert path(2, kernel_choice.CPU_TIMED_FROM - 1, 4) == "explicit" and len(timed) == 1
    assert path(3, 1000, 4) == "blocked"  # 1024 tokens, 12 rows: the class of 600 tokens, 8 rows
    assert path(1, 700, 16) == "blocked"
    assert len(timed) == 1
    assert path(8, 600, 4) == "explicit"  # 32 rows round up to 64: never timed, the default
    assert len(timed) == 1
    assert kernel_choice.cpu_shape_class(
        (2, 70, 4, 32), (2, 70, 4, 32), (2, 70, 4, 32), jnp.float32, True, None
    ) == ("queries 128 keys 128 rows 16 dims 32/32 float32 causal True mask None")


@pytest.mark.parametrize("cores_per_device", [1, 2])
def test_cpu_tiles_follow_the_cores_each_device_has(monkeypatch, cores_per_device):
    # One device per core (train.py's CPU default) takes 128 x 128 tiles at every length; a
    # device over several cores, the taller tiles from CPU_LONG_BLOCK_FROM tokens
    # (benchmarks/results/attention_tiles.md).
    devices = len(jax.local_devices(backend="cpu"))
    monkeypatch.setattr(kernel_choice, "cpu_cores", lambda: devices * cores_per_device)
    assert kernel_choice.cores_per_cpu_device() == cores_per_device
    default = (kernel_choice.DEFAULT_QUERY_BLOCK, kernel_choice.DEFAULT_KEY_BLOCK)
    tall = (kernel_choice.CPU_LONG_QUERY_BLOCK, kernel_choice.CPU_LONG_KEY_BLOCK)
    long = kernel_choice.CPU_LONG_BLOCK_FROM
    assert kernel_choice.blocked_tiles("cpu", long - 1, long - 1) == default
    assert kernel_choice.blocked_tiles("cpu", long, long) == (
        tall if cores_per_device > 1 else default
    )
    assert kernel_choice.blocked_tiles("tpu", long, long) == default
