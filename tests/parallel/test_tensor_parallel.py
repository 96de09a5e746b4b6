"""Tensor parallelism (attnjax/parallel/sharding.py's ``model`` axis, Megatron's layout from the
models' logical axis names): ViT and GPT prior steps on 8 devices equal one device's, the layout
survives XLA, a checkpoint moves between layouts, and the one-line errors."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from helpers import ROOT, assert_relative, load_config, xla_flags
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from attnjax.parallel import sharding
from attnjax.tasks import classification, prior

MESHES = (
    {"data": 4, "model": 2},
    {"fsdp": 4, "model": 2},
    {"data": 2, "model": 4},
    {"data": 2, "fsdp": 2, "model": 2},
)
# The tiny models, set by train.py's flags. ViT: 8x8 images in 4x4 patches (5 tokens), width 24,
# 4 heads, MLP 64, ViT-22B's block (the script sets it). Prior: 2x2 codes of 21 (vocabulary 21 +
# 10 classes + the null token = 32), width 24, 4 heads, MLP 96.
VIT_FLAGS = (
    "--config=configs/vit_digits.py",
    "--config.model.width=24",
    "--config.model.depth=1",
    "--config.model.mlp_dim=64",
    "--config.model.image_size=8",
)
PRIOR_FLAGS = (
    "--config=configs/prior_digits.py",
    "--config.model.n_layer=1",
    "--config.model.n_embd=24",
    "--config.vqgan_codes.n_embed=21",
)
# torch's nn.Transformer beside them: width 24, 4 heads, feed-forward 64, one encoder and one
# decoder layer, sources of 5 tokens and targets of 4.
WIDTH = 24
MLP = {"vit": 64, "prior": 96, "transformer": 64}
TOKENS = {"vit": 5, "prior": 4, "transformer": 4}

SCRIPT = textwrap.dedent(r"""
    import functools, json, os, re
    from attnjax.train import collector
    collector.raise_thresholds()
    import flax, grain, jax, jax.numpy as jnp, numpy as np
    from absl import flags
    from ml_collections import config_flags
    from attnjax.models import transformer
    from attnjax.tasks import classification, prior
    from attnjax.parallel import data_parallel, sharding
    from attnjax.train import checkpoint

    assert jax.device_count() == 8, jax.devices()
    MESHES, VIT_FLAGS, PRIOR_FLAGS, TMP = {meshes!r}, {vit_flags!r}, {prior_flags!r}, {tmp!r}
    TRAINING = ("--config.batch_size=8", "--config.optimizer=sgd", "--config.learning_rate=0.3",
                "--config.warmup_steps=1", "--config.num_train_steps=3")
    ONE = ({{"data": 1}}, jax.devices()[:1])  # the reference: one device

    def parsed(config_flags_, mesh):
        # As train.py parses its command line: the mesh comes as --config.mesh.<axis>=N.
        values = flags.FlagValues()
        argv = ["train.py", *config_flags_, *TRAINING,
                *(f"--config.mesh.{{axis}}={{size}}" for axis, size in mesh.items())]
        config_flags.DEFINE_config_file("config", None, flag_values=values, sys_argv=argv)
        values(argv)
        config = values.config
        if config.task == "prior":
            config.vqgan_codes.grid = (2, 2)
        else:  # ViT-22B's block: attention and MLP in parallel, q/k LayerNorm, fewer biases
            with config.unlocked():
                config.model.update(parallel_block=True, qk_norm=True, qkv_bias=False,
                                    layer_norm_bias=False)
        return config

    def placement(rules, config_flags_, mesh, devices=None):
        # The layout of a run of these flags with --config.mesh.<axis>=N.
        config = parsed(config_flags_, mesh)
        return data_parallel.DataParallel("jit", config.batch_size, mesh=config.mesh, rules=rules,
                                     devices=devices)

    def run(dp, train_step, host_state, batches):
        # The loop's steps on dp's mesh -> (final state there, the step's compiled HLO).
        state = dp.place_state(host_state)
        step = dp.compile_train_step(train_step, dp.state_shardings(state))
        first = dp.shard_batch(batches[0])
        compiled = step.lower(state, first, jax.random.PRNGKey(0)).compile()
        for i, batch in enumerate(batches):
            state, _ = compiled(state, dp.shard_batch(batch), jax.random.PRNGKey(i))
        return state, compiled.as_text()

    def flat(tree):
        tree = flax.serialization.to_state_dict(jax.device_get(tree))
        return {{k: v for k, v in flax.traverse_util.flatten_dict(tree, sep="/").items()
                 if v is not None}}

    def all_gathers(hlo):
        # [shape, the layer whose product it feeds] of each all-gather in the program.
        gathers = []
        for shape, rest in re.findall(r"= f32\[([0-9,]*)\]\S* all-gather\((.*)", hlo):
            layer = re.search(r"(attn/\w+|mlp/fc\d|linear\d)/dot_general", rest)
            gathers.append([shape, layer.group(1) if layer else ""])
        return gathers

    def all_reduces(hlo):
        # The f32 shapes the program's all-reduces return (tuples included).
        results = " ".join(re.findall(r"= (.*?) all-reduce\(", hlo))
        return sorted(set(re.findall(r"f32\[([0-9,]+)\]", results)))

    def layouts(name, rules, config_flags_, train_step, host, batches, query):
        # The steps on one device and on every mesh: parameters saved, collectives recorded.
        np.savez(os.path.join(TMP, f"{{name}}_init.npz"), **flat(host.params))
        for mesh, devices in (ONE, *((mesh, None) for mesh in MESHES)):
            dp = placement(rules, config_flags_, mesh, devices)
            state, hlo = run(dp, train_step, host, batches)
            label = "one" if devices else "_".join(f"{{k}}{{v}}" for k, v in mesh.items())
            np.savez(os.path.join(TMP, f"{{name}}_{{label}}.npz"), **flat(state.params))
            out[f"{{name}}_{{label}}"] = {{
                "all_gathers": all_gathers(hlo),
                "all_reduces": all_reduces(hlo),
                "query_shard": list(query(state.params).addressable_shards[0].data.shape),
            }}
        return state

    out = {{}}
    rng = np.random.default_rng(0)
    labels = lambda: rng.integers(0, 10, 8).astype(np.int32)
    batches = {{
        "vit": [{{"image": rng.normal(size=(8, 8, 8, 1)).astype(np.float32), "label": labels()}}
                for _ in range(3)],
        "prior": [{{"codes": rng.integers(0, 21, (8, 4)).astype(np.int32), "label": labels()}}
                  for _ in range(3)],
    }}
    for name, task, task_flags in (("vit", classification, VIT_FLAGS),
                                   ("prior", prior, PRIOR_FLAGS)):
        config = parsed(task_flags, {{"data": 1}})
        model = task.create_model(config)
        host = jax.device_get(
            task.create_train_state(jax.random.PRNGKey(0), config, model, batches[name][0]))
        if name == "vit":  # one LayerNorm before both branches, q/k normed, no q/k/v biases
            block = host.params["blocks_0"]
            assert "norm2" not in block and "q_norm" in block["attn"], list(block)
            assert "bias" not in block["attn"]["query"] and "bias" not in block["norm1"]
        train_step = functools.partial(task.train_step, config=config, model=model)
        state = layouts(name, task.SHARDING_RULES, task_flags, train_step, host, batches[name],
                        lambda params: params["blocks_0"]["attn"]["query"]["kernel"])

    # torch's nn.Transformer (encoder and decoder, self- and cross-attention) laid out by its
    # logical axis names: plain SGD on a squared error.
    model = transformer.Transformer(d_model=24, nhead=4, num_encoder_layers=1,
                                    num_decoder_layers=1, dim_feedforward=64, dropout=0.0)

    @flax.struct.dataclass
    class State:
        params: dict

    def torch_style_step(state, batch, rng, axis_name=None):
        def loss(params):
            out = model.apply({{"params": params}}, batch["src"], batch["tgt"])
            return jnp.mean((out - batch["target"]) ** 2)
        value, grads = jax.value_and_grad(loss)(state.params)
        params = jax.tree.map(lambda p, g: p - 0.3 * g, state.params, grads)
        return state.replace(params=params), {{"loss": value}}

    sequences = [{{name: rng.normal(size=(8, length, 24)).astype(np.float32)
                   for name, length in (("src", 5), ("tgt", 4), ("target", 4))}}
                 for _ in range(3)]
    params = model.init(jax.random.PRNGKey(0), sequences[0]["src"], sequences[0]["tgt"])
    rules = (sharding.WHOLE_SCALARS, *sharding.logical_rules(transformer.PARAM_AXES),
             sharding.SPLIT_REST)
    layouts("transformer", rules, VIT_FLAGS, torch_style_step,
            State(jax.device_get(params["params"])), sequences,
            lambda params: params["encoder"]["layers_0"]["self_attn"]["query"]["kernel"])

    # The prior's state, saved on (data 2, model 2), restored on (model 1) and (fsdp 4).
    mesh = {{"data": 2, "model": 2}}
    config = parsed(PRIOR_FLAGS, mesh)
    saved = placement(prior.SHARDING_RULES, PRIOR_FLAGS, mesh, jax.devices()[:4]).place_state(state)
    workdir = os.path.join(TMP, "run")
    writer = checkpoint.Checkpointer(workdir, config)
    writer.save(3, saved, iter(grain.MapDataset.range(64).batch(8)).get_state())
    writer.close()
    np.savez(os.path.join(TMP, "saved.npz"), **flat(saved))
    shapes = jax.eval_shape(lambda: saved)
    for label, mesh, devices in (("model1", {{"model": 1}}, jax.devices()[:1]),
                                 ("fsdp4", {{"fsdp": 4}}, jax.devices()[4:])):
        dp = placement(prior.SHARDING_RULES, PRIOR_FLAGS, mesh, devices)
        reader = checkpoint.Checkpointer(workdir, config)
        restored = reader.restore(data_parallel.placed_shapes(shapes, dp.state_shardings(shapes)),
                                  iter(grain.MapDataset.range(64).batch(8)), step=3)
        reader.close()
        kernel = restored.params["blocks_0"]["mlp"]["fc1"]["kernel"]
        out["restored_" + label] = {{"spec": str(kernel.sharding.spec),
                                     "devices": len(kernel.sharding.device_set)}}
        np.savez(os.path.join(TMP, f"restored_{{label}}.npz"), **flat(restored))
    print("RESULT " + json.dumps(out))
