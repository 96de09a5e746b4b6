"""attnjax.convert.timm: timm's VisionTransformer (module, state dict, files) and the reference
PyTorch ViT layout.

timm is imported for real (conftest makes torchvision importable next to the CPU torch); a failed
import fails these tests instead of skipping them.
"""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import timm
import torch
from helpers import (
    assert_close,
    jax_logits,
    random_images,
    random_timm_vit,
    timm_logits,
    write_pickle_that_runs_code,
)

from attnjax.convert.timm import vit_from_timm, vit_from_torch_reference
from attnjax.models import vit


def test_vit_tiny_patch16_224_matches_timm():
    torch.manual_seed(0)
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.02 * torch.randn_like(param))
    reference.eval()
    model, variables = vit_from_timm(reference)
    assert (model.width, model.depth, model.num_heads, model.mlp_dim, model.num_classes) == (
        192,
        12,
        3,
        768,
        1000,
    )
    assert model.layer_norm_eps == 1e-6 and model.pool == "cls"
    images = random_images(2, 224)
    expected = timm_logits(reference, images)
    assert_close(
        jax_logits(model, variables, images),
        expected,
        rtol=1e-5,
        atol=1e-5 * np.abs(expected).max(),
        what="vit_tiny_patch16_224 logits",
    )


@pytest.mark.parametrize(
    "kwargs, size",
    [
        (dict(), 16),
        (dict(global_pool="avg"), 16),  # fc_norm after the mean of the patch tokens
        (dict(global_pool="avg", class_token=False), 16),
        (dict(no_embed_class=True), 16),  # position table without the class token
        (dict(img_size=(16, 24), patch_size=(4, 2)), (16, 24)),  # non-square image and patch
    ],
    ids=["token", "avg", "avg-no-cls", "no-embed-class", "non-square"],
)
def test_logits_match_timm(kwargs, size):
    reference = random_timm_vit(**kwargs)
    model, variables = vit_from_timm(reference)
    assert model.pool == ("gap" if kwargs.get("global_pool") == "avg" else "cls")
    images = random_images(3, size, seed=1)
    assert_close(
        jax_logits(model, variables, images),
        timm_logits(reference, images),
        what=f"timm {kwargs} logits",
    )


def test_scan_layers_with_converted_weights_matches_timm():
    reference = random_timm_vit(depth=3)
    model, variables = vit_from_timm(reference, scan_layers=True)
    assert model.scan_layers and variables["params"]["blocks"]["norm1"]["scale"].shape == (3, 24)
    images = random_images(2, 16, seed=2)
    assert_close(
        jax_logits(model, variables, images), timm_logits(reference, images), what="scanned logits"
    )


@pytest.mark.parametrize("fmt", ["torch.save", "safetensors"])
def test_state_dict_files(tmp_path, fmt):
    reference = random_timm_vit(global_pool="avg")
    if fmt == "safetensors":
        path = tmp_path / "vit.safetensors"
        safetensors.torch.save_file(reference.state_dict(), str(path))
    else:
        path = tmp_path / "vit.pth"
        torch.save({"state_dict": reference.state_dict()}, path)
    with pytest.raises(ValueError, match="pass num_heads="):
        vit_from_timm(path)
    model, variables = vit_from_timm(path, num_heads=3)
    assert (model.pool, model.image_size) == ("gap", (16, 16))
    images = random_images(2, 16, seed=3)
    assert_close(
        jax_logits(model, variables, images), timm_logits(reference, images), what=f"{fmt} logits"
    )


def test_checkpoint_with_code_is_refused(tmp_path):
    path = write_pickle_that_runs_code(tmp_path / "bad.pth")
    with pytest.raises(pickle.UnpicklingError):
        vit_from_timm(path, num_heads=3)


def test_unsupported_timm_parts_raise():
    with pytest.raises(ValueError, match=r"ls1\.gamma"):
        vit_from_timm(random_timm_vit(init_values=1e-5))
    with pytest.raises(ValueError, match="global_pool='max'"):
        vit_from_timm(random_timm_vit(global_pool="max"))


def test_torch_reference_state_dict_needs_heads():
    state = {"patch_embed.weight": torch.zeros(8, 48)}
    with pytest.raises(ValueError, match="pass num_heads="):
        vit_from_torch_reference(state)


@pytest.mark.parametrize(
    "variant, timm_name", [("Ti/16", "vit_tiny_patch16_224"), ("L/16", "vit_large_patch16_224")]
)
def test_parameter_counts_equal_timm(variant, timm_name):
    with torch.device("meta"):  # shapes only: no memory for L/16's 304M parameters
        reference = timm.create_model(timm_name, pretrained=False)
    model = vit.create_vit(variant, num_classes=1000)
    shapes = jax.eval_shape(
        model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)
    )
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes))
    assert count == sum(p.numel() for p in reference.parameters())
