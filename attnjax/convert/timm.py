"""PyTorch Vision Transformers <-> ``attnjax.models.vit.ViT``: timm's ``VisionTransformer`` both
ways, and the reference PyTorch ViT layout (``torch.nn.MultiheadAttention`` blocks, Linear patch
embedding) that ``tests/models/test_vit.py`` defines and checks against.

The export (``vit_state_dict``, ``vit_to_timm``) reads ``TIMM_VIT_TABLE`` backwards, so one table
names every mapping in both directions:

    ========================  ================================  ==============================
    attnjax                   timm                              rule
    ========================  ================================  ==============================
    patch_embed (Dense)       patch_embed.proj (Conv2d)         [ph*pw*C, D] -> [D, C, ph, pw]
    cls_token, pos_embed      cls_token, pos_embed              as is
    blocks_N/attn/q, k, v     blocks.N.attn.qkv                 packed q|k|v, transposed
    other Dense, LayerNorm    their timm names                  Linear, LayerNorm
    ========================  ================================  ==============================

timm's ``ParallelScalingBlock`` (ViT-22B's parallel block) fuses projections that attnjax keeps
apart, so its rows split them (import only; the export refuses ``parallel_block``):

    ========================  ================================  ==============================
    attnjax                   timm ParallelScalingBlock         rule
    ========================  ================================  ==============================
    blocks_N/norm1            blocks.N.in_norm                  LayerNorm
    mlp/fc1, attn/q, k, v     blocks.N.in_proj (+ mlp_bias)     packed fc1|q|k|v, transposed
    attn/q_norm, k_norm       blocks.N.q_norm, k_norm           LayerNorm
    attn/out, mlp/fc2         attn_out_proj, mlp_out_proj       Linear
    attn/out, mlp/fc2         out_proj (fuse_out_proj=True)     columns attn|mlp; bias on out
    ========================  ================================  ==============================
"""

from __future__ import annotations

import functools
import math

import numpy as np

from attnjax.convert.common import (
    TO_TORCH,
    apply_key_table,
    dense_to_linear,
    export_with_key_table,
    finish_vit,
    layer_norm,
    linear,
    load_state_dict,
    parameter,
    square_grid,
    take,
)


def _split_rows(weight, bias, sizes: dict) -> dict:
    """A Linear's ``[sum(sizes), in]`` weight (and optional bias) cut into consecutive row
    blocks -> ``{name: Dense params}``, in ``sizes``' order."""
    out, start = {}, 0
    for name, size in sizes.items():
        part = slice(start, start + size)
        out[name] = {"kernel": weight[part].T}
        if bias is not None:
            out[name]["bias"] = bias[part]
        start += size
    return out


def packed_qkv(state, prefix: str, weight: str = "weight", bias: str = "bias") -> dict:
    """Packed ``[3 * width, width]`` q|k|v (timm ``qkv``, torch ``in_proj``) -> three Dense
    dicts (without biases where timm's ``qkv_bias=False``)."""
    packed = take(state, prefix, weight)
    width = packed.shape[1]
    if packed.shape != (3 * width, width):
        raise ValueError(
            f"{prefix}.{weight}: expected shape [3 * {width}, {width}], got {packed.shape}"
        )
    sizes = dict.fromkeys(("query", "key", "value"), width)
    return _split_rows(packed, take(state, prefix, bias, required=False), sizes)


def fused_in_projection(state, prefix: str) -> dict:
    """``ParallelScalingBlock.in_proj`` ``[mlp_dim + 3 * width, width]`` (fc1|q|k|v) and the
    block's ``mlp_bias`` (there when q/k/v have no bias) -> ``{"attn": q/k/v, "mlp": fc1}``."""
    packed = take(state, prefix, "weight")
    width = packed.shape[1]
    mlp_dim = packed.shape[0] - 3 * width
    if mlp_dim < 1:
        raise ValueError(
            f"{prefix}.weight: expected [mlp_dim + 3 * {width}, {width}], got {packed.shape}"
        )
    sizes = {"fc1": mlp_dim, **dict.fromkeys(("query", "key", "value"), width)}
    parts = _split_rows(packed, take(state, prefix, "bias", required=False), sizes)
    mlp_bias = take(state, prefix.rpartition(".")[0], "mlp_bias", required=False)
    if mlp_bias is not None:
        parts["fc1"]["bias"] = mlp_bias
    fc1 = parts.pop("fc1")
    return {"attn": parts, "mlp": {"fc1": fc1}}


