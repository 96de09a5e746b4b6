"""attnjax.models.vit against a plain PyTorch VisionTransformer (the layout of the "cifar" variant).

The reference below is our own PyTorch code, with this architecture and these parameter names:
patches flattened (C, row, col), Linear patch embedding, class token, learned position table,
pre-LN blocks with torch.nn.MultiheadAttention and a Linear-GELU-Linear MLP, final LayerNorm, head
on the class token. ``layer_depths`` is checked against timm's layer-decay parameter groups.
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, flat, random_timm_vit
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from attnjax.convert.timm import vit_from_torch_reference
from attnjax.models import vit, vit_blocks
from attnjax.models.patches import patchify, unpatchify


class TorchBlock(nn.Module):
    def __init__(self, hidden_size, mlp_size, n_heads, p_dropout):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size)
        self.attention = nn.MultiheadAttention(
            hidden_size, n_heads, dropout=p_dropout, batch_first=True
        )
        self.norm2 = nn.LayerNorm(hidden_size)
        self.ffn = nn.Module()
        self.ffn.linear1 = nn.Linear(hidden_size, mlp_size)
        self.ffn.linear2 = nn.Linear(mlp_size, hidden_size)

    def forward(self, x):
        y = self.norm1(x)
        y, weights = self.attention(y, y, y, need_weights=True, average_attn_weights=False)
        x = x + y
        x = x + self.ffn.linear2(F.gelu(self.ffn.linear1(self.norm2(x))))
        return x, weights


class TorchViT(nn.Module):
    def __init__(
        self,
        in_channels=3,
        patch_size=4,
        image_size=32,
        layers=6,
        hidden_size=256,
        mlp_size=512,
        n_heads=8,
        num_classes=10,
        p_dropout=0.2,
    ):
        super().__init__()
        self.patch_size = patch_size
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Linear(in_channels * patch_size**2, hidden_size)
        self.cls_token = nn.Parameter(torch.randn(1, 1, hidden_size))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, hidden_size))
        self.transformer_blocks = nn.Sequential(
            *[TorchBlock(hidden_size, mlp_size, n_heads, p_dropout) for _ in range(layers)]
        )
        self.norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, images_nchw):
        """Returns (logits, per-layer attention weights, pre-logits)."""
        b, c, h, w = images_nchw.shape
        p = self.patch_size
        x = (
            images_nchw.reshape(b, c, h // p, p, w // p, p)
            .permute(0, 2, 4, 1, 3, 5)
            .reshape(b, -1, c * p * p)
        )
        x = (
            torch.cat([self.cls_token.expand(b, -1, -1), self.patch_embed(x)], dim=1)
            + self.pos_embed
        )
        weights = []
        for block in self.transformer_blocks:
            x, w_ = block(x)
            weights.append(w_)
        pre_logits = self.norm(x)[:, 0]
        return self.head(pre_logits), weights, pre_logits


SMALL = dict(
    in_channels=3,
    patch_size=4,
    image_size=16,
    layers=2,
    hidden_size=32,
    mlp_size=48,
    n_heads=4,
    num_classes=5,
)


def _perturbed(model, seed=0):
    """Random values for every parameter (LayerNorms and biases too), so no path is trivial."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def _randomized(variables, scale=0.3):
    """Flax-initialised variables plus noise (zero-initialised heads and biases become random)."""
    rng = np.random.default_rng(42)
    return jax.tree.map(lambda p: p + scale * rng.standard_normal(p.shape, np.float32), variables)


def _images(batch, size, channels=3, seed=0):
    height, width = (size, size) if isinstance(size, int) else size
    return (
        np.random.default_rng(seed)
        .standard_normal((batch, height, width, channels))
        .astype(np.float32)
    )


def _torch_nchw(images_nhwc):
    return torch.from_numpy(images_nhwc).permute(0, 3, 1, 2).contiguous()


@pytest.fixture(scope="module")
def torch_pair():
    torch.manual_seed(0)
    reference = _perturbed(TorchViT(**SMALL))
    model, variables = vit_from_torch_reference(reference)
    return reference, model, variables


