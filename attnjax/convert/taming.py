"""taming-transformers <-> attnjax: ``VQModel`` (<-> ``vqgan.VQGAN``), ``NLayerDiscriminator``
(import only), and the transformer prior's minGPT (<-> ``prior.GPT``).

The exports read the import tables backwards (``VQMODEL_TABLE``, ``GPT_TABLE``) and write
``.safetensors`` files that load with ``load_state_dict(strict=True)`` into taming's ``VQModel``
(``encoder``, ``decoder``, ``quantize``, ``quant_conv``, ``post_quant_conv``; no ``loss.*``) and
``mingpt.GPT`` (plus each block's causal-mask buffer ``attn.mask`` minGPT keeps in its state
dict). They need no torch: tensors are numpy float32 and safetensors writes them.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

from attnjax.convert.common import (
    TO_TORCH,
    apply_key_table,
    batch_norm,
    check_against_init,
    conv2d,
    conv_to_conv2d,
    embedding,
    export_with_key_table,
    group_norm,
    layer_norm,
    linear,
    load_state_dict,
    norm_to_torch,
    parameter,
    take,
)
from attnjax.models import discriminator


def actnorm(state, prefix: str) -> dict:
    """taming ``ActNorm`` at ``prefix``: ``loc``, ``scale`` [1, C, 1, 1] -> ``loc``,
    ``scale`` [C]."""
    return {
        "loc": take(state, prefix, "loc").reshape(-1),
        "scale": take(state, prefix, "scale").reshape(-1),
    }


def taming_layer(state, prefix: str):
    """The layer the tensors at ``prefix`` describe: Conv2d (4-d weight), BatchNorm2d (running
    statistics), ActNorm (``loc``), GroupNorm (1-d weight)."""
    if f"{prefix}.running_mean" in state:
        return batch_norm(state, prefix)
    if f"{prefix}.loc" in state:
        return actnorm(state, prefix)
    if np.ndim(take(state, prefix, "weight")) == 4:
        return conv2d(state, prefix)
    return group_norm(state, prefix)


# taming's nested ModuleLists (``down.1.block.0``) become flat submodule names (``down_1_block_0``).
VQMODEL_TABLE = (
    (
        r"(encoder|decoder)\.(down|up)\.(\d+)\.(block|attn)\.(\d+)\.(\w+)",
        r"\1/\2_\3_\4_\5/\6",
        taming_layer,
    ),
    (
        r"(encoder|decoder)\.(down|up)\.(\d+)\.(downsample|upsample)\.conv",
        r"\1/\2_\3_\4/conv",
        conv2d,
    ),
    (r"(encoder|decoder)\.mid\.(block_1|attn_1|block_2)\.(\w+)", r"\1/mid_\2/\3", taming_layer),
    (r"(encoder|decoder)\.(conv_in|norm_out|conv_out)", r"\1/\2", taming_layer),
    (r"(quant_conv|post_quant_conv)", r"\1", conv2d),
    (r"quantize\.embedding", "quantize", embedding),
)
NLAYER_DISCRIMINATOR_TABLE = ((r"main\.(\d+)", r"main_\1", taming_layer),)
# Buffers with no Flax counterpart: BatchNorm's step counter and ActNorm's "initialized" flag.
_BOOKKEEPING = r"\.(num_batches_tracked|initialized)$"
# minGPT stores its causal mask as a buffer; prior.GPT builds the mask from the sequence length.
_CAUSAL_MASK = r"^blocks\.\d+\.attn\.mask$"

GPT_TABLE = (
    (r"tok_emb", "tok_emb", embedding),
    (r"pos_emb", "pos_emb", parameter),
    (r"blocks\.(\d+)\.ln1", r"blocks_\1/ln1", layer_norm),
    (r"blocks\.(\d+)\.attn\.(query|key|value)", r"blocks_\1/attn/\2", linear),
    (r"blocks\.(\d+)\.attn\.proj", r"blocks_\1/attn/out", linear),
    (r"blocks\.(\d+)\.ln2", r"blocks_\1/ln2", layer_norm),
    (r"blocks\.(\d+)\.mlp\.0", r"blocks_\1/mlp/fc1", linear),
    (r"blocks\.(\d+)\.mlp\.2", r"blocks_\1/mlp/fc2", linear),
    (r"ln_f", "ln_f", layer_norm),
    (r"head", "head", linear),
)


def _under(state: dict, prefix: str) -> dict:
    """The keys that start with ``prefix``, with it removed."""
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


def vqgan_from_taming(state_dict, ddconfig, n_embed: int, embed_dim: int, **vqgan_kwargs):
    """A taming ``VQModel`` state dict (or module, or checkpoint path) -> ``(VQGAN, variables)``.

    Reads ``encoder.*``, ``decoder.*``, ``quant_conv.*``, ``post_quant_conv.*`` and
    ``quantize.embedding.weight`` (``loss.*`` keys are ignored; see
    ``nlayer_discriminator_from_taming``). ``ddconfig`` is taming's (its ``double_z`` must be
    False, as in every VQModel config). The quantizer is taming 0.0.1's: ``legacy=True``, beta 0.25,
    unless ``vqgan_kwargs`` say otherwise.
    """
    import jax.numpy as jnp

    from attnjax.models import vqgan

    ddconfig = dict(ddconfig)
    if ddconfig.get("double_z", True):
        raise ValueError(
            "vqgan_from_taming: ddconfig['double_z'] must be False (taming's VQModel quant_conv "
            "reads z_channels channels), got "
            f"{ddconfig.get('double_z', 'unset (taming default True)')}"
        )
    state = load_state_dict(state_dict)
    state = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in state.items()}
    state = {k: v for k, v in state.items() if not k.startswith("loss.")}
    vqgan_kwargs.setdefault("quantizer", {"legacy": True})
    module = vqgan.create_vqgan(ddconfig, n_embed, embed_dim, **vqgan_kwargs)
    variables = apply_key_table(state, VQMODEL_TABLE, "vqgan_from_taming", skip=_BOOKKEEPING)
    example = jnp.zeros(
        (1, ddconfig["resolution"], ddconfig["resolution"], ddconfig["in_channels"])
    )
    check_against_init(module, variables, example, "vqgan_from_taming")
    return module, variables


def nlayer_discriminator_from_taming(state_dict, prefix: str = ""):
    """taming's ``NLayerDiscriminator`` (or the ``loss.discriminator.`` part of a VQModel state
    dict, with that ``prefix``) -> ``(NLayerDiscriminator, variables)``. Width, depth, norm
    (BatchNorm / ActNorm) and input channels are read off the tensors."""
    import jax.numpy as jnp

    if prefix and not prefix.endswith("."):
        prefix += "."
    state = _under(load_state_dict(state_dict), prefix)
    convs = [
        k
        for k, v in state.items()
        if k.startswith("main.") and k.endswith(".weight") and np.ndim(v) == 4
    ]
    if not convs:
        raise KeyError(
            f"nlayer_discriminator_from_taming: no '{prefix}main.N.weight' conv keys found"
        )
    first = state["main.0.weight"]
    if any(k.endswith(".running_mean") for k in state):
        norm = "batch"
    elif any(k.endswith(".loc") for k in state):
        norm = "actnorm"
    else:
        norm = "none"
    module = discriminator.NLayerDiscriminator(
        ndf=first.shape[0], n_layers=len(convs) - 2, norm=norm
    )
    variables = apply_key_table(
        state, NLAYER_DISCRIMINATOR_TABLE, "nlayer_discriminator_from_taming", skip=_BOOKKEEPING
    )
    example = jnp.zeros((1, 64, 64, first.shape[1]))
    check_against_init(module, variables, example, "nlayer_discriminator_from_taming")
    return module, variables


def gpt_from_taming(state_dict, n_head: int):
    """taming ``mingpt.GPT`` state dict -> ``(attnjax.models.gpt.GPT, {"params": ...})``.

    ``vocab_size``, ``block_size``, ``n_embd`` and ``n_layer`` are read from the tensors
    (``tok_emb.weight [vocab, n_embd]``, ``pos_emb [1, block_size, n_embd]``, ``blocks.N.*``);
    ``n_head`` is not stored in the weights, so it is an argument. Dropouts are 0 (inference).
    A ``Net2NetTransformer`` state dict works too: its ``transformer.`` prefix is stripped.
    """
    from attnjax.models.gpt import GPT

    state = load_state_dict(state_dict)
    if any(key.startswith("transformer.") for key in state):
        state = _under(state, "transformer.")
    for key in ("tok_emb.weight", "pos_emb", "ln_f.weight", "head.weight"):
        if key not in state:
            raise KeyError(f"gpt_from_taming: state dict has no key {key!r}; is it a taming GPT?")
    vocab, n_embd = state["tok_emb.weight"].shape
    if n_embd % n_head:
        raise ValueError(f"gpt_from_taming: n_head={n_head} does not divide n_embd={n_embd}")
    variables = apply_key_table(state, GPT_TABLE, "gpt_from_taming", skip=_CAUSAL_MASK)
    model = GPT(
        vocab_size=vocab,
        block_size=state["pos_emb"].shape[1],
        n_layer=sum(key.startswith("blocks_") for key in variables["params"]),
        n_head=n_head,
        n_embd=n_embd,
    )
    return model, variables


def taming_layer_to_torch(params: dict) -> dict:
    """The inverse of ``taming_layer`` for the layers a VQModel has: Conv2d and GroupNorm."""
    return conv_to_conv2d(params) if "kernel" in params else norm_to_torch(params)


VQMODEL_PARTS = ("encoder", "decoder", "quantize", "quant_conv", "post_quant_conv")


def vqgan_state_dict(variables) -> dict[str, np.ndarray]:
    """attnjax ``VQGAN`` variables -> taming ``VQModel`` state dict (numpy float32)."""
    params = variables["params"]
    missing = [part for part in VQMODEL_PARTS if part not in params]
    if missing:
        raise ValueError(f"vqgan_state_dict: params have no {missing}; are these VQGAN variables?")
    to_torch = {**TO_TORCH, taming_layer: taming_layer_to_torch}
    parts = {part: params[part] for part in VQMODEL_PARTS}
    return export_with_key_table(parts, VQMODEL_TABLE, to_torch, "vqgan_state_dict")


def gpt_state_dict(model, variables) -> dict[str, np.ndarray]:
    """attnjax ``prior.GPT`` variables -> taming ``mingpt.GPT`` state dict (numpy float32)."""
    state = export_with_key_table(variables["params"], GPT_TABLE, TO_TORCH, "gpt_state_dict")
    causal = np.tril(np.ones((model.block_size, model.block_size), np.float32))[None, None]
    for layer in range(model.n_layer):
        state[f"blocks.{layer}.attn.mask"] = causal
    return state


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
    return save_safetensors(
        {prefix + k: v for k, v in gpt_state_dict(model, variables).items()}, path
    )
