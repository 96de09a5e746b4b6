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
