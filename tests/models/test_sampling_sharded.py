"""attnjax/models/sampling.py on a mesh with a ``model`` axis: the prior's parameters laid out by
its rules and sampled under ``attnjax.inference.generate.on_mesh`` give one device's tokens, and
the compiled program keeps each device's heads of the key/value cache (``CACHE_AXES`` of
attnjax/models/multihead.py) without gathering it."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from helpers import ROOT, assert_relative, xla_flags

# One layer of width 24, 4 heads of 6, over a 3x3 grid (9 tokens; 21 codes, 11 classes, the null
# token: vocabulary 33, which no model axis divides, padded to 40). 4 class rows and their 4 null
# rows under guidance: the whole cache of a layer is f32[8,9,4,6], [rows, length, heads, head_dim].
SCRIPT = textwrap.dedent("""
    import contextlib, json, re
    import flax.linen as nn
    import jax, jax.numpy as jnp
    from attnjax.inference import generate
    from attnjax.models import gpt, sampling
    from attnjax.parallel import sharding

    model = gpt.GPT(vocab_size=33, vocab_multiple=8, block_size=9, n_layer=1, n_head=4, n_embd=24)
    params = model.init(jax.random.key(0), jnp.zeros((1, 9), jnp.int32))["params"]
    # Every parameter random: minGPT's init leaves biases, norms and positions constant.
    leaves, tree = jax.tree.flatten(params)
    params = jax.tree.unflatten(tree, [leaf + 0.3 * jax.random.normal(jax.random.key(i), leaf.shape)
                                       for i, leaf in enumerate(leaves)])
    prefix = jnp.array([[21], [24], [27], [30]], jnp.int32)

    def sampled(mesh, rules=None):
        # Tokens, logits, and the cache-shaped arrays of the program compiled for the mesh.
        def draw(params, prefix, rng):
            return sampling.sample(model, params, prefix, rng, 9, temperature=0.9, top_k=8,
                                   num_codes=21, guidance=2.0,
                                   null_prefix=jnp.full_like(prefix, 32),
                                   return_logits=True)
        placed = params if mesh is None else generate.place_params(params, mesh)
        with contextlib.ExitStack() as stack:
            if rules is None:
                stack.enter_context(generate.on_mesh(mesh))
            else:
                stack.enter_context(jax.set_mesh(mesh))
                stack.enter_context(nn.logical_axis_rules(rules))
            compiled = jax.jit(draw).lower(placed, prefix, jax.random.key(3)).compile()
            tokens, logits = compiled(placed, prefix, jax.random.key(3))
        hlo = compiled.as_text()
        cache = r"f32\\[\\d+,9,\\d+,6\\]"
        return {"tokens": tokens.tolist(), "logits": logits.tolist(),
                "caches": sorted(set(re.findall(cache, hlo))),
                "gathered": re.findall(r"= (" + cache + r")\\S* all-gather\\(", hlo)}

    out = {"one": sampled(None)}
    for sizes in ("model=2", "data=2,model=2"):
        out[sizes] = sampled(generate.parse_mesh(sizes))
    # The same layout with the rules naming no axis for the heads: the cache is gathered whole,
    # which the checks below must see.
    mesh = generate.parse_mesh("data=2,model=2")
    out["heads_whole"] = sampled(mesh, (*sharding.activation_axis_rules(mesh), ("heads", None)))
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def on_eight_devices():
    """The script above on 8 CPU devices -> its result per layout."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


def test_the_tokens_on_a_model_axis_are_one_devices(on_eight_devices):
    one = on_eight_devices["one"]
    assert len({token for row in one["tokens"] for token in row}) > 3  # no constant output
    for layout in ("model=2", "data=2,model=2"):
        got = on_eight_devices[layout]
        assert got["tokens"] == one["tokens"], layout
        assert_relative(got["logits"], one["logits"], 1e-5, what=layout)


def test_each_device_keeps_its_heads_of_the_cache(on_eight_devices):
    # One device holds the whole cache: the pattern finds it.
    assert on_eight_devices["one"]["caches"] == ["f32[8,9,4,6]"]
    # model=2: two heads of four each, every row; data=2 also halves the rows.
    assert on_eight_devices["model=2"]["caches"] == ["f32[8,9,2,6]"]
    assert on_eight_devices["data=2,model=2"]["caches"] == ["f32[4,9,2,6]"]
    for layout in ("model=2", "data=2,model=2"):
        assert on_eight_devices[layout]["gathered"] == [], layout
    # Rules that name no axis for the heads make XLA gather the cache: the checks above see it.
    whole = on_eight_devices["heads_whole"]
    assert "f32[4,9,4,6]" in whole["caches"] and whole["gathered"]
    assert whole["tokens"] == on_eight_devices["one"]["tokens"]