def test_logits_weights_and_pre_logits_match_the_pytorch_model(torch_pair):
    reference, model, variables = torch_pair
    images = _images(3, 16)
    with torch.no_grad():
        logits_t, weights_t, pre_logits_t = reference(_torch_nchw(images))
    logits, aux = jax.jit(model.apply, static_argnames="return_aux")(
        variables, images, return_aux=True
    )
    assert_close(logits, logits_t.numpy(), rtol=1e-5, atol=1e-6, what="logits")
    assert_close(aux["pre_logits"], pre_logits_t.numpy(), what="pre_logits")
    assert len(aux["attention_weights"]) == SMALL["layers"]
    for layer, (ours, theirs) in enumerate(zip(aux["attention_weights"], weights_t)):
        assert_close(ours, theirs.numpy(), what=f"attention weights of layer {layer}")


def test_cross_entropy_gradients_match_pytorch(torch_pair):
    reference, model, variables = torch_pair
    images = _images(4, 16, seed=1)
    labels = np.array([0, 3, 1, 4])
    reference.zero_grad()
    logits_t = reference(_torch_nchw(images))[0]
    F.cross_entropy(logits_t, torch.from_numpy(labels)).backward()
    grads_state = {name: param.grad for name, param in reference.named_parameters()}
    # The conversion is linear (transposes, reshapes, splits), so it maps gradients like weights.
    _, expected = vit_from_torch_reference(grads_state, num_heads=SMALL["n_heads"])

    def loss_fn(params):
        logits = model.apply({"params": params}, images)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    grads = jax.jit(jax.grad(loss_fn))(variables["params"])
    flat_expected = dict(jax.tree_util.tree_leaves_with_path(expected["params"]))
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert (
        len(leaves) == len(flat_expected) == len(list(reference.parameters())) + 4 * SMALL["layers"]
    )  # in_proj -> q/k/v
    # Some gradients are zero in exact arithmetic (the key bias cannot change a softmax) and pure
    # rounding noise in both frameworks: the absolute floor is relative to the largest gradient.
    floor = 1e-6 * max(np.abs(np.asarray(g)).max() for g in flat_expected.values())
    for path, grad in leaves:
        want = np.asarray(flat_expected[path])
        assert_close(grad, want, rtol=1e-4, atol=floor, what=jax.tree_util.keystr(path))


def test_cifar_variant_is_the_pytorch_reference_model():
    torch.manual_seed(1)
    reference = _perturbed(TorchViT())  # its defaults: the "cifar" variant
    model, variables = vit_from_torch_reference(reference)
    cifar = vit.create_vit("cifar")
    for field in (
        "patch_size",
        "width",
        "depth",
        "num_heads",
        "num_classes",
        "layer_norm_eps",
        "in_channels",
    ):
        assert getattr(model, field) == getattr(cifar, field), field
    assert (model.mlp_dim, cifar.dropout_rate, cifar.image_size) == (512, 0.2, 32)
    images = _images(2, 32, seed=2)
    with torch.no_grad():
        expected = reference(_torch_nchw(images))[0].numpy()
    # Six 256-wide float32 layers: the error is measured against the logits' scale (a logit that
    # happens to sit near 0 carries the same absolute rounding error as the others).
    logits = jax.jit(cifar.apply)(variables, images)
    assert_close(
        logits, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(), what="cifar logits"
    )


