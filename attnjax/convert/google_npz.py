"""Google ViT ``.npz`` checkpoints <-> ``attnjax.models.vit.ViT``; numpy only, no torch.

The published files of google-research/vision_transformer and big_vision store "/"-joined Flax
paths (optionally under ``params/``, or ``opt/target/`` next to the optimizer's ``opt/state/``).
"""

from __future__ import annotations

import pathlib

import numpy as np

from attnjax.convert.common import finish_vit, square_grid

# The two layouts:
#   vision_transformer (github.com/google-research/vision_transformer: the published ImageNet files)
#     embedding/kernel [ph, pw, C, width], embedding/bias [width]
#     cls [1, 1, width]
#     Transformer/posembed_input/pos_embedding [1, 1 + gh * gw, width]   (covers the class token)
#     Transformer/encoderblock_N/LayerNorm_0/{scale, bias}                (norm1)
#     Transformer/encoderblock_N/MultiHeadDotProductAttention_1/{query, key, value}/kernel
#         [width, heads, head_dim] and .../bias [heads, head_dim];
#         .../out/kernel [heads, head_dim, width], .../out/bias [width]
#     Transformer/encoderblock_N/LayerNorm_2/{scale, bias}                (norm2)
#     Transformer/encoderblock_N/MlpBlock_3/Dense_{0, 1}/{kernel, bias}   (fc1, fc2)
#     Transformer/encoder_norm/{scale, bias}
#     pre_logits/{kernel, bias}                                           (optional, + tanh)
#     head/{kernel, bias}                                                 (optional)
#   big_vision (github.com/google-research/big_vision, models/vit.py)
#     as above, but pos_embedding [1, gh * gw, width] at the top level (patch tokens only: a
#     class token "cls", if any, is concatenated after it), block sub-modules LayerNorm_0,
#     MultiHeadDotProductAttention_0, LayerNorm_1, MlpBlock_0, and either encoderblock_N or one
#     scanned Transformer/encoderblock with a leading [depth] axis on every leaf.
# LayerNorm eps is Flax's 1e-6. Without "cls" the model pools by averaging ("gap").
_NPZ_LAYOUTS = {
    "vision_transformer": dict(
        norm1="LayerNorm_0",
        attn="MultiHeadDotProductAttention_1",
        norm2="LayerNorm_2",
        mlp="MlpBlock_3",
    ),
    "big_vision": dict(
        norm1="LayerNorm_0",
        attn="MultiHeadDotProductAttention_0",
        norm2="LayerNorm_1",
        mlp="MlpBlock_0",
    ),
}


