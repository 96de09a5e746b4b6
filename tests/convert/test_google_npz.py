"""attnjax.convert.google_npz: Google ViT .npz checkpoints written and read back, checked with
timm's own .npz reader; the module needs no torch."""

import os
import pathlib
import subprocess
import sys

import chex
import numpy as np
import pytest
from helpers import assert_close, jax_logits, random_images, random_timm_vit, timm_logits
from timm.models import vision_transformer as timm_vit

from attnjax.convert.google_npz import load_google_npz, save_google_npz
from attnjax.convert.timm import vit_from_timm


def _write_and_check_timm_reads_it(path, model, variables, timm_kwargs, images):
    """timm's own Google .npz reader is an independent check of the layout we write."""
    reader = random_timm_vit(seed=7, **timm_kwargs)
    timm_vit._load_weights(reader, str(path))
    assert_close(
        timm_logits(reader.eval(), images),
        jax_logits(model, variables, images),
        what=f"timm reads {path.name}",
    )


@pytest.mark.parametrize(
    "layout, timm_kwargs, scan",
    [("vision_transformer", {}, False), ("big_vision", dict(no_embed_class=True), True)],
)
def test_google_npz_round_trip(tmp_path, layout, timm_kwargs, scan):
    reference = random_timm_vit(**timm_kwargs)
    model, variables = vit_from_timm(reference, scan_layers=scan)
    path = save_google_npz(tmp_path / f"{layout}.npz", model, variables, layout=layout)
    with np.load(path) as archive:
        keys = set(archive.files)
    if layout == "vision_transformer":
        assert "Transformer/encoderblock_1/MultiHeadDotProductAttention_1/query/kernel" in keys
        assert "Transformer/posembed_input/pos_embedding" in keys
    else:
        assert (
            "Transformer/encoderblock/MlpBlock_0/Dense_0/kernel" in keys and "pos_embedding" in keys
        )
    loaded, loaded_variables = load_google_npz(path)
    assert (loaded.num_heads, loaded.depth, loaded.no_embed_class) == (3, 2, layout == "big_vision")
    images = random_images(2, 16, seed=4)
    expected = timm_logits(reference, images)
    assert_close(
        jax_logits(loaded, loaded_variables, images), expected, what=f"{layout} npz logits"
    )
    _write_and_check_timm_reads_it(path, loaded, loaded_variables, timm_kwargs, images)


def test_google_npz_with_params_prefix(tmp_path):
    model, variables = vit_from_timm(random_timm_vit(depth=3))
    path = save_google_npz(tmp_path / "vit.npz", model, variables)
    with np.load(path) as archive:
        np.savez(tmp_path / "prefixed.npz", **{f"params/{k}": archive[k] for k in archive.files})
    loaded, loaded_variables = load_google_npz(tmp_path / "prefixed.npz")
    assert loaded.depth == 3
    images = random_images(2, 16, seed=5)
    assert_close(
        jax_logits(loaded, loaded_variables, images),
        jax_logits(model, variables, images),
        what="prefixed",
    )


def test_google_npz_fine_tuning_overrides(tmp_path):
    model, variables = vit_from_timm(random_timm_vit())
    path = save_google_npz(tmp_path / "vit.npz", model, variables)
    tuned, tuned_variables = load_google_npz(path, image_size=24, num_classes=7, scan_layers=True)
    params = tuned_variables["params"]
    assert params["pos_embed"]["pos_embedding"].shape == (1, 1 + 6 * 6, 24)
    assert_close(
        params["pos_embed"]["pos_embedding"][:, 0],
        variables["params"]["pos_embed"]["pos_embedding"][:, 0],
        what="class token position is kept",
    )
    assert params["head"]["kernel"].shape == (24, 7) and not np.any(params["head"]["kernel"])
    assert jax_logits(tuned, tuned_variables, random_images(1, 24)).shape == (1, 7)


def test_google_npz_bad_files(tmp_path):
    np.savez(tmp_path / "other.npz", weights=np.zeros(3))
    with pytest.raises(ValueError, match="no 'embedding/kernel'"):
        load_google_npz(tmp_path / "other.npz")
    model, variables = vit_from_timm(random_timm_vit(global_pool="avg"))
    with pytest.raises(ValueError, match="no fc_norm"):
        save_google_npz(tmp_path / "gap.npz", model, variables)


def test_google_npz_under_opt_target_next_to_optimizer_state(tmp_path):
    """A training checkpoint stores the weights under opt/target/ and the optimizer's moments
    under opt/state/: the moments are not weights and must not make the file unreadable."""
    model, variables = vit_from_timm(random_timm_vit())
    path = save_google_npz(tmp_path / "vit.npz", model, variables)
    with np.load(path) as archive:
        arrays = {f"opt/target/{k}": archive[k] for k in archive.files}
        arrays.update(
            {f"opt/state/param_states/{k}/v": np.ones_like(archive[k]) for k in archive.files}
        )
    np.savez(tmp_path / "training.npz", **arrays)
    loaded, loaded_variables = load_google_npz(tmp_path / "training.npz")
    reference, reference_variables = load_google_npz(path)
    assert (loaded.depth, loaded.num_heads) == (reference.depth, reference.num_heads)
    chex.assert_trees_all_close(loaded_variables, reference_variables, rtol=0, atol=0)
    # An unknown array among the weights is still refused.
    arrays["opt/target/Transformer/encoderblock_0/LayerScale_0/gamma"] = np.ones(24, np.float32)
    np.savez(tmp_path / "extra.npz", **arrays)
    with pytest.raises(ValueError, match="arrays not converted .*LayerScale_0/gamma"):
        load_google_npz(tmp_path / "extra.npz")


def test_google_npz_module_imports_no_torch(tmp_path):
    """Reading a converted checkpoint at training time must not need torch."""
    model, variables = vit_from_timm(random_timm_vit())
    path = save_google_npz(tmp_path / "vit.npz", model, variables)
    script = (
        "import sys\n"
        "from attnjax.convert.google_npz import load_google_npz\n"
        f"model, _ = load_google_npz({str(path)!r})\n"
        "torch_world = ('torch', 'torchvision', 'timm')\n"
        "print(model.depth, sorted(m for m in sys.modules if m.split('.')[0] in torch_world))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=pathlib.Path(__file__).resolve().parents[2],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.stdout.split() == ["2", "[]"], result.stdout + result.stderr
