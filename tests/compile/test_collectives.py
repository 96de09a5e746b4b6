"""attnjax.compile.collectives: the bytes a compiled program's collectives move, loops included,
against the bytes the program's arithmetic needs, counted by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attnjax.compile import collectives, targets

LAYERS, ROWS, WIDTH, OUT = 5, 16, 64, 32


@pytest.fixture(scope="module")
def v5e_2x2():
    return targets.parse("tpu:v5e:2x2")


@pytest.mark.parametrize("scanned", [True, False])
def test_a_loop_of_layers_counts_each_trip(v5e_2x2, scanned):
    # Each layer contracts x's model-split width with its kernel's model-split rows: every
    # device holds a partial [ROWS, OUT] product, and an all-reduce sums the four, once per layer.
    # XLA:TPU keeps no trip count on its loops; the scanned program's comes from its condition.
    mesh = jax.sharding.Mesh(np.array(v5e_2x2.devices), ("model",))
    split = lambda *spec: NamedSharding(mesh, P(*spec))
    kernels = jax.ShapeDtypeStruct((LAYERS, WIDTH, OUT), jnp.float32, sharding=split(None, "model"))
    x = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32, sharding=split(None, "model"))

    def layer(h, kernel):
        y = jax.lax.with_sharding_constraint(h @ kernel, split())
        return jax.lax.with_sharding_constraint(jnp.tile(jnp.tanh(y), (1, 2)), split(None, "model"))

    def layers(kernels, x):
        if scanned:
            return jax.lax.scan(lambda h, k: (layer(h, k), None), x, kernels)[0]
        for i in range(LAYERS):
            x = layer(x, kernels[i])
        return x

    hlo = jax.jit(layers).lower(kernels, x).compile().as_text()
    moved = collectives.moved_bytes(hlo)
    assert moved["all-reduce"] == LAYERS * ROWS * OUT * 4, moved
    assert moved["unknown_trip_loops"] == 0


def test_result_bytes_reads_arrays_tuples_and_dtypes():
    assert collectives.result_bytes("f32[16,32]{1,0}") == 16 * 32 * 4
    assert collectives.result_bytes("(bf16[8]{0}, f32[2,2]{1,0}, s32[])") == 16 + 16 + 4
    assert collectives.result_bytes("f8e4m3fn[1024]{0:T(1024)}") == 1024
