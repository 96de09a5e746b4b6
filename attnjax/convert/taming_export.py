"""attnjax ``VQGAN`` and ``GPT`` -> taming-transformers state dicts, written as ``.safetensors``.

The inverses of ``torch_interop.vqgan_from_taming`` and ``gpt_from_taming``: the files load with
``load_state_dict(strict=True)`` into taming's ``VQModel`` (its ``encoder``, ``decoder``,
``quantize``, ``quant_conv``, ``post_quant_conv``; no ``loss.*``) and ``mingpt.GPT``. Needs no
torch: tensors are numpy float32 and safetensors writes them.

VQGAN: attnjax's flat names map back to taming's nested ModuleLists (``down_0_block_1`` ->
``down.0.block.1``, ``mid_attn_1`` -> ``mid.attn_1``) and each leaf by its kind:

    ==========================  =======================  ===================================
    attnjax leaf                taming tensor            rule
    ==========================  =======================  ===================================
    Conv kernel [kh,kw,in,out]  Conv2d weight            permute to [out, in, kh, kw]
    GroupNorm scale, bias       weight, bias             as is
    quantize/embedding          quantize.embedding.weight  the codebook [n_embed, embed_dim]
    ==========================  =======================  ===================================

GPT: the importer's ``_GPT_BLOCK_TABLE`` read backwards, plus ``tok_emb``, ``pos_emb``,
``ln_f``, ``head`` and each block's causal-mask buffer ``attn.mask`` that minGPT keeps in its
state dict.
"""
from __future__ import annotations

import os
import pathlib
import re

import numpy as np

from attnjax import torch_interop
from attnjax.convert.timm_export import _TO_TORCH, dense_to_linear, norm_to_torch

# attnjax's flat submodule names -> taming's nested ModuleLists (torch_interop._TAMING_RENAMES reversed)
_TAMING_NAMES = (
    (r"^(down|up)_(\d+)_(block|attn)_(\d+)$", r"\1.\2.\3.\4"),
    (r"^(down|up)_(\d+)_(downsample|upsample)$", r"\1.\2.\3"),
    (r"^mid_(block_1|attn_1|block_2)$", r"mid.\1"),
)
# (Flax leaf, rank) -> (taming leaf, layout rule)
_TAMING_LEAVES = {
    ("kernel", 4): ("weight", lambda w: w.transpose(3, 2, 0, 1)),
    ("scale", 1): ("weight", lambda w: w),
    ("bias", 1): ("bias", lambda w: w),
    ("embedding", 2): ("embedding.weight", lambda w: w),
}
VQMODEL_PARTS = ("encoder", "decoder", "quantize", "quant_conv", "post_quant_conv")


def taming_name(flax_path: tuple[str, ...]) -> str:
    """A Flax module path (``("encoder", "down_0_block_1", "conv1")``) -> taming's module name."""
    parts = []
    for part in flax_path:
        for pattern, replacement in _TAMING_NAMES:
            part = re.sub(pattern, replacement, part)
        parts.append(part)
    return ".".join(parts)


def vqgan_state_dict(variables) -> dict[str, np.ndarray]:
    """attnjax ``VQGAN`` variables -> taming ``VQModel`` state dict (numpy float32)."""
    import jax

    params = variables["params"]
    missing = [part for part in VQMODEL_PARTS if part not in params]
    if missing:
        raise ValueError(f"vqgan_state_dict: params have no {missing}; are these VQGAN variables?")
    state = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path({k: params[k] for k in VQMODEL_PARTS}):
        *modules, name = (key.key for key in path)
        array = np.asarray(leaf, np.float32)
        rule = _TAMING_LEAVES.get((name, array.ndim))
        if rule is None:
            raise ValueError(f"vqgan_state_dict: no taming tensor for {'/'.join([*modules, name])} {array.shape}")
        torch_leaf, layout = rule
        state[f"{taming_name(tuple(modules))}.{torch_leaf}"] = np.ascontiguousarray(layout(array))
    return state


def gpt_state_dict(model, variables) -> dict[str, np.ndarray]:
    """attnjax ``prior.GPT`` variables -> taming ``mingpt.GPT`` state dict (numpy float32)."""
    params = variables["params"]
    block_size = model.block_size
    causal = np.tril(np.ones((block_size, block_size), np.float32))[None, None]
    state = {
        "tok_emb.weight": np.asarray(params["tok_emb"]["embedding"], np.float32),
        "pos_emb": np.asarray(params["pos_emb"], np.float32),
        **{f"ln_f.{k}": v for k, v in norm_to_torch(params["ln_f"]).items()},
        **{f"head.{k}": v for k, v in dense_to_linear(params["head"]).items()},
    }
    for layer in range(model.n_layer):
        block = params[f"blocks_{layer}"]
        for torch_name, path, convert in torch_interop._GPT_BLOCK_TABLE:
            node = block
            for part in path:
                node = node[part]
            for leaf, tensor in _TO_TORCH[convert](node).items():
                state[f"blocks.{layer}.{torch_name}.{leaf}"] = tensor
        state[f"blocks.{layer}.attn.mask"] = causal
    return {key: np.ascontiguousarray(value) for key, value in state.items()}


def save_safetensors(state: dict[str, np.ndarray], path) -> pathlib.Path:
    """Write ``state`` to ``path`` (``.safetensors``) through a temporary file, so a failed write
    leaves any existing file untouched."""
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"save_safetensors: path {str(path)!r} must end in .safetensors")
    if not path.parent.is_dir():
        raise ValueError(f"save_safetensors: folder {str(path.parent)!r} does not exist")
    partial = path.with_name(f".{path.name}.partial")
    save_file(state, str(partial))
    os.replace(partial, path)
    return path


def save_vqgan(variables, path) -> pathlib.Path:
    """attnjax VQGAN variables -> a taming ``VQModel`` ``.safetensors`` file."""
    return save_safetensors(vqgan_state_dict(variables), path)


def save_gpt(model, variables, path, prefix: str = "") -> pathlib.Path:
    """attnjax GPT -> a taming ``mingpt.GPT`` ``.safetensors`` file; ``prefix="transformer."``
    gives the keys of a ``Net2NetTransformer``."""
    return save_safetensors({prefix + k: v for k, v in gpt_state_dict(model, variables).items()}, path)