""")


def _label(mesh):
    return "_".join(f"{k}{v}" for k, v in mesh.items())


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
    """The script above on 8 CPU devices -> (its JSON result, the folder of its arrays)."""
    tmp = tmp_path_factory.mktemp("tensor_parallel")
    script = SCRIPT.format(
        meshes=MESHES, vit_flags=VIT_FLAGS, prior_flags=PRIOR_FLAGS, tmp=str(tmp)
    )
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1]), tmp


@pytest.mark.parametrize("name", ["vit", "prior", "transformer"])
def test_model_sharded_steps_equal_one_device(eight_devices, name):
    _, tmp = eight_devices
    with np.load(tmp / f"{name}_one.npz") as one, np.load(tmp / f"{name}_init.npz") as init:
        reference = dict(one)
        # How far each key bias's sibling query bias, which has a true gradient, moved.
        query_moved = {}
        for k in one.files:
            if k.endswith("attn/key/bias"):
                query = k.replace("key/bias", "query/bias")
                query_moved[k] = np.abs(one[query] - init[query]).max()
        # Three steps moved the parameters: equal layouts are no idle comparison.
        assert max(float(np.abs(one[k] - init[k]).max()) for k in one.files) > 1e-2
    for mesh in MESHES:
        with np.load(tmp / f"{name}_{_label(mesh)}.npz") as got:
            assert sorted(got.files) == sorted(reference)
            for key, expected in reference.items():
                if key.endswith("attn/key/bias"):
                    # Its true gradient is zero (softmax ignores a shift shared by every key):
                    # it moves by float32 rounding alone, which differs between layouts and
                    # processors: about float32's epsilon (1.2e-7) of its query bias's move.
                    moved = query_moved[key]
                    assert np.abs(got[key]).max() < 1e-5 * moved, (key, moved)
                    continue
                assert_relative(got[key], expected, 1e-5, what=f"{name} {mesh} {key}")


@pytest.mark.parametrize("name", ["vit", "prior", "transformer"])
def test_the_layout_is_megatrons_in_the_compiled_step(eight_devices, name):
    result, _ = eight_devices
    first, second = f"{WIDTH},{MLP[name]}", f"{MLP[name]},{WIDTH}"
    whole = {"attn": f"{WIDTH},{WIDTH}", "mlp/fc1": first, "linear1": first}
    whole.update({"mlp/fc2": second, "linear2": second})
    for mesh in MESHES:
        record = result[f"{name}_{_label(mesh)}"]
        # Each device holds its heads' columns of q (and its fsdp rows of them) ...
        rows = WIDTH // mesh.get("fsdp", 1)
        assert record["query_shard"] == [rows, WIDTH // mesh["model"]], (mesh, record)
        # ... and no all-gather rebuilds a whole q/k/v, attention-output or MLP kernel for the
        # product it feeds: fsdp gathers a kernel's rows of this device's model shard at most.
        for shape, layer in record["all_gathers"]:
            kernel = "attn" if layer.startswith("attn") else layer
            assert not layer or shape != whole[kernel], (mesh, shape, layer)
        if "fsdp" not in mesh:
            # Without fsdp no weight moves at all: the only gathers are of the prior's largest
            # logit per vocabulary shard (its accuracy), rank 3.
            assert all(shape.count(",") == 2 for shape, _ in record["all_gathers"]), record
    # Megatron's all-reduce of each block's output, [batch / data, tokens, width].
    assert f"2,{TOKENS[name]},{WIDTH}" in result[f"{name}_data4_model2"]["all_reduces"]


def test_a_checkpoint_moves_between_layouts(eight_devices):
    result, tmp = eight_devices
    assert result["restored_model1"] == {"spec": str(P()), "devices": 1}
    assert result["restored_fsdp4"] == {"spec": str(P(None, "fsdp")), "devices": 4}
    with np.load(tmp / "saved.npz") as saved:
        for label in ("model1", "fsdp4"):
            with np.load(tmp / f"restored_{label}.npz") as restored:
                assert sorted(restored.files) == sorted(saved.files)
                for key in saved.files:
                    np.testing.assert_array_equal(restored[key], saved[key], err_msg=key)


def test_rules_give_megatrons_layout_and_fsdp_without_a_model_axis():
    mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "model"))
    rules = prior.SHARDING_RULES
    expected = {
        "params/blocks_0/attn/query/kernel": ((24, 24), P("fsdp", "model")),
        "params/blocks_0/attn/value/bias": ((24,), P("model")),
        "params/blocks_0/attn/out/kernel": ((24, 24), P("model", "fsdp")),
        "params/blocks_0/attn/out/bias": ((24,), P("fsdp")),
        "params/blocks_0/mlp/fc1/kernel": ((24, 96), P("fsdp", "model")),
        "opt_state/0/trace/blocks_0/mlp/fc2/kernel": ((96, 24), P("model", "fsdp")),
        "params/tok_emb/embedding": ((32, 24), P("model", "fsdp")),
        "params/head/kernel": ((24, 32), P("fsdp", "model")),
        "params/pos_emb": ((1, 4, 24), P(None, None, "fsdp")),
        "params/ln_f/scale": ((24,), P("fsdp")),
    }
    for name, (shape, spec) in expected.items():
        assert sharding.leaf_spec(name, shape, mesh, rules) == spec, name
    # A scanned ViT's stacked kernels keep their leading [depth] axis whole.
    name = "params/blocks/mlp/fc1/kernel"
    assert sharding.leaf_spec(name, (3, 24, 64), mesh, classification.SHARDING_RULES) == P(
        None, "fsdp", "model"
    )
    # Without a model axis: FSDP's layout, the largest dimension the axis divides.
    fsdp_only = AbstractMesh((2, 4, 1), ("data", "fsdp", "model"))
    assert sharding.leaf_spec("params/blocks_0/mlp/fc1/kernel", (24, 96), fsdp_only, rules) == P(
        None, "fsdp"
    )
    assert sharding.leaf_spec("params/blocks_0/attn/key/bias", (24,), fsdp_only, rules) == P("fsdp")


def _tiny_config(task, mesh, **model):
    """The tiny ViT or prior of the 8-device runs on ``mesh``, ``model`` fields overridden."""
    if task is classification:
        config = load_config("vit_digits")
        config.model.update({"width": 24, "depth": 1, "num_heads": 4, "mlp_dim": 64, **model})
    else:
        config = load_config("prior_digits")
        config.vqgan_codes.update(n_embed=model.pop("n_embed", 21), grid=(2, 2))
        config.model.update({"n_layer": 1, "n_embd": 24, **model})
    config.mesh = mesh
    return config


@pytest.mark.parametrize(
    "task, mesh, model, message",
    [
        (classification, {"model": 8}, {}, "mesh.model=8 does not divide the model's num_heads=4"),
        (classification, {"model": 4}, {"mlp_dim": 66}, "model's mlp_dim=66"),
        (prior, {"model": 4}, {"n_head": 6}, "model's n_head=6"),
        (
            prior,
            {"model": 2},
            {"n_embed": 22},
            "mesh.model=2 does not divide the model's vocab_size=33",
        ),
    ],
)
def test_a_model_axis_that_does_not_divide_is_one_line_before_training(task, mesh, model, message):
    config = _tiny_config(task, mesh, **model)
    with pytest.raises(ValueError, match=message) as error:
        task.create_train_state(jax.random.PRNGKey(0), config, task.create_model(config), None)
    assert "\n" not in str(error.value)


def test_a_rule_whose_model_axis_does_not_divide_names_the_leaf():
    mesh = AbstractMesh((2, 4), ("data", "model"))
    with pytest.raises(ValueError, match=r"mesh.model=4 does not divide the mlp axis \(30\) of "):
        sharding.leaf_spec("params/blocks_0/mlp/fc1/kernel", (24, 30), mesh, prior.SHARDING_RULES)