def _map_leaves(fn, tree: dict) -> dict:
    return {k: _map_leaves(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def _npz_block_to_flax(get, names: dict) -> dict:
    """One encoder block's arrays (``get(relative key)``) -> attnjax block params. Reshapes keep
    leading axes, so a scanned block with a ``[depth]`` axis converts in one go."""
    attn_prefix = names["attn"]
    attn = {}
    for name in ("query", "key", "value"):
        kernel = get(f"{attn_prefix}/{name}/kernel")  # [width, heads, head_dim]
        bias = get(f"{attn_prefix}/{name}/bias")  # [heads, head_dim]
        attn[name] = {
            "kernel": kernel.reshape(*kernel.shape[:-2], -1),
            "bias": bias.reshape(*bias.shape[:-2], -1),
        }
    out = get(f"{attn_prefix}/out/kernel")  # [heads, head_dim, width]
    attn["out"] = {
        "kernel": out.reshape(*out.shape[:-3], -1, out.shape[-1]),
        "bias": get(f"{attn_prefix}/out/bias"),
    }
    block = {"attn": attn, "mlp": {}}
    for ours in ("norm1", "norm2"):
        block[ours] = {"scale": get(f"{names[ours]}/scale"), "bias": get(f"{names[ours]}/bias")}
    for i, ours in enumerate(("fc1", "fc2")):
        dense = f"{names['mlp']}/Dense_{i}"
        block["mlp"][ours] = {"kernel": get(f"{dense}/kernel"), "bias": get(f"{dense}/bias")}
    return block


def load_google_npz(path, **overrides):
    """A Google ViT ``.npz`` checkpoint (layouts above) -> ``(ViT, variables)``.

    Sizes, heads and pooling are read from the arrays; the grid is assumed square. ``overrides``
    are ``ViT`` fields: an ``image_size`` other than the checkpoint's resamples the position table
    (fine-tuning at a new resolution), a ``num_classes`` other than the checkpoint's head starts a
    new zero head, and ``scan_layers``/``remat``/``dtype``/dropouts apply as usual.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_google_npz: no checkpoint file at {str(path)!r}")
    with np.load(path, allow_pickle=False) as archive:
        stored = set(archive.files)
        prefix = next(
            (p for p in ("", "params/", "opt/target/") if f"{p}embedding/kernel" in stored), None
        )
        if prefix is None:
            raise ValueError(
                f"load_google_npz: {str(path)!r} has no 'embedding/kernel'; "
                "not a Google ViT checkpoint"
            )
        # Arrays outside the prefix are the rest of a training state (the optimizer's "opt/state/").
        arrays = {key: archive[key] for key in stored if key.startswith(prefix)}
    read: set = set()

    def has(key):
        return prefix + key in arrays

    def get(key):
        if not has(key):
            raise ValueError(f"load_google_npz: {str(path)!r} has no array {prefix + key!r}")
        read.add(prefix + key)
        return arrays[prefix + key]

    scanned = has("Transformer/encoderblock/LayerNorm_0/scale")
    big_vision = scanned or has("pos_embedding")
    names = _NPZ_LAYOUTS["big_vision" if big_vision else "vision_transformer"]
    kernel = get("embedding/kernel")
    ph, pw, channels, width = kernel.shape
    class_token = has("cls")
    posemb_key = "pos_embedding" if big_vision else "Transformer/posembed_input/pos_embedding"
    params = {
        "patch_embed": {"kernel": kernel.reshape(-1, width), "bias": get("embedding/bias")},
        "norm": {
            "scale": get("Transformer/encoder_norm/scale"),
            "bias": get("Transformer/encoder_norm/bias"),
        },
        "pos_embed": {"pos_embedding": get(posemb_key)},
    }
    if class_token:
        params["cls_token"] = get("cls")
    if scanned:
        stacked = _npz_block_to_flax(lambda key: get(f"Transformer/encoderblock/{key}"), names)
        depth = len(stacked["norm1"]["scale"])
        for layer in range(depth):
            params[f"blocks_{layer}"] = _map_leaves(lambda leaf: leaf[layer], stacked)
        first_block = "Transformer/encoderblock/"
    else:
        block_prefix = f"{prefix}Transformer/encoderblock_"
        depth = len(
            {k[len(block_prefix) :].split("/")[0] for k in arrays if k.startswith(block_prefix)}
        )
        for layer in range(depth):
            block = f"Transformer/encoderblock_{layer}"
            params[f"blocks_{layer}"] = _npz_block_to_flax(lambda key: get(f"{block}/{key}"), names)
        first_block = "Transformer/encoderblock_0/"
    if depth == 0:
        raise ValueError(f"load_google_npz: {str(path)!r} has no Transformer/encoderblock arrays")
    config = dict(
        patch_size=(ph, pw),
        width=width,
        depth=depth,
        num_heads=arrays[f"{prefix}{first_block}{names['attn']}/query/bias"].shape[-2],
        mlp_dim=params["blocks_0"]["mlp"]["fc1"]["kernel"].shape[1],
        in_channels=channels,
        num_classes=0,
        pool="cls" if class_token else "gap",
        class_token=class_token,
        no_embed_class=big_vision and class_token,
        fc_norm=False,
        layer_norm_eps=1e-6,
    )
    if has("pre_logits/kernel"):
        params["pre_logits"] = {"kernel": get("pre_logits/kernel"), "bias": get("pre_logits/bias")}
        config["representation_size"] = params["pre_logits"]["kernel"].shape[1]
    if has("head/kernel"):
        head = {"kernel": get("head/kernel"), "bias": get("head/bias")}
        features, config["num_classes"] = head["kernel"].shape
        new_classes = overrides.get("num_classes", config["num_classes"])
        if new_classes == config["num_classes"]:
            params["head"] = head
        elif new_classes:
            params["head"] = {
                "kernel": np.zeros((features, new_classes), np.float32),
                "bias": np.zeros((new_classes,), np.float32),
            }
    unread = sorted(set(arrays) - read)
    if unread:
        raise ValueError(f"load_google_npz: arrays not converted (unsupported parts): {unread[:8]}")
    prefix_tokens = int(class_token and not big_vision)
    grid = square_grid(
        params["pos_embed"]["pos_embedding"].shape[1], prefix_tokens, "load_google_npz"
    )
    return finish_vit(config, overrides, params, grid, "load_google_npz")


def save_google_npz(path, model, variables, layout: str = "vision_transformer") -> pathlib.Path:
    """Write an attnjax ``ViT``'s parameters as a Google ``.npz`` in ``layout`` (see above).

    "vision_transformer" needs the position table to cover the class token (or no class token);
    "big_vision" needs it to cover only the patches (``no_embed_class=True``) and is written
    scanned (one ``Transformer/encoderblock`` with a leading ``[depth]`` axis) when the model uses
    ``scan_layers``. Either needs learned position embeddings and no ``fc_norm``.
    """
    from attnjax.models.patches import pair
    from attnjax.models.vit import unstack_block_params

    if layout not in _NPZ_LAYOUTS:
        raise ValueError(
            f"save_google_npz: layout must be one of {sorted(_NPZ_LAYOUTS)}, got {layout!r}"
        )
    big_vision = layout == "big_vision"
    fc_norm = model.pool == "gap" if model.fc_norm is None else model.fc_norm
    if model.posemb != "learn" or fc_norm or model.pool != ("cls" if model.class_token else "gap"):
        raise ValueError(
            "save_google_npz: needs posemb='learn', no fc_norm and pool 'cls' with a class token "
            f"or 'gap' without; got posemb={model.posemb!r}, fc_norm={fc_norm}, "
            f"pool={model.pool!r}, class_token={model.class_token}"
        )
    if model.class_token and model.no_embed_class != big_vision:
        raise ValueError(
            f"save_google_npz: layout {layout!r} needs no_embed_class={big_vision} with a class "
            f"token, got no_embed_class={model.no_embed_class}"
        )
    names, heads = _NPZ_LAYOUTS[layout], model.num_heads
    params = _map_leaves(np.asarray, dict(variables["params"]))
    ph, pw = pair(model.patch_size, "patch_size", "save_google_npz")
    posemb_key = "pos_embedding" if big_vision else "Transformer/posembed_input/pos_embedding"
    out = {
        "embedding/kernel": params["patch_embed"]["kernel"].reshape(ph, pw, model.in_channels, -1),
        "embedding/bias": params["patch_embed"]["bias"],
        posemb_key: params["pos_embed"]["pos_embedding"],
        "Transformer/encoder_norm/scale": params["norm"]["scale"],
        "Transformer/encoder_norm/bias": params["norm"]["bias"],
    }
    if model.class_token:
        out["cls"] = params["cls_token"]
    for name in ("pre_logits", "head"):
        if name in params:
            out[f"{name}/kernel"], out[f"{name}/bias"] = (
                params[name]["kernel"],
                params[name]["bias"],
            )

    def block_arrays(block: dict, base: str) -> dict:
        attn = f"{base}/{names['attn']}"
        arrays = {}
        for ours in ("norm1", "norm2"):
            arrays[f"{base}/{names[ours]}/scale"] = block[ours]["scale"]
            arrays[f"{base}/{names[ours]}/bias"] = block[ours]["bias"]
        for name in ("query", "key", "value"):
            kernel, bias = block["attn"][name]["kernel"], block["attn"][name]["bias"]
            arrays[f"{attn}/{name}/kernel"] = kernel.reshape(*kernel.shape[:-1], heads, -1)
            arrays[f"{attn}/{name}/bias"] = bias.reshape(*bias.shape[:-1], heads, -1)
        kernel = block["attn"]["out"]["kernel"]
        arrays[f"{attn}/out/kernel"] = kernel.reshape(
            *kernel.shape[:-2], heads, -1, kernel.shape[-1]
        )
        arrays[f"{attn}/out/bias"] = block["attn"]["out"]["bias"]
        for i, ours in enumerate(("fc1", "fc2")):
            arrays[f"{base}/{names['mlp']}/Dense_{i}/kernel"] = block["mlp"][ours]["kernel"]
            arrays[f"{base}/{names['mlp']}/Dense_{i}/bias"] = block["mlp"][ours]["bias"]
        return arrays

    if big_vision and model.scan_layers:
        out.update(block_arrays(params["blocks"], "Transformer/encoderblock"))
    else:
        per_layer = unstack_block_params(params) if model.scan_layers else params
        for layer in range(model.depth):
            out.update(
                block_arrays(per_layer[f"blocks_{layer}"], f"Transformer/encoderblock_{layer}")
            )
    path = pathlib.Path(path)
    np.savez(path, **out)
    return path
