"""attnjax ``ViT`` -> timm ``VisionTransformer``: the inverse of ``torch_interop.vit_from_timm``.

The per-block part inverts the importer's own table (``_TIMM_VIT_BLOCK_TABLE``): each layer
converter there has its inverse in ``_TO_TORCH``, so one table names every mapping. The rest:

    ========================  ================================  ==============================
    attnjax                   timm                              rule
    ========================  ================================  ==============================
    patch_embed (Dense)       patch_embed.proj (Conv2d)         [ph*pw*C, D] -> [D, C, ph, pw]
    cls_token, pos_embed      cls_token, pos_embed              as is
    blocks_N/attn/q, k, v     blocks.N.attn.qkv                 packed q|k|v, transposed
    norm / fc_norm, head      norm / fc_norm, head              LayerNorm, Linear
    ========================  ================================  ==============================
"""
from __future__ import annotations

import math

import numpy as np

from attnjax import torch_interop


def dense_to_linear(params: dict) -> dict:
    """``nn.Dense`` params -> ``nn.Linear`` tensors: weight [out, in], optional bias."""
    tensors = {"weight": np.asarray(params["kernel"], np.float32).T}
    if "bias" in params:
        tensors["bias"] = np.asarray(params["bias"], np.float32)
    return tensors


def norm_to_torch(params: dict) -> dict:
    """``nn.LayerNorm`` / ``nn.GroupNorm`` params -> torch ``weight``[, ``bias``]."""
    tensors = {"weight": np.asarray(params["scale"], np.float32)}
    if "bias" in params:
        tensors["bias"] = np.asarray(params["bias"], np.float32)
    return tensors


# the importer's layer converters -> their inverses
_TO_TORCH = {torch_interop.linear: dense_to_linear, torch_interop.layer_norm: norm_to_torch}


def _subtree(tree: dict, path: tuple) -> dict:
    for part in path:
        tree = tree[part]
    return tree


def _pair(value) -> tuple[int, int]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)


def _check_exportable(model) -> None:
    unsupported = {
        "posemb": (model.posemb != "learn", "timm's learned pos_embed needs posemb='learn'"),
        "representation_size": (model.representation_size is not None, "timm has no pre_logits layer"),
    }
    for field, (bad, why) in unsupported.items():
        if bad:
            raise ValueError(f"vit_to_timm: {field}={getattr(model, field)!r} unsupported: {why}")


def _image_size(model, params: dict) -> tuple[int, int]:
    """The model's image size, or the square grid its learned position table covers."""
    patch = _pair(model.patch_size)
    if model.image_size is not None:
        return _pair(model.image_size)
    tokens = params["pos_embed"]["pos_embedding"].shape[1]
    grid = tokens - int(model.class_token and not model.no_embed_class)
    side = math.isqrt(grid)
    if side * side != grid:
        raise ValueError(
            f"vit_to_timm: image_size is None and the position table's {grid} patch positions are "
            "not a square grid; set image_size on the model"
        )
    return side * patch[0], side * patch[1]


def vit_state_dict(model, variables) -> dict[str, np.ndarray]:
    """attnjax ``ViT`` variables -> a timm ``VisionTransformer`` state dict (numpy float32)."""
    from attnjax.vit import unstack_block_params

    _check_exportable(model)
    params = variables["params"]
    if model.scan_layers:
        params = unstack_block_params(params)
    kernel = np.asarray(params["patch_embed"]["kernel"], np.float32)
    ph, pw = _pair(model.patch_size)
    state = {
        "patch_embed.proj.weight": kernel.reshape(ph, pw, model.in_channels, -1).transpose(3, 2, 0, 1),
        "patch_embed.proj.bias": np.asarray(params["patch_embed"]["bias"], np.float32),
        "pos_embed": np.asarray(params["pos_embed"]["pos_embedding"], np.float32),
    }
    if model.class_token:
        state["cls_token"] = np.asarray(params["cls_token"], np.float32)
    for layer in range(model.depth):
        block = params[f"blocks_{layer}"]
        qkv = [dense_to_linear(block["attn"][name]) for name in ("query", "key", "value")]
        state[f"blocks.{layer}.attn.qkv.weight"] = np.concatenate([t["weight"] for t in qkv])
        state[f"blocks.{layer}.attn.qkv.bias"] = np.concatenate([t["bias"] for t in qkv])
        for torch_name, path, convert in torch_interop._TIMM_VIT_BLOCK_TABLE:
            for leaf, tensor in _TO_TORCH[convert](_subtree(block, path)).items():
                state[f"blocks.{layer}.{torch_name}.{leaf}"] = tensor
    for name in ("norm", "fc_norm"):
        if name in params:
            state.update({f"{name}.{k}": v for k, v in norm_to_torch(params[name]).items()})
    if "head" in params:
        state.update({f"head.{k}": v for k, v in dense_to_linear(params["head"]).items()})
    return {key: np.ascontiguousarray(value) for key, value in state.items()}


def vit_to_timm(model, variables):
    """attnjax ``ViT`` + variables -> a timm ``VisionTransformer`` in eval mode with the weights loaded.

    ``timm_model(images_nchw)`` equals ``model.apply(variables, images_nhwc)``. The position table
    fixes timm's ``img_size`` when the model's ``image_size`` is None (square grid).
    """
    import functools

    import torch

    torch_interop.ensure_torchvision_importable()
    from timm.models.vision_transformer import VisionTransformer

    state = vit_state_dict(model, variables)
    mlp_dim = state["blocks.0.mlp.fc1.weight"].shape[0]
    timm_model = VisionTransformer(
        img_size=_image_size(model, variables["params"]),
        patch_size=_pair(model.patch_size),
        in_chans=model.in_channels,
        num_classes=model.num_classes,
        global_pool={"cls": "token", "gap": "avg"}[model.pool],
        embed_dim=model.width,
        depth=model.depth,
        num_heads=model.num_heads,
        mlp_ratio=mlp_dim / model.width,
        class_token=model.class_token,
        no_embed_class=model.no_embed_class,
        fc_norm=model.pool == "gap" if model.fc_norm is None else model.fc_norm,
        pos_drop_rate=model.dropout_rate,
        proj_drop_rate=model.dropout_rate,
        attn_drop_rate=model.attention_dropout_rate,
        drop_path_rate=model.drop_path_rate,
        norm_layer=functools.partial(torch.nn.LayerNorm, eps=model.layer_norm_eps),
    )
    timm_model.load_state_dict({key: torch.from_numpy(np.array(value)) for key, value in state.items()}, strict=True)
    return timm_model.eval()