def test_scan_layers_and_remat_give_identical_logits_and_gradients(torch_pair):
    _, model, variables = torch_pair
    images = _images(2, 16, seed=3)
    fields = {
        f: getattr(model, f)
        for f in (
            "patch_size",
            "width",
            "depth",
            "num_heads",
            "mlp_dim",
            "num_classes",
            "layer_norm_eps",
            "image_size",
        )
    }
    scanned = vit.ViT(**fields, scan_layers=True)
    scanned_params = vit.stack_block_params(variables["params"])
    assert "blocks" in scanned_params and "blocks_0" not in scanned_params
    shapes = jax.eval_shape(scanned.init, jax.random.key(0), images)["params"]
    chex.assert_trees_all_equal_shapes(shapes, scanned_params)
    round_trip = vit.unstack_block_params(scanned_params)
    chex.assert_trees_all_equal(round_trip, variables["params"])

    def forward(module):
        return jax.jit(lambda p: module.apply({"params": p}, images, return_aux=True))

    logits, aux = forward(model)(variables["params"])
    logits_scan, aux_scan = forward(scanned)(scanned_params)
    assert_close(logits_scan, logits, what="scan_layers=True logits")
    for ours, theirs in zip(aux_scan["attention_weights"], aux["attention_weights"], strict=True):
        assert_close(ours, theirs, what="scan attention weights")
    assert_close(
        forward(model.clone(remat=True))(variables["params"])[0], logits, what="remat logits"
    )

    def grads(module, params):
        return jax.jit(jax.grad(lambda p: jnp.sum(module.apply({"params": p}, images) ** 2)))(
            params
        )

    plain = vit.stack_block_params(grads(model, variables["params"]))
    scanned_grads = grads(scanned.clone(remat=True), scanned_params)
    # Scanning reorders float32 sums, so an entry near zero may move by a rounding step of its
    # leaf's scale (2.4e-7 of 0.0046 on one CPU): the floor grows with each leaf's largest entry.
    # The key bias has no gradient (softmax ignores a shift shared by a row), hence the 1e-7.
    for path, ours in jax.tree_util.tree_leaves_with_path(scanned_grads):
        theirs = np.asarray(functools.reduce(lambda tree, key: tree[key.key], path, plain))
        floor = 1e-7 + 1e-5 * np.abs(theirs).max()
        assert_close(ours, theirs, atol=floor, what=f"gradient {jax.tree_util.keystr(path)}")


def test_bfloat16_compute_stays_close_to_float32(torch_pair):
    _, model, variables = torch_pair
    images = _images(4, 16, seed=4)
    logits = np.asarray(jax.jit(model.apply)(variables, images))
    logits_bf16 = jax.jit(model.clone(dtype=jnp.bfloat16).apply)(variables, images)
    assert logits_bf16.dtype == jnp.float32  # logits are cast back for the loss
    assert jax.tree.all(jax.tree.map(lambda p: p.dtype == jnp.float32, variables))
    error = np.abs(np.asarray(logits_bf16) - logits).max()
    assert 0.0 < error <= 1e-2 * max(1.0, np.abs(logits).max()), error


@pytest.mark.parametrize(
    "variant, published_millions",
    [("Ti/16", 5.7), ("S/16", 22.1), ("B/16", 86.6), ("L/16", 304.3)],
)
def test_parameter_counts_at_224_match_published(variant, published_millions):
    model = vit.create_vit(variant, num_classes=1000)
    shapes = jax.eval_shape(
        model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)
    )
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))
    assert round(count / 1e6, 1) == published_millions, count


def test_variant_table():
    assert vit.variant_config("S/16") == dict(
        width=384, depth=12, mlp_dim=1536, num_heads=6, patch_size=16
    )
    assert (
        vit.variant_config("B/32")["patch_size"] == 32
        and vit.variant_config("Ti/8")["width"] == 192
    )
    model = vit.create_vit("L/16", num_classes=10, dtype=jnp.bfloat16)
    assert (model.depth, model.num_heads, model.num_classes, model.dtype) == (
        24,
        16,
        10,
        jnp.bfloat16,
    )


@pytest.mark.parametrize("variant", ["X/16", "S16", "S/", "s/16", "", "B/0"])
def test_unknown_variant_raises(variant):
    with pytest.raises(ValueError, match=re.escape(repr(variant)) + ".*expected"):
        vit.create_vit(variant)


def test_unknown_field_raises():
    with pytest.raises(ValueError, match="hidden_size"):
        vit.create_vit("S/16", hidden_size=3)


def test_bad_images_raise(torch_pair):
    _, model, variables = torch_pair
    with pytest.raises(ValueError, match=r"image size 18x16 .*not divisible by patch_size 4x4"):
        model.clone(image_size=None).apply(variables, _images(1, (18, 16)))
    with pytest.raises(ValueError, match=r"1 channels .*expected in_channels=3"):
        model.apply(variables, _images(1, 16, channels=1))
    with pytest.raises(ValueError, match=r"images are 24x24 .*expected image_size"):
        model.apply(variables, _images(1, 24))
    with pytest.raises(ValueError, match=r"\[batch, H, W, C\], got shape \(16, 16, 3\)"):
        model.apply(variables, _images(1, 16)[0])
    with pytest.raises(ValueError, match="pool must be 'cls' or 'gap', got 'max'"):
        model.clone(pool="max").apply(variables, _images(1, 16))


