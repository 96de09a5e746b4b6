"""attnjax/convert/vit_checkpoint.py: timm and Google ViT files converted with their model config
read from the weights, the command's one-line refusals, and ``init_from`` given the timm file
itself. (The command run end to end: tests/inference/test_predict.py.)"""

import re

import jax
import numpy as np
import pytest
import torch
from helpers import flat, load_config, random_timm_vit
from safetensors.torch import save_file

from attnjax.convert import vit_checkpoint
from attnjax.convert.google_npz import save_google_npz
from attnjax.tasks import classification

# 64-dimensional heads, timm's convention, so that the default head count is right.
TIMM = dict(img_size=16, patch_size=4, embed_dim=128, depth=1, num_heads=2, num_classes=3)


def test_a_safetensors_file_converts_with_its_config_and_preprocessing(tmp_path, capsys):
    model = random_timm_vit(**TIMM, global_pool="avg")  # fc_norm, mean pooling
    save_file(model.state_dict(), str(tmp_path / "vit.safetensors"))
    out = str(tmp_path / "vit.npz")
    command = [str(tmp_path / "vit.safetensors"), out, "--mean", "0.4", "0.5", "0.6"]
    meta = vit_checkpoint.main(command)
    assert meta["model"] == {
        **dict(width=128, depth=1, num_heads=2, mlp_dim=256, patch_size=[4, 4]),
        **dict(image_size=[16, 16], in_channels=3, num_classes=3, pool="gap"),
        **dict(class_token=True, no_embed_class=False, fc_norm=True, layer_norm_eps=1e-6),
        "representation_size": None,
        **dict(parallel_block=False, qk_norm=False, qkv_bias=True, layer_norm_bias=True),
    }
    assert meta["data"] == {"image_size": 16, "mean": [0.4, 0.5, 0.6], "std": [0.5, 0.5, 0.5]}
    assert vit_checkpoint.read_metadata(out) == meta
    assert "fine-tune: python train.py --config configs/vit_finetune.py:" in capsys.readouterr().out
    with np.load(out) as archive:
        params = {k.removeprefix("params/"): archive[k] for k in archive.files if "/" in k}
    assert params["blocks_0/attn/query/kernel"].shape == (128, 128) and "fc_norm/scale" in params

    for argv, message in [
        (command, r"error: OUT '.*vit\.npz' exists; not overwriting it without --overwrite"),
        ([command[0], str(tmp_path / "v.npz"), "--num-heads", "3"], r"error: .* 3 heads; .*"),
        ([command[0], str(tmp_path / "v.npz"), "--std", "1"], r"error: --mean .* 3 values each.*"),
        ([str(tmp_path / "none.pth"), str(tmp_path / "v.npz")], r"error: '.*none\.pth': no such.*"),
    ]:
        with pytest.raises(SystemExit) as refused:
            vit_checkpoint.main(argv)
        assert re.fullmatch(message, refused.value.code), refused.value.code
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vit.npz", "vit.safetensors"]


def test_a_google_npz_converts_with_the_heads_it_records(tmp_path):
    from attnjax.convert.timm import vit_from_timm

    source, variables = vit_from_timm(random_timm_vit(**dict(TIMM, num_heads=4)))
    path = save_google_npz(tmp_path / "google.npz", source, variables)
    meta = vit_checkpoint.main([str(path), str(tmp_path / "vit.npz"), "--num-heads", "9"])
    assert meta["model"]["num_heads"] == 4 and meta["model"]["width"] == 128


def test_init_from_reads_a_timm_file_as_it_reads_the_converted_one(tmp_path):
    torch.save(random_timm_vit(**TIMM).state_dict(), tmp_path / "vit.pth")
    vit_checkpoint.main([str(tmp_path / "vit.pth"), str(tmp_path / "vit.npz")])
    config = load_config("vit_digits")
    config.model.update(
        num_classes=3, image_size=16, patch_size=4, width=128, depth=1, num_heads=2, mlp_dim=256
    )
    config.model.in_channels = 3
    config.init_head = True
    model = classification.create_model(config)
    fresh = model.init(jax.random.PRNGKey(0), np.zeros((1, 16, 16, 3), np.float32))["params"]
    loaded = {}
    for name in ("vit.pth", "vit.npz"):
        config.init_from = str(tmp_path / name)
        loaded[name] = flat(classification.load_pretrained(config, model, fresh))
    for key, value in loaded["vit.npz"].items():
        np.testing.assert_array_equal(loaded["vit.pth"][key], value, err_msg=key)
    assert not np.array_equal(loaded["vit.npz"]["head/kernel"], flat(fresh)["head/kernel"])