def fused_out_projection(state, prefix: str) -> dict:
    """``ParallelScalingBlock.out_proj`` ``[width, width + mlp_dim]`` (``fuse_out_proj=True``) ->
    ``attn/out`` and ``mlp/fc2``. Their outputs are summed, so the one bias goes to ``out`` and
    ``fc2``'s is zero."""
    weight = take(state, prefix, "weight")
    width = weight.shape[0]
    out, fc2 = {"kernel": weight[:, :width].T}, {"kernel": weight[:, width:].T}
    bias = take(state, prefix, "bias", required=False)
    if bias is not None:
        out["bias"], fc2["bias"] = bias, np.zeros_like(bias)
    return {"attn": {"out": out}, "mlp": {"fc2": fc2}}


def conv_patch_embedding(state, prefix: str) -> dict:
    """Conv2d ``[width, C, ph, pw]`` -> ``patch_embed`` Dense on ``(row, col, C)``-flattened
    patches."""
    weight = take(state, prefix, "weight")
    width, channels, ph, pw = weight.shape
    return {
        "kernel": weight.transpose(2, 3, 1, 0).reshape(ph * pw * channels, width),
        "bias": take(state, prefix, "bias"),
    }


def linear_patch_embedding(state, prefix: str, in_channels: int) -> dict:
    """Linear ``[width, C * ph * pw]`` on ``(C, row, col)``-flattened patches -> ``patch_embed``."""
    weight = take(state, prefix, "weight")
    width, patch_dim = weight.shape
    patch = math.isqrt(patch_dim // in_channels)
    if patch * patch * in_channels != patch_dim:
        raise ValueError(
            f"vit_from_torch_reference: {prefix}.weight of shape {weight.shape} is not in_channels="
            f"{in_channels} times a square patch; pass in_channels"
        )
    image_weight = weight.reshape(width, in_channels, patch, patch)
    return {
        "kernel": image_weight.transpose(2, 3, 1, 0).reshape(patch_dim, width),
        "bias": take(state, prefix, "bias"),
    }


TIMM_VIT_TABLE = (
    (r"patch_embed\.proj", "patch_embed", conv_patch_embedding),
    (r"cls_token", "cls_token", parameter),
    (r"pos_embed", "pos_embed/pos_embedding", parameter),
    (r"blocks\.(\d+)\.norm1", r"blocks_\1/norm1", layer_norm),
    (r"blocks\.(\d+)\.attn\.qkv", r"blocks_\1/attn", packed_qkv),
    (r"blocks\.(\d+)\.attn\.proj", r"blocks_\1/attn/out", linear),
    (r"blocks\.(\d+)\.norm2", r"blocks_\1/norm2", layer_norm),
    (r"blocks\.(\d+)\.mlp\.fc1", r"blocks_\1/mlp/fc1", linear),
    (r"blocks\.(\d+)\.mlp\.fc2", r"blocks_\1/mlp/fc2", linear),
    (r"blocks\.(\d+)\.attn\.q_norm", r"blocks_\1/attn/q_norm", layer_norm),
    (r"blocks\.(\d+)\.attn\.k_norm", r"blocks_\1/attn/k_norm", layer_norm),
    (r"blocks\.(\d+)\.in_norm", r"blocks_\1/norm1", layer_norm),
    (r"blocks\.(\d+)\.in_proj", r"blocks_\1", fused_in_projection),
    (r"blocks\.(\d+)\.q_norm", r"blocks_\1/attn/q_norm", layer_norm),
    (r"blocks\.(\d+)\.k_norm", r"blocks_\1/attn/k_norm", layer_norm),
    (r"blocks\.(\d+)\.attn_out_proj", r"blocks_\1/attn/out", linear),
    (r"blocks\.(\d+)\.mlp_out_proj", r"blocks_\1/mlp/fc2", linear),
    (r"blocks\.(\d+)\.out_proj", r"blocks_\1", fused_out_projection),
    (r"norm", "norm", layer_norm),
    (r"fc_norm", "fc_norm", layer_norm),
    (r"head", "head", linear),
)


def _depth(params: dict, where: str) -> int:
    depth = sum(key.startswith("blocks_") for key in params)
    if depth == 0:
        raise ValueError(f"{where}: the state dict has no transformer blocks; is it a ViT?")
    return depth


def _timm_module_config(model) -> dict:
    """The ViT fields a timm ``VisionTransformer`` instance knows but its state dict does not."""
    pool = {"token": "cls", "avg": "gap"}.get(model.global_pool)
    if pool is None:
        raise ValueError(
            f"vit_from_timm: global_pool={model.global_pool!r} unsupported; "
            "expected 'token' or 'avg'"
        )
    block = model.blocks[0]
    parallel = not hasattr(block, "mlp")  # ParallelScalingBlock: mlp_act, heads on the block
    act = block.mlp_act if parallel else block.mlp.act
    if type(act).__name__ != "GELU" or getattr(act, "approximate", "none") != "none":
        raise ValueError(
            f"vit_from_timm: MLP activation {act} unsupported; expected exact nn.GELU()"
        )
    norm = model.norm if hasattr(model.norm, "eps") else model.fc_norm
    return dict(
        num_heads=(block if parallel else block.attn).num_heads,
        pool=pool,
        image_size=tuple(model.patch_embed.img_size),
        layer_norm_eps=float(norm.eps),
    )


def vit_from_timm(model_or_state_dict, *, num_heads: int | None = None, **overrides):
    """timm ``VisionTransformer`` (module, state dict or checkpoint file) -> ``(ViT, variables)``.

    ``flax_module.apply(variables, images_nhwc)`` equals timm's ``model(images_nchw)`` in eval
    mode. The keys map by ``TIMM_VIT_TABLE``: the packed ``blocks.N.attn.qkv`` splits into
    ``blocks_N/attn/{query, key, value}`` and the ``patch_embed.proj`` convolution becomes a Dense
    layer on flattened patches.

    From a module, heads, pooling, LayerNorm eps and image size are read from it. From a state dict
    (``torch.save`` or ``.safetensors`` file, loaded without unpickling code) the sizes come from
    the tensors, ``num_heads`` must be given, eps is timm's 1e-6, pooling is "gap" when ``fc_norm``
    weights exist, and the grid is square. ``overrides`` are further ``ViT`` fields
    (``scan_layers``, ``remat``, ``dtype``, dropouts, a new ``image_size``...). Blocks made by
    ``ParallelScalingBlock`` give ``parallel_block=True``; ``qk_norm``, ``qkv_bias`` and
    ``layer_norm_bias`` follow from the keys present. Parts attnjax's ViT does not have (register
    tokens, LayerScale, pre-norm, attention pooling) leave keys unread and raise ``ValueError``.
    """
    config: dict = {}
    if hasattr(model_or_state_dict, "patch_embed") and hasattr(model_or_state_dict, "blocks"):
        config.update(_timm_module_config(model_or_state_dict))
    if num_heads is not None:
        config["num_heads"] = num_heads
    if "num_heads" not in config:
        raise ValueError(
            "vit_from_timm: a state dict does not record the number of heads; pass num_heads="
        )
    state = load_state_dict(model_or_state_dict)
    width, channels, ph, pw = take(state, "patch_embed.proj", "weight").shape
    params = apply_key_table(state, TIMM_VIT_TABLE, "vit_from_timm")["params"]
    class_token, fc_norm = "cls_token" in params, "fc_norm" in params
    block = params.get("blocks_0", {})
    tokens = take(state, "", "pos_embed").shape[1]
    if "image_size" in config:
        grid = (config["image_size"][0] // ph, config["image_size"][1] // pw)
    elif math.isqrt(tokens) ** 2 == tokens:  # no position for the class token (or no class token)
        grid = square_grid(tokens, 0, "vit_from_timm")
    else:
        grid = square_grid(tokens, int(class_token), "vit_from_timm")
    config = {
        "pool": "gap" if fc_norm else "cls",
        "layer_norm_eps": 1e-6,
        **config,
        "patch_size": (ph, pw),
        "width": width,
        "depth": _depth(params, "vit_from_timm"),
        "mlp_dim": params["blocks_0"]["mlp"]["fc1"]["kernel"].shape[1],
        "in_channels": channels,
        "num_classes": params["head"]["kernel"].shape[1] if "head" in params else 0,
        "class_token": class_token,
        "no_embed_class": class_token and tokens == grid[0] * grid[1],
        "fc_norm": fc_norm,
        "parallel_block": "blocks.0.in_proj.weight" in state,
        "qk_norm": "q_norm" in block["attn"],
        "qkv_bias": "bias" in block["attn"]["query"],
        "layer_norm_bias": "bias" in block["norm1"],
    }
    return finish_vit(config, overrides, params, grid, "vit_from_timm")


def torch_reference_vit_table(in_channels: int):
    """Key table of the reference PyTorch ViT for images of ``in_channels`` channels."""
    return (
        (
            r"patch_embed",
            "patch_embed",
            functools.partial(linear_patch_embedding, in_channels=in_channels),
        ),
        (r"cls_token", "cls_token", parameter),
        (r"pos_embed", "pos_embed/pos_embedding", parameter),
        (r"transformer_blocks\.(\d+)\.norm1", r"blocks_\1/norm1", layer_norm),
        (r"transformer_blocks\.(\d+)\.attention\.out_proj", r"blocks_\1/attn/out", linear),
        (
            r"transformer_blocks\.(\d+)\.attention",
            r"blocks_\1/attn",
            functools.partial(packed_qkv, weight="in_proj_weight", bias="in_proj_bias"),
        ),
        (r"transformer_blocks\.(\d+)\.norm2", r"blocks_\1/norm2", layer_norm),
        (r"transformer_blocks\.(\d+)\.ffn\.linear1", r"blocks_\1/mlp/fc1", linear),
        (r"transformer_blocks\.(\d+)\.ffn\.linear2", r"blocks_\1/mlp/fc2", linear),
        (r"norm", "norm", layer_norm),
        (r"head", "head", linear),
    )


def vit_from_torch_reference(
    model_or_state_dict, *, num_heads: int | None = None, in_channels: int = 3, **overrides
):
    """The reference PyTorch ViT layout -> ``(ViT, variables)``.

    That layout, the plain PyTorch ViT ``tests/test_vit.py`` checks attnjax against:
    ``patch_embed`` (Linear on patches flattened ``(C, row, col)``, reordered here to attnjax's
    ``(row, col, C)``), ``cls_token``, ``pos_embed [1, 1 + N, width]``,
    ``transformer_blocks.N.{norm1, attention (nn.MultiheadAttention: packed in_proj_weight/bias,
    out_proj), norm2, ffn.linear1, ffn.linear2}``, ``norm``, ``head``; LayerNorm eps is torch's
    1e-5. From a module, ``num_heads`` and eps are read from it; from a state dict pass
    ``num_heads`` (and ``in_channels`` if not 3). Dropouts are 0 unless overridden: the converted
    model is for inference, or for fine-tuning with the caller's own settings.
    """
    where = "vit_from_torch_reference"
    config: dict = {"layer_norm_eps": 1e-5, "pool": "cls"}
    if hasattr(model_or_state_dict, "transformer_blocks"):
        config["num_heads"] = model_or_state_dict.transformer_blocks[0].attention.num_heads
        config["layer_norm_eps"] = float(model_or_state_dict.norm.eps)
    if num_heads is not None:
        config["num_heads"] = num_heads
    if "num_heads" not in config:
        raise ValueError(
            f"{where}: a state dict does not record the number of heads; pass num_heads="
        )
    state = load_state_dict(model_or_state_dict)
    table = torch_reference_vit_table(in_channels)
    params = apply_key_table(state, table, f"{where} (not the reference layout?)")["params"]
    width, patch_dim = take(state, "patch_embed", "weight").shape
    config.update(
        patch_size=math.isqrt(patch_dim // in_channels),
        width=width,
        depth=_depth(params, where),
        mlp_dim=params["blocks_0"]["mlp"]["fc1"]["kernel"].shape[1],
        in_channels=in_channels,
        num_classes=params["head"]["kernel"].shape[1],
    )
    grid = square_grid(params["pos_embed"]["pos_embedding"].shape[1], 1, where)
    return finish_vit(config, overrides, params, grid, where)


def qkv_to_packed(attn: dict) -> dict:
    """``query``/``key``/``value`` Dense params -> one packed Linear ``[3 * width, width]``
    (+ bias)."""
    parts = [dense_to_linear(attn[name]) for name in ("query", "key", "value")]
    return {leaf: np.concatenate([part[leaf] for part in parts]) for leaf in parts[0]}


def patch_embedding_to_conv(params: dict, patch_size: tuple, in_channels: int) -> dict:
    """``patch_embed`` Dense on ``(row, col, C)``-flattened patches -> Conv2d
    ``[width, C, ph, pw]``."""
    kernel = np.asarray(params["kernel"], np.float32)
    image_kernel = kernel.reshape(*patch_size, in_channels, kernel.shape[1])
    return {
        "weight": image_kernel.transpose(3, 2, 0, 1),
        "bias": np.asarray(params["bias"], np.float32),
    }


def _check_exportable(model) -> None:
    unsupported = {
        "posemb": (model.posemb != "learn", "timm's learned pos_embed needs posemb='learn'"),
        "representation_size": (
            model.representation_size is not None,
            "timm has no pre_logits layer",
        ),
        "parallel_block": (model.parallel_block, "the export writes timm's sequential Block"),
    }
    for field, (bad, why) in unsupported.items():
        if bad:
            raise ValueError(f"vit_to_timm: {field}={getattr(model, field)!r} unsupported: {why}")


def _image_size(model, params: dict) -> tuple[int, int]:
    """The model's image size, or the square grid its learned position table covers."""
    from attnjax.models.patches import pair

    patch = pair(model.patch_size, "patch_size", "vit_to_timm")
    if model.image_size is not None:
        return pair(model.image_size, "image_size", "vit_to_timm")
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
    from attnjax.models.patches import pair
    from attnjax.models.vit import unstack_block_params

    _check_exportable(model)
    params = variables["params"]
    if model.scan_layers:
        params = unstack_block_params(params)
    to_torch = {
        **TO_TORCH,
        packed_qkv: qkv_to_packed,
        conv_patch_embedding: functools.partial(
            patch_embedding_to_conv,
            patch_size=pair(model.patch_size, "patch_size", "vit_state_dict"),
            in_channels=model.in_channels,
        ),
    }
    return export_with_key_table(params, TIMM_VIT_TABLE, to_torch, "vit_state_dict")


def vit_to_timm(model, variables):
    """attnjax ``ViT`` + variables -> a timm ``VisionTransformer`` in eval mode, weights loaded.

    ``timm_model(images_nchw)`` equals ``model.apply(variables, images_nhwc)``. The position table
    fixes timm's ``img_size`` when the model's ``image_size`` is None (square grid). timm imports
    torchvision, which must be importable next to the installed torch.
    """
    import torch
    from timm.models.vision_transformer import VisionTransformer

    from attnjax.models.patches import pair

    state = vit_state_dict(model, variables)
    mlp_dim = state["blocks.0.mlp.fc1.weight"].shape[0]
    timm_model = VisionTransformer(
        img_size=_image_size(model, variables["params"]),
        patch_size=pair(model.patch_size, "patch_size", "vit_to_timm"),
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
        qkv_bias=model.qkv_bias,
        qk_norm=model.qk_norm,
        norm_layer=functools.partial(
            torch.nn.LayerNorm, eps=model.layer_norm_eps, bias=model.layer_norm_bias
        ),
    )
    timm_model.load_state_dict(
        {key: torch.from_numpy(np.array(value)) for key, value in state.items()}, strict=True
    )
    return timm_model.eval()
