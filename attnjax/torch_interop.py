"""PyTorch -> Flax weight conversion. The only module of attnjax that imports torch, and lazily.

Every converter here reads a PyTorch module or state dict and returns ``(flax_module, variables)``.
Conversions are tables: a PyTorch key (pattern) maps to a Flax parameter path plus a layout rule.
The layout rules, shared by every model:

    =============  =========================  ==========================================
    PyTorch        PyTorch layout             Flax layout
    =============  =========================  ==========================================
    Linear.weight  [out, in]                  Dense.kernel [in, out]          (transpose)
    Conv2d.weight  [out, in, kh, kw]          Conv.kernel  [kh, kw, in, out]  (permute)
    LayerNorm      weight, bias               LayerNorm scale, bias
    GroupNorm      weight, bias               GroupNorm scale, bias
    BatchNorm2d    weight, bias, running_*    BatchNorm scale, bias; batch_stats mean, var
    Embedding      weight [num, dim]          Embed.embedding [num, dim]
    =============  =========================  ==========================================
"""
from __future__ import annotations

import importlib.util
import math
import pathlib
from typing import Any, Mapping

import numpy as np

StateDict = Mapping[str, Any]


def _torch():
    import torch  # lazily: torch is a test/dev extra, never a runtime dependency

    return torch


def ensure_torchvision_importable() -> None:
    """Make ``import torchvision`` work next to the CPU-only torch wheel.

    PyPI's torchvision is a CUDA build: its C extension links ``libtorch_cuda.so``, which the CPU
    torch does not ship, so loading it fails and ``import torchvision`` then dies with
    ``operator torchvision::nms does not exist`` (its Python side registers fake kernels for the
    ``nms``/``qnms`` operators that only the extension defines). When the extension does not load,
    this declares those two operator schemas without kernels: everything pure-Python in torchvision
    (models, transforms; what timm and lpips use) works, and calling the compiled detection ops
    raises PyTorch's own "no kernel" error. When the extension loads, nothing is changed.
    Safe to call more than once; a no-op when torchvision is not installed.
    """
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return
    torch = _torch()
    if torch._C._dispatch_has_kernel("torchvision::nms") or _torchvision_schemas_declared():
        return
    extension = next(pathlib.Path(spec.origin).parent.glob("_C*.so"), None)
    try:
        if extension is None:
            raise OSError("torchvision has no compiled extension")
        torch.ops.load_library(str(extension))
        return
    except OSError:
        pass
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in (
        "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    ):
        library.define(schema)
    _DECLARED_LIBRARIES.append(library)  # a Library object undoes its definitions when collected


_DECLARED_LIBRARIES: list = []


def _torchvision_schemas_declared() -> bool:
    return bool(_DECLARED_LIBRARIES)


# --------------------------------------------------------------------------------------------
# Loading weights safely
# --------------------------------------------------------------------------------------------


def to_numpy(value) -> np.ndarray:
    """A torch tensor (any device, with or without grad) or array-like -> float32/int numpy array."""
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if value.dtype.is_floating_point:
            value = value.float()
        value = value.numpy()
    return np.asarray(value)


def load_state_dict(source) -> dict[str, np.ndarray]:
    """A state dict as ``{key: numpy array}`` from a module, a mapping, or a file.

    Files are ``.safetensors`` (read with safetensors) or anything ``torch.save`` wrote, read with
    ``torch.load(weights_only=True)`` so that no arbitrary pickle is ever executed. A checkpoint
    that wraps its weights (``{"state_dict": ...}``, ``{"model": ...}``) is unwrapped.
    """
    if hasattr(source, "state_dict") and callable(source.state_dict):
        source = source.state_dict()
    elif isinstance(source, (str, pathlib.Path)):
        path = pathlib.Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"load_state_dict: no checkpoint file at {str(path)!r}")
        if path.suffix == ".safetensors":
            from safetensors.numpy import load_file

            return dict(load_file(str(path)))
        source = _torch().load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(source, Mapping):
        raise TypeError(
            f"load_state_dict: expected a torch module, a mapping or a checkpoint path, "
            f"got {type(source).__name__}"
        )
    for wrapper in ("state_dict", "model", "module"):
        if wrapper in source and isinstance(source[wrapper], Mapping):
            source = source[wrapper]
            break
    return {key: to_numpy(value) for key, value in source.items()}


# --------------------------------------------------------------------------------------------
# Layer converters: one PyTorch layer's tensors -> the matching Flax parameter dict
# --------------------------------------------------------------------------------------------


def _take(state: StateDict, prefix: str, name: str, required: bool = True):
    key = f"{prefix}.{name}" if prefix else name
    if key not in state:
        if required:
            raise KeyError(f"state dict has no key {key!r} (needed for {prefix or 'root'})")
        return None
    return to_numpy(state[key])


