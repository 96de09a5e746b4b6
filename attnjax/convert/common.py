"""What every converter shares: loading a state dict safely, the layer converters, key tables.

The layer converters turn one PyTorch layer's tensors into the matching Flax parameter dict:

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

A key table lists ``(torch module pattern, flax path, layer converter)`` rows; ``apply_key_table``
converts a whole state dict with one and refuses keys no row converted, so a checkpoint with parts
the Flax model lacks fails loudly instead of loading half its weights. torch is imported only
inside functions: it is a development extra, and the Google ``.npz`` reader needs none of it.
"""

from __future__ import annotations

import math
import pathlib
import pickle
import re
import sys
from typing import Any, Callable, Mapping, Sequence

import numpy as np

StateDict = Mapping[str, Any]
# (regex over a torch module prefix or parameter key, flax path with \1-style group references
# and "/" separators, converter(state, prefix) -> params dict, (params, batch_stats) or array)
KeyTable = Sequence[tuple[str, str, Callable]]


def to_numpy(value) -> np.ndarray:
    """A torch tensor (any device, with or without grad) or array-like -> float32/int numpy array.

    Always a copy: ``Tensor.numpy()`` shares the tensor's memory, so without one an in-place update
    of the PyTorch parameter (an optimizer step) would silently change the converted weights too.
    """
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if value.dtype.is_floating_point:
            value = value.float()
        value = value.numpy()
    return np.array(value, copy=True)


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
        import torch

        source = torch.load(str(path), map_location="cpu", weights_only=True)
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


def take(state: StateDict, prefix: str, name: str, required: bool = True):
    """``state[prefix.name]`` as numpy; a missing required key raises a KeyError naming it."""
    key = f"{prefix}.{name}" if prefix else name
    if key not in state:
        if required:
            raise KeyError(f"state dict has no key {key!r} (needed for {prefix or 'root'})")
        return None
    return to_numpy(state[key])


def parameter(state: StateDict, key: str) -> np.ndarray:
    """A bare ``nn.Parameter`` (``cls_token``, ``pos_embed``) at ``key``, unchanged."""
    return take(state, "", key)


def linear(state: StateDict, prefix: str) -> dict:
    """``nn.Linear`` at ``prefix`` -> ``nn.Dense`` params: kernel [in, out], optional bias."""
    params = {"kernel": take(state, prefix, "weight").T}
    bias = take(state, prefix, "bias", required=False)
    if bias is not None:
        params["bias"] = bias
    return params


def conv2d(state: StateDict, prefix: str) -> dict:
    """``nn.Conv2d`` at ``prefix`` -> ``nn.Conv`` params: kernel [kh, kw, in, out], optional
    bias."""
    params = {"kernel": take(state, prefix, "weight").transpose(2, 3, 1, 0)}
    bias = take(state, prefix, "bias", required=False)
    if bias is not None:
        params["bias"] = bias
    return params


def layer_norm(state: StateDict, prefix: str) -> dict:
    """``nn.LayerNorm`` / ``nn.GroupNorm`` (affine) at ``prefix`` -> Flax ``scale``, optional
    ``bias`` (torch's ``bias=False``)."""
    params = {"scale": take(state, prefix, "weight")}
    bias = take(state, prefix, "bias", required=False)
    if bias is not None:
        params["bias"] = bias
    return params


group_norm = layer_norm


def batch_norm(state: StateDict, prefix: str) -> tuple[dict, dict]:
    """``nn.BatchNorm2d`` at ``prefix`` -> (params ``scale``/``bias``, batch_stats
    ``mean``/``var``)."""
    params = {"scale": take(state, prefix, "weight"), "bias": take(state, prefix, "bias")}
    stats = {"mean": take(state, prefix, "running_mean"), "var": take(state, prefix, "running_var")}
    return params, stats


def embedding(state: StateDict, prefix: str) -> dict:
    """``nn.Embedding`` at ``prefix`` -> ``nn.Embed`` params: embedding [num, dim]."""
    return {"embedding": take(state, prefix, "weight")}


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