def test_patchify_matches_the_torch_patch_order_up_to_pixel_order():
    images = _images(2, (8, 12), channels=3, seed=5)
    patches = np.asarray(patchify(images, 4))  # [2, 2 * 3, 4 * 4 * 3], pixels (row, col, C)
    nchw = images.transpose(0, 3, 1, 2)
    torch_order = (
        nchw.reshape(2, 3, 2, 4, 3, 4).transpose(0, 2, 4, 1, 3, 5).reshape(2, 6, 48)
    )  # (C, row, col)
    reordered = patches.reshape(2, 6, 4, 4, 3).transpose(0, 1, 4, 2, 3).reshape(2, 6, 48)
    np.testing.assert_array_equal(reordered, torch_order)
    np.testing.assert_array_equal(patches[1, 4], images[1, 4:8, 4:8].reshape(-1))  # patch (1, 1)
    np.testing.assert_array_equal(unpatchify(patches, (2, 3), 4, 3), images)


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 2),
    grid=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    patch=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    channels=st.integers(1, 3),
)
def test_patchify_property(batch, grid, patch, channels):
    shape = (batch, grid[0] * patch[0], grid[1] * patch[1], channels)
    images = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    patches = np.asarray(patchify(images, patch))
    assert patches.shape == (batch, grid[0] * grid[1], patch[0] * patch[1] * channels)
    row, col = grid[0] - 1, grid[1] - 1  # the last patch: row-major token order
    window = images[:, row * patch[0] :, col * patch[1] :]
    np.testing.assert_array_equal(patches[:, -1], window.reshape(batch, -1))
    np.testing.assert_array_equal(unpatchify(patches, grid, patch, channels), images)


@pytest.mark.parametrize(
    "pool, posemb, class_token", [("gap", "sincos2d", False), ("cls", "learn", True)]
)
def test_options_non_square_and_gap(pool, posemb, class_token):
    model = vit.ViT(
        num_classes=3,
        patch_size=(4, 2),
        width=16,
        depth=2,
        num_heads=2,
        mlp_ratio=2.0,
        pool=pool,
        posemb=posemb,
        class_token=class_token,
    )
    images = _images(2, (8, 12), seed=6)  # grid 2 x 6
    variables = _randomized(jax.jit(model.init)(jax.random.key(0), images))
    logits, aux = jax.jit(lambda v: model.apply(v, images, return_aux=True))(variables)
    tokens = 12 + int(class_token)
    assert aux["attention_weights"][0].shape == (2, 2, tokens, tokens)
    assert ("fc_norm" in variables["params"]) == (pool == "gap")
    assert ("pos_embed" in variables["params"]) == (posemb == "learn")
    # The head reads pre_logits; the pooled features come from the final tokens independently.
    params = variables["params"]
    expected = aux["pre_logits"] @ params["head"]["kernel"] + params["head"]["bias"]
    assert_close(logits, expected, what="head(pre_logits)")
    heat = vit.attention_rollout(
        aux["attention_weights"], (2, 6), num_prefix_tokens=int(class_token)
    )
    assert heat.shape == (2, 2, 6) and bool(jnp.all(heat >= 0))


def test_dropout_and_stochastic_depth():
    block = vit_blocks.EncoderBlock(
        num_heads=2, mlp_dim=8, stochastic_depth=True, deterministic=False
    )
    x = jax.random.normal(jax.random.key(0), (4000, 3, 4))
    params = jax.jit(block.init)(jax.random.key(1), x)
    full = jax.jit(vit_blocks.EncoderBlock(num_heads=2, mlp_dim=8).apply)(params, x)[0]
    dropped = jax.jit(
        lambda rate: block.apply(params, x, rate, rngs={"dropout": jax.random.key(2)})[0]
    )
    half = dropped(0.5)
    # Each sample keeps both residual branches (scaled by 2), one of them, or neither.
    untouched = np.all(np.isclose(half, x, atol=1e-6), axis=(1, 2))
    assert abs(untouched.mean() - 0.25) < 0.03, untouched.mean()
    assert_close(dropped(0.0), full, atol=1e-4, what="drop_path_rate=0")

    model = vit.create_vit("cifar", depth=2, width=32, mlp_dim=32, num_heads=2, drop_path_rate=0.1)
    images = _images(2, 32, seed=7)
    variables = _randomized(jax.jit(model.init)(jax.random.key(0), images))
    train = jax.jit(lambda v, rng: model.apply(v, images, train=True, rngs={"dropout": rng}))
    evaluate = jax.jit(lambda v: model.apply(v, images))
    train_a = train(variables, jax.random.key(3))
    assert np.array_equal(train_a, train(variables, jax.random.key(3)))
    assert not np.allclose(train_a, train(variables, jax.random.key(4)))
    assert not np.allclose(train_a, evaluate(variables))