def linear(state: StateDict, prefix: str) -> dict:
    """``nn.Linear`` at ``prefix`` -> ``nn.Dense`` params: kernel [in, out], optional bias."""
    params = {"kernel": _take(state, prefix, "weight").T}
    bias = _take(state, prefix, "bias", required=False)
    if bias is not None:
        params["bias"] = bias
    return params


def conv2d(state: StateDict, prefix: str) -> dict:
    """``nn.Conv2d`` at ``prefix`` -> ``nn.Conv`` params: kernel [kh, kw, in, out], optional bias."""
    params = {"kernel": _take(state, prefix, "weight").transpose(2, 3, 1, 0)}
    bias = _take(state, prefix, "bias", required=False)
    if bias is not None:
        params["bias"] = bias
    return params


def layer_norm(state: StateDict, prefix: str) -> dict:
    """``nn.LayerNorm`` / ``nn.GroupNorm`` (affine) at ``prefix`` -> Flax ``scale``, ``bias``."""
    return {"scale": _take(state, prefix, "weight"), "bias": _take(state, prefix, "bias")}


group_norm = layer_norm


def batch_norm(state: StateDict, prefix: str) -> tuple[dict, dict]:
    """``nn.BatchNorm2d`` at ``prefix`` -> (params ``scale``/``bias``, batch_stats ``mean``/``var``)."""
    params = {"scale": _take(state, prefix, "weight"), "bias": _take(state, prefix, "bias")}
    stats = {"mean": _take(state, prefix, "running_mean"), "var": _take(state, prefix, "running_var")}
    return params, stats


def embedding(state: StateDict, prefix: str) -> dict:
    """``nn.Embedding`` at ``prefix`` -> ``nn.Embed`` params: embedding [num, dim]."""
    return {"embedding": _take(state, prefix, "weight")}


# --------------------------------------------------------------------------------------------
# Multi-head attention: torch.nn.MultiheadAttention (engineer A)
# --------------------------------------------------------------------------------------------


def mha_from_torch(module):
    """``torch.nn.MultiheadAttention`` -> ``(attnjax.attention.MultiHeadAttention, variables)``.

    Handles the packed ``in_proj_weight`` [3E, E] (split into query/key/value) and the separate
    ``q/k/v_proj_weight`` a module with ``kdim``/``vdim != embed_dim`` has, with or without bias.
    ``module.dropout`` becomes ``dropout_rate``. Our module is always batch-first: inputs of a
    ``batch_first=False`` module (``[L, batch, E]``) must be transposed by the caller. Masks
    translate with ``mha_mask_from_torch`` (PyTorch's boolean masks mean the opposite of ours).
    """
    from attnjax.attention import MultiHeadAttention

    if getattr(module, "bias_k", None) is not None or getattr(module, "add_zero_attn", False):
        raise NotImplementedError(
            "mha_from_torch: add_bias_kv=True / add_zero_attn=True append extra key/value positions "
            "that attnjax.attention.MultiHeadAttention does not model"
        )
    state = {name: to_numpy(value) for name, value in module.state_dict().items()}
    if "in_proj_weight" in state:
        weights = np.split(state["in_proj_weight"], 3)
    else:
        weights = [state[f"{name}_proj_weight"] for name in ("q", "k", "v")]
    params = {name: {"kernel": w.T} for name, w in zip(("query", "key", "value"), weights)}
    if "in_proj_bias" in state:
        for name, bias in zip(("query", "key", "value"), np.split(state["in_proj_bias"], 3)):
            params[name]["bias"] = bias
    params["out"] = linear(state, "out_proj")
    flax_module = MultiHeadAttention(
        num_heads=module.num_heads,
        use_bias="in_proj_bias" in state,
        dropout_rate=float(module.dropout),
    )
    return flax_module, {"params": params}


def mha_mask_from_torch(attn_mask=None, key_padding_mask=None, *, num_heads: int):
    """PyTorch ``MultiheadAttention`` masks -> one attnjax mask, broadcastable to ``[batch, heads, L, S]``.

    PyTorch: ``attn_mask`` ``[L, S]`` or ``[batch * heads, L, S]``, ``key_padding_mask``
    ``[batch, S]``; boolean True means "masked out", float masks are added. attnjax: boolean True
    means "may attend". Float and boolean masks together give an additive (float) mask, as in
    PyTorch. Returns None when both are None.
    """
    from attnjax.attention import combine_masks

    masks = []
    if attn_mask is not None:
        attn_mask = to_numpy(attn_mask)
        if attn_mask.ndim == 3:
            if attn_mask.shape[0] % num_heads:
                raise ValueError(
                    f"mha_mask_from_torch: attn_mask of shape {attn_mask.shape} must be [L, S] or "
                    f"[batch * num_heads, L, S] with num_heads={num_heads}"
                )
            attn_mask = attn_mask.reshape(-1, num_heads, *attn_mask.shape[1:])
        elif attn_mask.ndim != 2:
            raise ValueError(
                f"mha_mask_from_torch: attn_mask must be [L, S] or [batch * heads, L, S], got {attn_mask.shape}"
            )
        masks.append(~attn_mask if attn_mask.dtype == bool else attn_mask)
    if key_padding_mask is not None:
        key_padding_mask = to_numpy(key_padding_mask)
        if key_padding_mask.ndim != 2:
            raise ValueError(
                f"mha_mask_from_torch: key_padding_mask must be [batch, S], got {key_padding_mask.shape}"
            )
        padding = key_padding_mask[:, None, None, :]
        masks.append(~padding if padding.dtype == bool else padding)
    return combine_masks(*masks)