def _place(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for part in parents:
        tree = tree.setdefault(part, {})
    if isinstance(value, dict):  # merged, not replaced: rows may fill one module's parts
        for key, item in value.items():
            _place(tree.setdefault(leaf, {}), key, item)
    else:
        tree[leaf] = value


def apply_key_table(
    state: StateDict, table: KeyTable, where: str, skip: str | None = None
) -> dict[str, dict]:
    """Convert ``state`` with ``table`` -> ``{"params": ...}`` (plus ``"batch_stats"`` if any).

    Each key is matched, in table order, against ``pattern`` (a module prefix followed by one
    ``.leaf``, or a whole parameter key); the first matching row converts that module once with
    ``converter(state, prefix)`` and puts the result at the expanded flax path. Keys that match
    ``skip`` (a regex searched in the key) are bookkeeping and ignored. A key no converter read
    raises a ValueError naming it: the checkpoint has parts the Flax model does not.
    """
    recording = _RecordingState(state)
    variables: dict[str, dict] = {"params": {}}
    converted: set[str] = set()
    for key in state:
        if skip and re.search(skip, key):
            continue
        for pattern, path, convert in table:
            match = re.fullmatch(rf"{pattern}(?P<_leaf>\.[^.]+)?", key)
            if match is None:
                continue
            prefix = key[: match.start("_leaf")] if match.group("_leaf") else key
            if prefix not in converted:
                converted.add(prefix)
                result = convert(recording, prefix)
                flax_path = match.expand(path)
                if isinstance(result, tuple):
                    _place(variables["params"], flax_path, result[0])
                    _place(variables.setdefault("batch_stats", {}), flax_path, result[1])
                else:
                    _place(variables["params"], flax_path, result)
            break
    unread = sorted(
        k for k in state if k not in recording.read and not (skip and re.search(skip, k))
    )
    if unread:
        raise ValueError(
            f"{where}: keys not converted (parts the Flax model does not have): {unread[:8]}"
        )
    return variables


# --------------------------------------------------------------------------------------------
# The other direction: Flax params -> torch tensors, by reading a key table backwards
# --------------------------------------------------------------------------------------------


def dense_to_linear(params: Mapping) -> dict:
    """``nn.Dense`` params -> ``nn.Linear`` tensors: weight [out, in], optional bias."""
    tensors = {"weight": np.asarray(params["kernel"], np.float32).T}
    if "bias" in params:
        tensors["bias"] = np.asarray(params["bias"], np.float32)
    return tensors


def conv_to_conv2d(params: Mapping) -> dict:
    """``nn.Conv`` params -> ``nn.Conv2d`` tensors: weight [out, in, kh, kw], optional bias."""
    tensors = {"weight": np.asarray(params["kernel"], np.float32).transpose(3, 2, 0, 1)}
    if "bias" in params:
        tensors["bias"] = np.asarray(params["bias"], np.float32)
    return tensors


def norm_to_torch(params: Mapping) -> dict:
    """``nn.LayerNorm`` / ``nn.GroupNorm`` params -> torch ``weight``[, ``bias``]."""
    tensors = {"weight": np.asarray(params["scale"], np.float32)}
    if "bias" in params:
        tensors["bias"] = np.asarray(params["bias"], np.float32)
    return tensors


def embed_to_embedding(params: Mapping) -> dict:
    """``nn.Embed`` params -> ``nn.Embedding`` ``weight`` [num, dim]."""
    return {"weight": np.asarray(params["embedding"], np.float32)}


def parameter_to_torch(array) -> np.ndarray:
    """A bare parameter (``cls_token``, ``pos_embed``), unchanged."""
    return np.asarray(array, np.float32)


# Each layer converter -> its inverse; a model's exporter adds the inverses of its own converters.
TO_TORCH = {
    linear: dense_to_linear,
    conv2d: conv_to_conv2d,
    layer_norm: norm_to_torch,
    embedding: embed_to_embedding,
    parameter: parameter_to_torch,
}

_GROUP = re.compile(r"\(((?:[^()\\]|\\.)*)\)")


def _reversed_row(pattern: str, path: str, where: str) -> tuple[re.Pattern, list[str]]:
    """One key-table row backwards: (regex over a "/"-joined Flax module path, the torch name as
    literal pieces around the regex's groups ``g1``, ``g2``...)."""
    pieces = _GROUP.split(pattern)
    literals = [piece.replace("\\.", ".") for piece in pieces[0::2]]
    groups = pieces[1::2]
    if any(not re.fullmatch(r"[\w.]*", literal) for literal in literals):
        raise ValueError(f"{where}: key table pattern {pattern!r} is not literal text and (groups)")
    flax_regex, seen = [], set()
    for index, piece in enumerate(re.split(r"\\(\d+)", path)):
        if index % 2 == 0:
            flax_regex.append(re.escape(piece))
        elif piece in seen:
            flax_regex.append(f"(?P=g{piece})")
        else:
            seen.add(piece)
            flax_regex.append(f"(?P<g{piece}>{groups[int(piece) - 1]})")
    if seen != {str(number) for number in range(1, len(groups) + 1)}:
        raise ValueError(f"{where}: flax path {path!r} does not use every group of {pattern!r}")
    return re.compile("".join(flax_regex)), literals


def reversed_table(table: KeyTable, where: str) -> list[tuple[re.Pattern, list[str], Callable]]:
    """Every row of ``table`` backwards, for ``torch_module_name``; a row whose pattern is more than
    literal text and groups, or whose Flax path drops a group, raises a ValueError naming it."""
    return [(*_reversed_row(pattern, path, where), convert) for pattern, path, convert in table]


def torch_module_name(rows, flax_path: Sequence[str]) -> tuple[str, Callable] | None:
    """The torch module name and layer converter of the first reversed row that matches the Flax
    module at ``flax_path`` exactly, or None."""
    for regex, literals, convert in rows:
        match = regex.fullmatch("/".join(flax_path))
        if match is not None:
            groups = [match.group(f"g{number}") for number in range(1, len(literals))]
            name = literals[0] + "".join(
                group + literal for group, literal in zip(groups, literals[1:])
            )
            return name, convert
    return None


def _leaf_paths(tree: Mapping, path: tuple = ()):
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _leaf_paths(value, (*path, key))
        else:
            yield (*path, key)


def export_with_key_table(
    params: Mapping, table: KeyTable, to_torch: Mapping, where: str
) -> dict[str, np.ndarray]:
    """Flax ``params`` -> a torch state dict (numpy float32), ``table`` read backwards.

    Each parameter belongs to its deepest enclosing Flax module that a row of ``table`` names
    (``blocks_0/attn/out`` before ``blocks_0/attn``); that module's subtree goes through the
    inverse (``to_torch[converter]``) of the row's converter once, giving ``{leaf: tensor}`` under
    the row's torch name (or one tensor at that name, for bare parameters). A parameter no row
    names raises a ValueError: the model has parts the torch layout does not.
    """
    rows = reversed_table(table, where)
    modules: dict[tuple, tuple[str, Callable]] = {}
    for leaf_path in _leaf_paths(params):
        for end in range(len(leaf_path), 0, -1):
            found = torch_module_name(rows, leaf_path[:end])
            if found is not None:
                modules.setdefault(leaf_path[:end], found)
                break
        else:
            raise ValueError(f"{where}: no torch key for the Flax parameter {'/'.join(leaf_path)}")
    state = {}
    for module_path, (name, convert) in modules.items():
        if convert not in to_torch:
            raise ValueError(
                f"{where}: no inverse of the converter {getattr(convert, '__name__', convert)}"
            )
        subtree = params
        for part in module_path:
            subtree = subtree[part]
        tensors = to_torch[convert](subtree)
        if isinstance(tensors, Mapping):
            state.update({f"{name}.{leaf}": tensor for leaf, tensor in tensors.items()})
        else:
            state[name] = tensors
    return {key: np.ascontiguousarray(value, np.float32) for key, value in state.items()}


def check_against_init(module, variables: dict, example, where: str) -> None:
    """Every converted leaf must exist in ``module.init`` with the same shape, and vice versa."""
    import jax

    expected = jax.eval_shape(lambda x: module.init(jax.random.PRNGKey(0), x), example)
    expected = {
        jax.tree_util.keystr(path): leaf.shape
        for path, leaf in jax.tree_util.tree_leaves_with_path(expected)
        if jax.tree_util.keystr(path[:1]) != "['vq_state']"
    }
    got = {
        jax.tree_util.keystr(path): np.shape(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(variables)
    }
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = sorted(k for k in set(got) & set(expected) if got[k] != tuple(expected[k]))
    if missing or unexpected or wrong:
        raise ValueError(
            f"{where}: the state dict does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, "
            f"wrong shapes {[(k, got[k], expected[k]) for k in wrong[:5]]}"
        )


def square_grid(tokens: int, prefix_tokens: int, where: str) -> tuple[int, int]:
    """The ``(side, side)`` patch grid of a position table of ``tokens`` rows."""
    side = math.isqrt(max(tokens - prefix_tokens, 0))
    if side == 0 or side * side != tokens - prefix_tokens:
        raise ValueError(
            f"{where}: a position table of {tokens} tokens is not {prefix_tokens} prefix "
            "token(s) plus a square grid"
        )
    return side, side


def finish_vit(config: dict, overrides: dict, params: dict, grid: tuple, where: str):
    """Apply ``overrides`` to the checkpoint's ViT ``config`` and build ``(ViT, {"params": ...})``.

    An ``image_size`` other than the checkpoint's resamples a learned position table (bicubic,
    fine-tuning at a new resolution); ``scan_layers=True`` stacks the blocks. The parameters are
    checked against the module's own ``init`` shapes.
    """
    import jax
    import jax.numpy as jnp

    from attnjax.models.patches import pair
    from attnjax.models.vit import create_vit, stack_block_params
    from attnjax.ops.positional import resize_position_embedding

    patch = pair(config["patch_size"], "patch_size", where)
    config = {**config, "image_size": (grid[0] * patch[0], grid[1] * patch[1]), **overrides}
    size = pair(config["image_size"], "image_size", where)
    if size[0] % patch[0] or size[1] % patch[1]:
        raise ValueError(f"{where}: image_size {size} is not divisible by patch_size {patch}")
    new_grid = (size[0] // patch[0], size[1] // patch[1])
    if new_grid != tuple(grid) and "pos_embed" in params:
        table = params["pos_embed"]["pos_embedding"]
        prefix = table.shape[1] - grid[0] * grid[1]
        table = resize_position_embedding(
            table, new_grid, num_prefix_tokens=prefix, old_grid_hw=grid
        )
        params = {**params, "pos_embed": {"pos_embedding": np.asarray(table)}}
    model = create_vit(**config)
    if model.scan_layers:
        params = stack_block_params(params)
    params = jax.tree.map(lambda leaf: jnp.asarray(leaf, model.param_dtype), params)
    check_against_init(model, {"params": params}, jnp.zeros((1, *size, model.in_channels)), where)
    return model, {"params": params}


_TORCHVISION_SCHEMAS: list = []


def make_torchvision_importable() -> None:
    """Let ``import torchvision`` (done by timm and lpips) work next to a CPU-only torch wheel.

    PyPI's torchvision is a CUDA build: its compiled extension links ``libtorch_cuda.so``, which the
    CPU torch does not ship, so it fails to load and ``import torchvision`` then dies on
    ``operator torchvision::nms does not exist`` (its Python side registers fake kernels for the
    ``nms``/``qnms`` operators only that extension defines). When the extension does not load, this
    declares those two schemas without kernels: models and transforms work, and the compiled
    detection ops raise torch's "no kernel" error. Never run on import: the compare command's
    timm path, the test setup, the notebooks and the benchmarks call it where they need timm.
    """
    import importlib.util

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None or _TORCHVISION_SCHEMAS:
        return
    extension = next(pathlib.Path(spec.origin).parent.glob("_C*.so"), None)
    if extension is not None:
        try:
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
    _TORCHVISION_SCHEMAS.append(library)  # a Library undoes its definitions when collected


def write_converted(prog: str, out, sources, convert: Callable[[], Any], save, force: bool) -> int:
    """The body of a converter command: checks ``out`` (an ``.npz`` not yet there, or ``force``)
    and the ``sources`` files, runs ``convert()`` and writes its result with ``save(result,
    out)`` -> the exit status. Bad input is one line on stderr (status 2) and writes nothing."""
    out = pathlib.Path(out)
    try:
        if out.suffix != ".npz":
            raise ValueError(f"OUT must end in .npz (numpy would append it), got {str(out)!r}")
        if out.exists() and not force:
            raise ValueError(f"OUT {str(out)!r} exists; pass --force to overwrite it")
        for source in sources:
            if source is not None and not pathlib.Path(source).is_file():
                raise ValueError(f"no weights file at {source!r}")
        result = convert()
    except (
        ValueError,
        KeyError,
        TypeError,
        OSError,
        RuntimeError,
        EOFError,
        pickle.UnpicklingError,
    ) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        message = " ".join(str(message).split())  # one line, whatever torch put in it
        print(f"{prog}: {message}", file=sys.stderr)
        return 2
    save(result, out)
    print(f"wrote {out}")
    return 0
