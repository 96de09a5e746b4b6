"""ViT-22B's options of attnjax.models.vit (parallel block, q/k LayerNorm, no q/k/v or LayerNorm
biases) against timm's ``ParallelScalingBlock`` and ``Block``, and configs/vit_22b.py's size.

timm's parallel block fuses q/k/v with fc1 (and, with ``fuse_out_proj``, the attention output
with fc2); attnjax.convert.timm splits them, so these tests check the converter's rows too.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_relative, jax_logits, random_images, random_timm_vit, timm_logits
from timm.layers import LayerNorm
from timm.models.vision_transformer import Block, ParallelScalingBlock

import configs
from attnjax import tasks
from attnjax.convert.timm import vit_from_timm, vit_to_timm
from attnjax.models import vit
from attnjax.train import loop

# ViT-22B's block options on timm's side: LayerNorms without bias (torch's ``bias=False``).
OPTIONS = dict(qk_norm=True, qkv_bias=False, norm_layer=functools.partial(LayerNorm, bias=False))


def test_parallel_block_logits_and_gradients_match_timm():
    reference = random_timm_vit(block_fn=ParallelScalingBlock, **OPTIONS)
    model, variables = vit_from_timm(reference)
    assert (model.parallel_block, model.qk_norm, model.qkv_bias, model.layer_norm_bias) == (
        True,
        True,
        False,
        False,
    )
    params = variables["params"]
    assert "norm2" not in params["blocks_0"] and "bias" not in params["blocks_0"]["norm1"]
    assert params["blocks_0"]["attn"]["q_norm"]["scale"].shape == (8,)  # head_dim, all heads
    images = random_images(3, 16, seed=5)
    labels = np.array([0, 3, 1])
    expected = timm_logits(reference, images)
    assert_relative(
        jax_logits(model, variables, images), expected, 1e-5, what="parallel-block logits"
    )

    reference.zero_grad()
    logits_t = reference(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous())
    torch.nn.functional.cross_entropy(logits_t, torch.from_numpy(labels)).backward()
    # The conversion only slices and transposes, so it maps timm's gradients like its weights.
    grads_t = {name: param.grad for name, param in reference.named_parameters()}
    _, expected_grads = vit_from_timm(grads_t, num_heads=3)

    def loss_fn(params):
        logits = model.apply({"params": params}, images)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    grads = jax.jit(jax.grad(loss_fn))(params)
    want = dict(jax.tree_util.tree_leaves_with_path(expected_grads["params"]))
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert len(leaves) == len(want)
    for path, grad in leaves:
        theirs = np.asarray(want[path])
        assert_relative(grad, theirs, 1e-5, what=f"gradient {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize(
    "block_fn",
    [functools.partial(ParallelScalingBlock, fuse_out_proj=True), Block],
    ids=["parallel-fused-out", "sequential"],
)
def test_fused_output_and_sequential_block_options_match_timm(block_fn):
    reference = random_timm_vit(block_fn=block_fn, global_pool="avg", seed=1, **OPTIONS)
    model, variables = vit_from_timm(reference)
    assert model.parallel_block == (block_fn is not Block) and not model.qkv_bias
    images = random_images(2, 16, seed=6)
    expected = timm_logits(reference, images)
    assert_relative(jax_logits(model, variables, images), expected, 1e-5, what=f"{block_fn} logits")
    if model.parallel_block:
        with pytest.raises(ValueError, match="parallel_block=True unsupported"):
            vit_to_timm(model, variables)
    else:  # the export builds timm's Block with the same options
        assert_relative(
            timm_logits(vit_to_timm(model, variables), images),
            expected,
            1e-6,
            what="exported logits",
        )


@pytest.fixture(scope="module")
def abstract_22b_params():
    """configs/vit_22b.py's parameters as shapes: the train state's ``jax.eval_shape``."""
    config = configs.load("vit_22b")
    task = tasks.get_task(config.task)
    model = task.create_model(config)
    batch = task.abstract_batch(config, 2)
    return loop.abstract_train_state(config, task, model, batch, jax.random.key(0)).params


def test_22b_parameter_count(abstract_22b_params):
    width, depth, heads, mlp, patch, classes = 6144, 48, 48, 24576, 14, 1000
    matrices = depth * (4 * width * width + 2 * width * mlp)  # q, k, v, out; fc1, fc2
    assert round(matrices / 1e9, 3) == 21.743  # the paper's count
    biases = depth * (width + mlp + width)  # out, fc1, fc2: none on q/k/v
    norms = depth * (width + 2 * (width // heads)) + width  # norm1, q_norm, k_norm; fc_norm
    embedding = patch * patch * 3 * width + width + (224 // patch) ** 2 * width
    head = width * classes + classes
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(abstract_22b_params))
    assert count == matrices + biases + norms + embedding + head == 21_756_691_432


def test_22b_parameters_have_logical_axes_of_their_rank(abstract_22b_params):
    names = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_22b_params):
        name = "/".join(key.key for key in path)
        rule = next((axes for regex, axes in vit.PARAM_AXES if re.search(regex, name)), None)
        assert rule is None or len(rule) <= leaf.ndim, name
        names[name] = rule
    assert names["blocks/attn/q_norm/scale"] == names["blocks/attn/k_norm/scale"] == (None,)
    assert names["blocks/attn/query/kernel"] == ("embed", "heads")
    assert names["blocks/mlp/fc1/kernel"] == ("embed", "mlp")
    assert names["blocks/norm1/scale"] is None