# --------------------------------------------------------------------------------------------
# Transformer prior: taming's minGPT (engineer E)
# --------------------------------------------------------------------------------------------

# taming key (under ``blocks.N.``) -> (Flax path under ``blocks_N``, layer converter)
_GPT_BLOCK_TABLE = (
    ("ln1", ("ln1",), layer_norm),
    ("attn.query", ("attn", "query"), linear),
    ("attn.key", ("attn", "key"), linear),
    ("attn.value", ("attn", "value"), linear),
    ("attn.proj", ("attn", "out"), linear),
    ("ln2", ("ln2",), layer_norm),
    ("mlp.0", ("mlp", "fc1"), linear),
    ("mlp.2", ("mlp", "fc2"), linear),
)


def gpt_from_taming(state_dict, n_head: int):
    """taming ``mingpt.GPT`` state dict -> ``(attnjax.prior.GPT, {"params": ...})``.

    ``vocab_size``, ``block_size``, ``n_embd`` and ``n_layer`` are read from the tensors
    (``tok_emb.weight [vocab, n_embd]``, ``pos_emb [1, block_size, n_embd]``, ``blocks.N.*``);
    ``n_head`` is not stored in the weights, so it is an argument. Dropouts are 0 (inference).
    A ``Net2NetTransformer`` state dict works too: its ``transformer.`` prefix is stripped.
    """
    from attnjax.prior import GPT

    state = load_state_dict(state_dict)
    if any(key.startswith("transformer.") for key in state):
        state = {k[len("transformer."):]: v for k, v in state.items() if k.startswith("transformer.")}
    for key in ("tok_emb.weight", "pos_emb", "ln_f.weight", "head.weight"):
        if key not in state:
            raise KeyError(f"gpt_from_taming: state dict has no key {key!r}; is it a taming GPT?")
    vocab, n_embd = state["tok_emb.weight"].shape
    block_size = state["pos_emb"].shape[1]
    n_layer = len({key.split(".")[1] for key in state if key.startswith("blocks.")})
    if n_embd % n_head:
        raise ValueError(f"gpt_from_taming: n_head={n_head} does not divide n_embd={n_embd}")
    params = {
        "tok_emb": embedding(state, "tok_emb"),
        "pos_emb": state["pos_emb"],
        "ln_f": layer_norm(state, "ln_f"),
        "head": linear(state, "head"),
    }
    for i in range(n_layer):
        block: dict = {}
        for torch_name, path, convert in _GPT_BLOCK_TABLE:
            node = block
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = convert(state, f"blocks.{i}.{torch_name}")
        params[f"blocks_{i}"] = block
    model = GPT(vocab_size=vocab, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    return model, {"params": params}


# --------------------------------------------------------------------------------------------
# VQGAN (taming-transformers): VQModel, NLayerDiscriminator
# --------------------------------------------------------------------------------------------

# taming's nested ModuleLists -> attnjax's flat submodule names.
_TAMING_RENAMES = (
    (r"\b(down|up)\.(\d+)\.(block|attn)\.(\d+)\b", r"\1_\2_\3_\4"),
    (r"\b(down|up)\.(\d+)\.(downsample|upsample)\b", r"\1_\2_\3"),
    (r"\bmid\.(block_1|attn_1|block_2)\b", r"mid_\1"),
    (r"\bmain\.(\d+)\b", r"main_\1"),
)
# Leaf name -> (collection, Flax leaf, layout rule), by the PyTorch tensor's rank.
_TAMING_LEAVES = {
    ("weight", 4): ("params", "kernel", lambda w: w.transpose(2, 3, 1, 0)),  # Conv2d
    ("weight", 2): ("params", "embedding", lambda w: w),  # nn.Embedding (the codebook)
    ("weight", 1): ("params", "scale", lambda w: w),  # GroupNorm / BatchNorm2d
    ("bias", 1): ("params", "bias", lambda w: w),
    ("running_mean", 1): ("batch_stats", "mean", lambda w: w),
    ("running_var", 1): ("batch_stats", "var", lambda w: w),
    ("loc", 4): ("params", "loc", lambda w: w.reshape(-1)),  # ActNorm [1, C, 1, 1]
    ("scale", 4): ("params", "scale", lambda w: w.reshape(-1)),
}
_TAMING_SKIPPED = ("num_batches_tracked", "initialized")


def _taming_variables(state: StateDict, prefixes: tuple[str, ...], strip: str = "") -> dict:
    """Convert the keys under ``prefixes`` (after removing ``strip``) with the tables above."""
    import re

    variables: dict = {}
    for key, value in state.items():
        if strip and not key.startswith(strip):
            continue
        name = key[len(strip):]
        if not name.startswith(prefixes) or name.rsplit(".", 1)[-1] in _TAMING_SKIPPED:
            continue
        for pattern, replacement in _TAMING_RENAMES:
            name = re.sub(pattern, replacement, name)
        *path, leaf = name.split(".")
        array = to_numpy(value)
        rule = _TAMING_LEAVES.get((leaf, array.ndim))
        if rule is None:
            raise KeyError(f"no conversion rule for {key!r} with shape {array.shape}")
        collection, flax_leaf, layout = rule
        if path[-1] == "embedding":  # quantize.embedding.weight: the codebook itself
            path, flax_leaf = path[:-1], "embedding"
        node = variables.setdefault(collection, {})
        for part in path:
            node = node.setdefault(part, {})
        node[flax_leaf] = np.ascontiguousarray(layout(array))
    return variables


def _check_against_init(module, variables: dict, example, where: str) -> None:
    """Every converted leaf must exist in ``module.init`` with the same shape, and vice versa."""
    import jax

    expected = jax.eval_shape(lambda x: module.init(jax.random.PRNGKey(0), x), example)
    expected = {
        jax.tree_util.keystr(path): leaf.shape
        for path, leaf in jax.tree_util.tree_leaves_with_path(expected)
        if jax.tree_util.keystr(path[:1]) != "['vq_state']"
    }
    got = {jax.tree_util.keystr(path): np.shape(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(variables)}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = sorted(k for k in set(got) & set(expected) if got[k] != tuple(expected[k]))
    if missing or unexpected or wrong:
        raise ValueError(
            f"{where}: the state dict does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shapes {[(k, got[k], expected[k]) for k in wrong[:5]]}"
        )


def vqgan_from_taming(state_dict, ddconfig, n_embed: int, embed_dim: int, **vqgan_kwargs):
    """A taming ``VQModel`` state dict (or module, or checkpoint path) -> ``(VQGAN, variables)``.

    Reads ``encoder.*``, ``decoder.*``, ``quant_conv.*``, ``post_quant_conv.*`` and
    ``quantize.embedding.weight`` (``loss.*`` keys are ignored; see
    ``nlayer_discriminator_from_taming``). ``ddconfig`` is taming's (its ``double_z`` must be
    False, as in every VQModel config). The quantizer is taming 0.0.1's: ``legacy=True``, beta 0.25,
    unless ``vqgan_kwargs`` say otherwise.
    """
    import jax.numpy as jnp

    from attnjax import vqgan

    state = load_state_dict(state_dict)
    state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
    ddconfig = dict(ddconfig)
    if ddconfig.get("double_z", True):
        raise ValueError(
            "vqgan_from_taming: ddconfig['double_z'] must be False (taming's VQModel quant_conv reads "
            f"z_channels channels), got {ddconfig.get('double_z', 'unset (taming default True)')}"
        )
    vqgan_kwargs.setdefault("quantizer", {"legacy": True})
    module = vqgan.create_vqgan(ddconfig, n_embed, embed_dim, **vqgan_kwargs)
    variables = _taming_variables(state, ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.", "quantize."))
    example = jnp.zeros((1, ddconfig["resolution"], ddconfig["resolution"], ddconfig["in_channels"]))
    _check_against_init(module, variables, example, "vqgan_from_taming")
    return module, variables


def nlayer_discriminator_from_taming(state_dict, prefix: str = ""):
    """taming's ``NLayerDiscriminator`` (or the ``loss.discriminator.`` part of a VQModel state
    dict, with that ``prefix``) -> ``(NLayerDiscriminator, variables)``. Width, depth, norm
    (BatchNorm / ActNorm) and input channels are read off the tensors."""
    import jax.numpy as jnp

    from attnjax import vqgan

    state = load_state_dict(state_dict)
    if prefix and not prefix.endswith("."):
        prefix += "."
    convs = sorted(
        int(k[len(prefix):].split(".")[1])
        for k, v in state.items()
        if k.startswith(prefix + "main.") and k.endswith(".weight") and np.ndim(v) == 4
    )
    if not convs:
        raise KeyError(f"nlayer_discriminator_from_taming: no '{prefix}main.N.weight' conv keys found")
    first = to_numpy(state[f"{prefix}main.0.weight"])
    if any(k.endswith(".running_mean") for k in state if k.startswith(prefix)):
        norm = "batch"
    elif any(k.endswith(".loc") for k in state if k.startswith(prefix)):
        norm = "actnorm"
    else:
        norm = "none"
    module = vqgan.NLayerDiscriminator(ndf=first.shape[0], n_layers=len(convs) - 2, norm=norm)
    variables = _taming_variables(state, ("main.",), strip=prefix)
    example = jnp.zeros((1, 64, 64, first.shape[1]))
    _check_against_init(module, variables, example, "nlayer_discriminator_from_taming")
    return module, variables


# --------------------------------------------------------------------------------------------
# Vision Transformer: timm, the seeds' PyTorch layout, Google .npz (engineer B)
# --------------------------------------------------------------------------------------------


class _RecordingState(Mapping):
    """A state dict that remembers which keys were read, so leftovers (unsupported parts) show."""

    def __init__(self, state: Mapping):
        self._state, self.read = state, set()

    def __getitem__(self, key):
        self.read.add(key)
        return self._state[key]

    def __contains__(self, key):
        return key in self._state

    def __iter__(self):
        return iter(self._state)

    def __len__(self):
        return len(self._state)

    def unread(self) -> list[str]:
        return sorted(set(self._state) - self.read)


def _as_pair(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)


def _split_packed_qkv(state: StateDict, weight_key: str, bias_key: str) -> dict:
    """Packed ``[3 * width, width]`` q|k|v (timm ``qkv``, torch ``in_proj``) -> three Dense dicts."""
    weight = _take(state, "", weight_key)
    bias = _take(state, "", bias_key, required=False)
    if bias is None:
        raise ValueError(
            f"state dict has no {bias_key!r}: attnjax's MultiHeadAttention has q/k/v biases "
            "(timm's qkv_bias=False is not supported)"
        )
    width = weight.shape[1]
    if weight.shape != (3 * width, width):
        raise ValueError(f"{weight_key}: expected shape [3 * {width}, {width}], got {weight.shape}")
    rows = [slice(i * width, (i + 1) * width) for i in range(3)]
    return {
        name: {"kernel": weight[part].T, "bias": bias[part]}
        for name, part in zip(("query", "key", "value"), rows)
    }


def _conv_patch_kernel(weight: np.ndarray) -> np.ndarray:
    """Conv2d weight ``[width, C, ph, pw]`` -> ``patch_embed.kernel [ph * pw * C, width]``."""
    width, channels, ph, pw = weight.shape
    return weight.transpose(2, 3, 1, 0).reshape(ph * pw * channels, width)


def _vit_blocks(state: StateDict, prefix: str, table, packed_qkv: tuple) -> dict:
    """``{prefix}.N.*`` for every N -> ``{"blocks_N": ...}`` by ``table`` plus the packed q|k|v."""
    indices = {int(key.split(".")[1]) for key in state if key.startswith(prefix + ".")}
    if not indices:
        raise ValueError(f"state dict has no {prefix}.N.* keys; is it a ViT?")
    params = {}
    for layer in range(max(indices) + 1):
        base = f"{prefix}.{layer}"
        block = {"attn": _split_packed_qkv(state, f"{base}.{packed_qkv[0]}", f"{base}.{packed_qkv[1]}")}
        for torch_name, path, convert in table:
            node = block
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = convert(state, f"{base}.{torch_name}")
        params[f"blocks_{layer}"] = block
    return params


def _square_grid(tokens: int, prefix_tokens: int, where: str) -> tuple[int, int]:
    side = math.isqrt(max(tokens - prefix_tokens, 0))
    if side == 0 or side * side != tokens - prefix_tokens:
        raise ValueError(
            f"{where}: a position table of {tokens} tokens is not {prefix_tokens} prefix "
            "token(s) plus a square grid"
        )
    return side, side


def _finish_vit(config: dict, overrides: dict, params: dict, grid: tuple, where: str):
    """Apply ``overrides`` to the checkpoint's ``config`` and build ``(ViT, {"params": ...})``.

    An ``image_size`` other than the checkpoint's resamples a learned position table (bicubic,
    fine-tuning at a new resolution); ``scan_layers=True`` stacks the blocks. The parameters are
    checked against the module's own ``init`` shapes.
    """
    import jax
    import jax.numpy as jnp

    from attnjax.positional import resize_position_embedding
    from attnjax.vit import create_vit, stack_block_params

    patch = _as_pair(config["patch_size"])
    config = {**config, "image_size": (grid[0] * patch[0], grid[1] * patch[1]), **overrides}
    size = _as_pair(config["image_size"])
    if size[0] % patch[0] or size[1] % patch[1]:
        raise ValueError(f"{where}: image_size {size} is not divisible by patch_size {patch}")
    new_grid = (size[0] // patch[0], size[1] // patch[1])
    if new_grid != tuple(grid) and "pos_embed" in params:
        table = params["pos_embed"]["pos_embedding"]
        prefix = table.shape[1] - grid[0] * grid[1]
        table = resize_position_embedding(table, new_grid, num_prefix_tokens=prefix, old_grid_hw=grid)
        params = {**params, "pos_embed": {"pos_embedding": np.asarray(table)}}
    model = create_vit(**config)
    if model.scan_layers:
        params = stack_block_params(params)
    params = jax.tree.map(lambda leaf: jnp.asarray(leaf, model.param_dtype), params)
    _check_against_init(model, {"params": params}, jnp.zeros((1, *size, model.in_channels)), where)
    return model, {"params": params}


# timm key under ``blocks.N.`` -> Flax path under ``blocks_N`` (plus the packed ``attn.qkv``)
_TIMM_VIT_BLOCK_TABLE = (
    ("norm1", ("norm1",), layer_norm),
    ("attn.proj", ("attn", "out"), linear),
    ("norm2", ("norm2",), layer_norm),
    ("mlp.fc1", ("mlp", "fc1"), linear),
    ("mlp.fc2", ("mlp", "fc2"), linear),
)


def _timm_module_config(model) -> dict:
    """The ViT fields a timm ``VisionTransformer`` instance knows but its state dict does not."""
    pool = {"token": "cls", "avg": "gap"}.get(model.global_pool)
    if pool is None:
        raise ValueError(
            f"vit_from_timm: global_pool={model.global_pool!r} unsupported; expected 'token' or 'avg'"
        )
    act = model.blocks[0].mlp.act
    if type(act).__name__ != "GELU" or getattr(act, "approximate", "none") != "none":
        raise ValueError(f"vit_from_timm: MLP activation {act} unsupported; expected exact nn.GELU()")
    norm = model.norm if hasattr(model.norm, "eps") else model.fc_norm
    return dict(
        num_heads=model.blocks[0].attn.num_heads,
        pool=pool,
        image_size=tuple(model.patch_embed.img_size),
        layer_norm_eps=float(norm.eps),
    )


def vit_from_timm(model_or_state_dict, *, num_heads: int | None = None, **overrides):
    """timm ``VisionTransformer`` (module, state dict or checkpoint file) -> ``(ViT, variables)``.

    ``flax_module.apply(variables, images_nhwc)`` equals timm's ``model(images_nchw)`` in eval mode.
    Key table (timm -> attnjax): ``patch_embed.proj`` (Conv2d) -> ``patch_embed`` (Dense on
    ``(row, col, C)``-flattened patches); ``cls_token``; ``pos_embed`` -> ``pos_embed/pos_embedding``;
    ``blocks.N.attn.qkv`` (packed q|k|v) -> ``blocks_N/attn/{query, key, value}``; ``attn.proj`` ->
    ``attn/out``; ``norm1``, ``norm2``, ``mlp.fc1``, ``mlp.fc2``, ``norm``, ``fc_norm``, ``head``.

    From a module, heads, pooling, LayerNorm eps and image size are read from it. From a state dict
    (``torch.save`` or ``.safetensors`` file, loaded without unpickling code) the sizes come from the
    tensors, ``num_heads`` must be given, eps is timm's 1e-6, pooling is "gap" when ``fc_norm``
    weights exist, and the grid is square. ``overrides`` are further ``ViT`` fields
    (``scan_layers``, ``remat``, ``dtype``, dropouts, a new ``image_size``...). Parts attnjax's ViT
    does not have (register tokens, LayerScale, qk-norm, pre-norm, attention pooling) leave keys
    unread and raise ``ValueError``.
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
    state = _RecordingState(load_state_dict(model_or_state_dict))
    patch_weight = _take(state, "patch_embed.proj", "weight")
    width, channels, ph, pw = patch_weight.shape
    class_token = "cls_token" in state
    fc_norm = "fc_norm.weight" in state
    params = {
        "patch_embed": {
            "kernel": _conv_patch_kernel(patch_weight),
            "bias": _take(state, "patch_embed.proj", "bias"),
        },
        "pos_embed": {"pos_embedding": _take(state, "", "pos_embed")},
        "fc_norm" if fc_norm else "norm": layer_norm(state, "fc_norm" if fc_norm else "norm"),
        **_vit_blocks(state, "blocks", _TIMM_VIT_BLOCK_TABLE, ("attn.qkv.weight", "attn.qkv.bias")),
    }
    if class_token:
        params["cls_token"] = _take(state, "", "cls_token")
    if "head.weight" in state:
        params["head"] = linear(state, "head")
    unread = state.unread()
    if unread:
        raise ValueError(f"vit_from_timm: unsupported timm ViT parts, keys not converted: {unread[:8]}")

    tokens = params["pos_embed"]["pos_embedding"].shape[1]
    if "image_size" in config:
        grid = (config["image_size"][0] // ph, config["image_size"][1] // pw)
    elif math.isqrt(tokens) ** 2 == tokens:  # no position for the class token (or no class token)
        grid = _square_grid(tokens, 0, "vit_from_timm")
    else:
        grid = _square_grid(tokens, int(class_token), "vit_from_timm")
    config = {
        "pool": "gap" if fc_norm else "cls",
        "layer_norm_eps": 1e-6,
        **config,
        "patch_size": (ph, pw),
        "width": width,
        "depth": sum(key.startswith("blocks_") for key in params),
        "mlp_dim": params["blocks_0"]["mlp"]["fc1"]["kernel"].shape[1],
        "in_channels": channels,
        "num_classes": params["head"]["kernel"].shape[1] if "head" in params else 0,
        "class_token": class_token,
        "no_embed_class": class_token and tokens == grid[0] * grid[1],
        "fc_norm": fc_norm,
    }
    return _finish_vit(config, overrides, params, grid, "vit_from_timm")


# seed key under ``transformer_blocks.N.`` -> Flax path under ``blocks_N`` (plus ``in_proj``)
_SEED_VIT_BLOCK_TABLE = (
    ("norm1", ("norm1",), layer_norm),
    ("attention.out_proj", ("attn", "out"), linear),
    ("norm2", ("norm2",), layer_norm),
    ("ffn.linear1", ("mlp", "fc1"), linear),
    ("ffn.linear2", ("mlp", "fc2"), linear),
)


def vit_from_seed_layout(
    model_or_state_dict, *, num_heads: int | None = None, in_channels: int = 3, **overrides
):
    """The study notes' PyTorch ``VisionTransformer`` (seed 000) -> ``(ViT, variables)``.

    Its layout: ``patch_embed`` (Linear on patches flattened ``(C, row, col)``, reordered here to
    attnjax's ``(row, col, C)``), ``cls_token``, ``pos_embed [1, 1 + N, width]``,
    ``transformer_blocks.N.{norm1, attention (nn.MultiheadAttention: packed in_proj_weight/bias,
    out_proj), norm2, ffn.linear1, ffn.linear2}``, ``norm``, ``head``; LayerNorm eps is torch's
    1e-5. From a module, ``num_heads`` and eps are read from it; from a state dict pass
    ``num_heads`` (and ``in_channels`` if not 3). Dropouts are 0 unless overridden: the converted
    model is for inference, or for fine-tuning with the caller's own settings.
    """
    config: dict = {"layer_norm_eps": 1e-5, "pool": "cls"}
    if hasattr(model_or_state_dict, "transformer_blocks"):
        config["num_heads"] = model_or_state_dict.transformer_blocks[0].attention.num_heads
        config["layer_norm_eps"] = float(model_or_state_dict.norm.eps)
    if num_heads is not None:
        config["num_heads"] = num_heads
    if "num_heads" not in config:
        raise ValueError(
            "vit_from_seed_layout: a state dict does not record the number of heads; pass num_heads="
        )
    state = _RecordingState(load_state_dict(model_or_state_dict))
    weight = _take(state, "patch_embed", "weight")
    width, patch_dim = weight.shape
    patch = math.isqrt(patch_dim // in_channels)
    if patch * patch * in_channels != patch_dim:
        raise ValueError(
            f"vit_from_seed_layout: patch_embed.weight of shape {weight.shape} is not in_channels="
            f"{in_channels} times a square patch; pass in_channels"
        )
    params = {
        "patch_embed": {
            "kernel": _conv_patch_kernel(weight.reshape(width, in_channels, patch, patch)),
            "bias": _take(state, "patch_embed", "bias"),
        },
        "cls_token": _take(state, "", "cls_token"),
        "pos_embed": {"pos_embedding": _take(state, "", "pos_embed")},
        "norm": layer_norm(state, "norm"),
        "head": linear(state, "head"),
        **_vit_blocks(
            state,
            "transformer_blocks",
            _SEED_VIT_BLOCK_TABLE,
            ("attention.in_proj_weight", "attention.in_proj_bias"),
        ),
    }
    unread = state.unread()
    if unread:
        raise ValueError(
            f"vit_from_seed_layout: keys not converted (not the seed layout?): {unread[:8]}"
        )
    config.update(
        patch_size=patch,
        width=width,
        depth=sum(key.startswith("blocks_") for key in params),
        mlp_dim=params["blocks_0"]["mlp"]["fc1"]["kernel"].shape[1],
        in_channels=in_channels,
        num_classes=params["head"]["kernel"].shape[1],
    )
    grid = _square_grid(params["pos_embed"]["pos_embedding"].shape[1], 1, "vit_from_seed_layout")
    return _finish_vit(config, overrides, params, grid, "vit_from_seed_layout")


# Google ViT .npz checkpoints: "/"-joined Flax paths, optionally under "params/" or "opt/target/".
#
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
        norm1="LayerNorm_0", attn="MultiHeadDotProductAttention_1", norm2="LayerNorm_2", mlp="MlpBlock_3"
    ),
    "big_vision": dict(
        norm1="LayerNorm_0", attn="MultiHeadDotProductAttention_0", norm2="LayerNorm_1", mlp="MlpBlock_0"
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
        arrays = {key: archive[key] for key in archive.files}
    prefix = next((p for p in ("", "params/", "opt/target/") if f"{p}embedding/kernel" in arrays), None)
    if prefix is None:
        raise ValueError(
            f"load_google_npz: {str(path)!r} has no 'embedding/kernel'; not a Google ViT checkpoint"
        )
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
        depth = len({k[len(block_prefix):].split("/")[0] for k in arrays if k.startswith(block_prefix)})
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
    grid = _square_grid(params["pos_embed"]["pos_embedding"].shape[1], prefix_tokens, "load_google_npz")
    return _finish_vit(config, overrides, params, grid, "load_google_npz")


def save_google_npz(path, model, variables, layout: str = "vision_transformer") -> pathlib.Path:
    """Write an attnjax ``ViT``'s parameters as a Google ``.npz`` in ``layout`` (see above).

    "vision_transformer" needs the position table to cover the class token (or no class token);
    "big_vision" needs it to cover only the patches (``no_embed_class=True``) and is written
    scanned (one ``Transformer/encoderblock`` with a leading ``[depth]`` axis) when the model uses
    ``scan_layers``. Either needs learned position embeddings and no ``fc_norm``.
    """
    from attnjax.vit import unstack_block_params

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
    ph, pw = _as_pair(model.patch_size)
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
            out[f"{name}/kernel"], out[f"{name}/bias"] = params[name]["kernel"], params[name]["bias"]

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
        arrays[f"{attn}/out/kernel"] = kernel.reshape(*kernel.shape[:-2], heads, -1, kernel.shape[-1])
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
            out.update(block_arrays(per_layer[f"blocks_{layer}"], f"Transformer/encoderblock_{layer}"))
    path = pathlib.Path(path)
    np.savez(path, **out)
    return path


# --------------------------------------------------------------------------------------------
# LPIPS (VGG16 trunk + learned linear layers)
# --------------------------------------------------------------------------------------------


def lpips_from_torch(vgg_state_dict, linear_state_dict=None):
    """VGG16 + LPIPS linear weights -> ``(attnjax.lpips.LPIPS(), variables)``.

    ``vgg_state_dict``: torchvision's ``vgg16`` (keys ``features.N.*``; the ``classifier.*`` keys
    are ignored), or a whole ``lpips.LPIPS(net="vgg")`` / taming ``LPIPS`` state dict (keys
    ``net.sliceK.N.*``). ``linear_state_dict``: the ``lpips`` package's ``weights/v0.1/vgg.pth``
    (keys ``linK.model.1.weight``); omitted when the first state dict already holds them.
    """
    import re

    from attnjax import lpips

    vgg = load_state_dict(vgg_state_dict)
    linear = vgg if linear_state_dict is None else load_state_dict(linear_state_dict)
    trunk = {}
    for key in vgg:
        match = re.fullmatch(r"(?:features|net\.slice\d)\.(\d+)\.weight", key)
        if match:
            trunk[f"features_{match.group(1)}"] = conv2d(vgg, key[: -len(".weight")])
    expected = {f"features_{index}" for index, _ in lpips.VGG16_CONVS}
    if set(trunk) != expected:
        raise KeyError(
            f"lpips_from_torch: expected the 13 VGG16 convs {sorted(expected)} as 'features.N' or "
            f"'net.sliceK.N' keys, found {sorted(trunk)}"
        )
    params = {"net": trunk}
    for k in range(len(lpips.CHANNELS)):
        key = next((f"lin{k}.model.{i}" for i in (1, 0) if f"lin{k}.model.{i}.weight" in linear), None)
        if key is None:
            raise KeyError(f"lpips_from_torch: no 'lin{k}.model.1.weight' (or model.0) in the linear weights")
        params[f"lin{k}"] = conv2d(linear, key)
    return lpips.LPIPS(), {"params": params}