def _numpy_rollout(weights, num_prefix, residual=0.5):
    tokens = weights[0].shape[-1]
    result = np.eye(tokens)[None]
    for layer in weights:
        a = (1 - residual) * layer.mean(axis=1) + residual * np.eye(tokens)
        a = a / a.sum(-1, keepdims=True)
        result = np.einsum("bij,bjk->bik", a, result)
    return result[:, 0, num_prefix:] if num_prefix else result.mean(axis=1)


def test_attention_rollout_matches_a_numpy_rollout(torch_pair):
    _, model, variables = torch_pair
    images = _images(3, 16, seed=8)
    _, aux = jax.jit(lambda v: model.apply(v, images, return_aux=True))(variables)
    weights = [np.asarray(w, np.float64) for w in aux["attention_weights"]]
    heat = vit.attention_rollout(aux["attention_weights"], (4, 4))
    assert_close(heat, _numpy_rollout(weights, 1).reshape(3, 4, 4), what="rollout")
    stacked = vit.attention_rollout(jnp.stack(aux["attention_weights"]), (4, 4))
    assert_close(stacked, heat, what="stacked rollout")
    # One uniform layer: A = 0.5 / T + 0.5 I, so the class row gives 0.5 / T to every patch.
    uniform = jnp.full((1, 2, 5, 5), 0.2)
    assert_close(vit.attention_rollout([uniform], (2, 2)), np.full((1, 2, 2), 0.1), what="uniform")
    with pytest.raises(ValueError, match="17 tokens do not match num_prefix_tokens=1 \\+ grid 3x3"):
        vit.attention_rollout(aux["attention_weights"], (3, 3))


@pytest.mark.parametrize("global_pool", ["token", "avg"])  # final norm / fc_norm after the mean
def test_layer_depths_are_timms_layer_decay_groups(global_pool):
    # timm scales a group's rate by decay ** (deepest - depth); decay 0.5 keeps the powers exact.
    from timm.optim import param_groups_layer_decay

    from attnjax.convert.timm import vit_from_timm

    reference = random_timm_vit(global_pool=global_pool, depth=3)
    _, variables = vit_from_timm(reference)
    names = {id(p): name for name, p in reference.named_parameters()}
    theirs = {}
    for group in param_groups_layer_decay(reference, layer_decay=0.5):
        for p in group["params"]:
            module = re.sub(r"^blocks\.(\d+)", r"blocks_\1", names[id(p)]).split(".")[0]
            theirs.setdefault(module, set()).add(group["lr_scale"])
    depths = flat(vit.layer_depths(variables["params"]))
    deepest = max(int(d) for d in depths.values())
    ours = {}
    for key, depth in depths.items():
        ours.setdefault(key.split("/")[0], set()).add(0.5 ** (deepest - int(depth)))
    assert ours == theirs

    scanned = flat(vit.layer_depths(vit.stack_block_params(variables["params"])))
    for key, depth in scanned.items():
        name = key.removeprefix("blocks/")
        if name == key:
            assert depth == depths[key], key
        else:  # [depth, 1, ...]: one depth per stacked block, broadcast over the block's leaf
            ndim = np.ndim(flat(variables["params"])[f"blocks_0/{name}"])
            assert depth.shape == (3,) + (1,) * ndim, key
            assert depth.ravel().tolist() == [depths[f"blocks_{k}/{name}"] for k in range(3)], key
