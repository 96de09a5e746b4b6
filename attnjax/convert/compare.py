"""Layer-by-layer parity report: where does an attnjax conversion depart from its PyTorch original?

``compare_layers`` runs the PyTorch model (forward hooks on every submodule) and the attnjax
module (``capture_intermediates``) on the same input, pairs each Flax module path with its PyTorch
module name through the conversion tables, and returns one row per paired layer in PyTorch's
execution order: ``(layer, max_abs, max_rel, ok)``, ``max_rel = max|ours - theirs| / max|theirs|``.
The first row that is not ``ok`` is where the two first disagree.

Supported: timm ``VisionTransformer`` / attnjax ``ViT``; taming ``VQModel`` parts / ``VQGAN``;
taming ``mingpt.GPT`` / ``prior.GPT``; torch's ``nn.Transformer`` family /
``attnjax.models.transformer``.

    python -m attnjax.convert.compare --model timm:vit_tiny_patch16_224
    python -m attnjax.convert.compare --model taming-gpt --checkpoint gpt.safetensors --n-head 8
    python -m attnjax.convert.compare --model torch:TransformerEncoder --plant layers.1.linear2
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, NamedTuple

import numpy as np

from attnjax.convert import common, taming, timm, torch_nn


class Row(NamedTuple):
    layer: str
    max_abs: float
    max_rel: float
    ok: bool


@dataclasses.dataclass(frozen=True)
class _Pairing:
    """How one model family's Flax paths, inputs and activations line up with PyTorch's."""

    torch_names: Callable[[list[tuple]], dict[tuple, str]]
    torch_inputs: Callable[[Any], Any]
    torch_activation: Callable[[np.ndarray, str], np.ndarray]
    packed_qkv: bool = False  # torch packs q|k|v in one Linear where Flax has three Denses


def _numbered(part: str) -> str:
    """``blocks_3`` / ``layers_3`` (Flax) -> ``blocks.3`` / ``layers.3`` (a torch ModuleList)."""
    return re.sub(r"^(blocks|layers)_(\d+)$", r"\1.\2", part)


def _numbered_path(path: tuple) -> str:
    return ".".join(_numbered(part) for part in path)


def _renamer(renames: dict[str, str]) -> Callable[[list[tuple]], dict[tuple, str]]:
    """Flax paths -> torch names: numbered lists, then ``flax.suffix -> torch.suffix`` renames."""

    def torch_name(path: tuple) -> str:
        name = _numbered_path(path)
        for flax_suffix, torch_suffix in renames.items():
            if name == flax_suffix or name.endswith("." + flax_suffix):
                return name[: len(name) - len(flax_suffix)] + torch_suffix
        return name

    return lambda paths: {path: torch_name(path) for path in paths}


def _table_names(table, structural=()) -> Callable[[list[tuple]], dict[tuple, str]]:
    """Flax paths -> torch names from the importer's key table read backwards.

    A module a row names gets that row's torch name; its parents inherit it for as long as the two
    names end alike (``blocks_1/attn`` is ``blocks.1.attn`` because ``blocks_1/attn/value`` is
    ``blocks.1.attn.value``); the rest are numbered lists. Rows whose ``structural`` converter maps
    one torch module to a differently shaped Flax one (a Conv2d patch embedding read as a Dense,
    a packed q|k|v Linear split in three) are left out: their outputs do not compare.
    """
    rows = common.reversed_table([row for row in table if row[2] not in structural], "compare")

    def torch_names(paths: list[tuple]) -> dict[tuple, str]:
        names: dict[tuple, str] = {}
        for path in paths:
            found = common.torch_module_name(rows, path)
            name = found[0] if found else None
            while name is not None and path and path not in names:
                names[path] = name
                suffix = "." + _numbered(path[-1])
                path, name = path[:-1], name[: -len(suffix)] if name.endswith(suffix) else None
        return {path: names.get(path, _numbered_path(path)) for path in paths}

    return torch_names


def _nchw(x):
    import torch

    return torch.from_numpy(np.ascontiguousarray(np.asarray(x).transpose(0, 3, 1, 2)))


def _channels_last(array: np.ndarray, _: str) -> np.ndarray:
    return array.transpose(0, 2, 3, 1) if array.ndim == 4 else array


def _as_tensor(x):
    import torch

    return torch.from_numpy(np.array(x))


def _unchanged(array: np.ndarray, _: str) -> np.ndarray:
    return array


def _pairing(flax_module) -> _Pairing:
    kind = type(flax_module).__name__
    if kind == "ViT":
        names = _table_names(
            timm.TIMM_VIT_TABLE, structural=(timm.packed_qkv, timm.conv_patch_embedding)
        )
        return _Pairing(names, _nchw, _unchanged, packed_qkv=True)
    if kind == "VQGAN":
        return _Pairing(_table_names(taming.VQMODEL_TABLE), _nchw, _channels_last)
    if kind == "GPT":
        return _Pairing(_table_names(taming.GPT_TABLE), _as_tensor, _unchanged)
    if kind in torch_nn.TRANSFORMER_KINDS:
        renames = {
            "self_attn.out": "self_attn.out_proj",
            "multihead_attn.out": "multihead_attn.out_proj",
        }

        def layout(array: np.ndarray, name: str) -> np.ndarray:
            # inside the Flax module every layer is batch-first; only its own output follows the
            # input
            return array if flax_module.batch_first or not name else np.swapaxes(array, 0, 1)

        return _Pairing(_renamer(renames), _as_tensor, layout)
    raise ValueError(
        f"compare_layers: no layer pairing for {kind}; expected ViT, VQGAN, GPT or a "
        f"transformer module ({', '.join(torch_nn.TRANSFORMER_KINDS)})"
    )


def _first_array(output):
    """A module's output -> its first array (torch: ``MultiheadAttention`` returns
    ``(out, weights)``)."""
    while isinstance(output, (tuple, list)):
        if not output:
            return None
        output = output[0]
    return output


def _torch_activations(torch_model, inputs) -> dict[str, np.ndarray]:
    """Every submodule's output by module name, in the order the modules finished."""
    import torch

    activations: dict[str, np.ndarray] = {}

    def record(name):
        def hook(module, args, output):
            output = _first_array(output)
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                activations.pop(name, None)  # a module called again: keep its last call, in order
                activations[name] = common.to_numpy(output)

        return hook

    handles = [
        module.register_forward_hook(record(name)) for name, module in torch_model.named_modules()
    ]
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # fused kernels skip the submodules' hooks
    try:
        with torch.no_grad():
            torch_model.eval()(*inputs)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        for handle in handles:
            handle.remove()
    return activations


def _flax_activations(flax_module, variables, inputs) -> dict[tuple, np.ndarray]:
    """Every Flax submodule's ``__call__`` output by module path."""
    import jax

    _, state = flax_module.apply(
        variables, *inputs, capture_intermediates=True, mutable=["intermediates"]
    )
    activations = {}

    def walk(tree, path):
        for key, value in tree.items():
            if key == "__call__":
                output = _first_array(value[-1])
                if output is not None and jax.numpy.issubdtype(output.dtype, jax.numpy.floating):
                    activations[path] = np.asarray(output, np.float32)
            elif isinstance(value, dict):
                walk(value, (*path, key))

    walk(state["intermediates"], ())
    return activations


def _add_packed_qkv(ours: dict[str, np.ndarray]) -> None:
    """``X.attn.query|key|value`` outputs -> ``X.attn.qkv``, the packed Linear's output in timm."""
    for name in [n for n in ours if n.endswith(".attn.query")]:
        base = name[: -len(".query")]
        parts = [ours.get(f"{base}.{part}") for part in ("query", "key", "value")]
        if all(part is not None for part in parts):
            ours[f"{base}.qkv"] = np.concatenate(parts, axis=-1)


def compare_layers(
    torch_model, flax_module, variables, inputs, tolerance: float = 1e-5
) -> list[Row]:
    """Run both models on ``inputs`` and compare every layer the two have in common.

    Args:
      torch_model: the PyTorch original (put in eval mode).
      flax_module, variables: its attnjax conversion.
      inputs: an array or a tuple of arrays in attnjax's layout (images ``[batch, H, W, C]``,
        token ids ``[batch, length]``, sequences ``[batch, length, d_model]``); images are handed
        to PyTorch as ``[batch, C, H, W]``.
      tolerance: the largest ``max_rel`` a layer may have.

    Returns:
      Rows ``(layer, max_abs, max_rel, ok)`` in PyTorch's execution order (a module ends after its
      children); the model's own output is the row named ``"(output)"``.
    """
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    pairing = _pairing(flax_module)
    theirs = _torch_activations(torch_model, [pairing.torch_inputs(x) for x in inputs])
    flax_activations = _flax_activations(flax_module, variables, inputs)
    names = pairing.torch_names(list(flax_activations))
    ours = {names[path]: value for path, value in flax_activations.items()}
    if pairing.packed_qkv:
        _add_packed_qkv(ours)
    rows = []
    for name, reference in theirs.items():
        if name not in ours:
            continue
        reference = pairing.torch_activation(reference, name)
        if reference.shape != ours[name].shape:
            continue
        difference = float(np.max(np.abs(ours[name] - reference)))
        relative = difference / max(float(np.max(np.abs(reference))), np.finfo(np.float32).tiny)
        rows.append(Row(name or "(output)", difference, relative, relative <= tolerance))
    if not rows:
        raise ValueError(
            f"compare_layers: no layer of {type(torch_model).__name__} pairs with one of "
            f"{type(flax_module).__name__}; is this its conversion?"
        )
    return rows


def first_failure(rows: list[Row]) -> Row | None:
    """The first layer beyond tolerance, or None."""
    return next((row for row in rows if not row.ok), None)


def format_report(rows: list[Row], tolerance: float) -> str:
    width = max(len(row.layer) for row in rows)
    lines = [f"{'layer':<{width}}  {'max_abs':>10}  {'max_rel':>10}  ok"]
    lines += [
        f"{r.layer:<{width}}  {r.max_abs:10.3e}  {r.max_rel:10.3e}  {'yes' if r.ok else 'NO'}"
        for r in rows
    ]
    failure = first_failure(rows)
    if failure is None:
        lines.append(f"all {len(rows)} layers within max_rel {tolerance:g}")
    else:
        lines.append(
            f"first layer beyond max_rel {tolerance:g}: {failure.layer} "
            f"(max_rel {failure.max_rel:.3e})"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line: python -m attnjax.convert.compare --model KIND [--checkpoint PATH] [--plant NAME]
# --------------------------------------------------------------------------------------------

_SMALL_VQGAN = dict(
    ch=32,
    ch_mult=(1, 2),
    num_res_blocks=1,
    attn_resolutions=(8,),
    in_channels=3,
    out_ch=3,
    resolution=16,
    z_channels=16,
    double_z=False,
    dropout=0.0,
)


def _taming_vq_parts(ddconfig, n_embed: int, embed_dim: int):
    """taming's VQModel without pytorch-lightning: its five submodules under their own names."""
    import torch
    from taming.modules.diffusionmodules.model import Decoder, Encoder
    from taming.modules.vqvae.quantize import VectorQuantizer

    class VQParts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = Encoder(**ddconfig), Decoder(**ddconfig)
            self.quantize = VectorQuantizer(n_embed, embed_dim, beta=0.25)
            self.quant_conv = torch.nn.Conv2d(ddconfig["z_channels"], embed_dim, 1)
            self.post_quant_conv = torch.nn.Conv2d(embed_dim, ddconfig["z_channels"], 1)

        def forward(self, x):
            quant = self.quantize(self.quant_conv(self.encoder(x)))[0]
            return self.decoder(self.post_quant_conv(quant))

    return VQParts()


def _load_weights(torch_model, checkpoint) -> None:
    """Load ``checkpoint`` into ``torch_model``; a Lightning ``model.`` or a Net2NetTransformer
    ``transformer.`` prefix is dropped, and extra keys (``loss.*``) are ignored."""
    import torch

    if not checkpoint:
        return
    state = common.load_state_dict(checkpoint)
    own = torch_model.state_dict()
    for prefix in ("model.", "transformer."):
        if not any(key in own for key in state) and any(key.startswith(prefix) for key in state):
            state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(
            f"compare: checkpoint {str(checkpoint)!r} lacks {len(missing)} keys of the model, "
            f"e.g. {missing[:4]}"
        )
    torch_model.load_state_dict({k: torch.from_numpy(np.array(state[k])) for k in own}, strict=True)


def build(model: str, checkpoint=None, n_head: int = 8, config=None, seed: int = 0):
    """``--model`` -> (torch model, flax module, variables, inputs in attnjax's layout)."""
    import torch

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    if model.startswith("timm:"):
        common.make_torchvision_importable()
        import timm as timm_library

        torch_model = timm_library.create_model(model[len("timm:") :], pretrained=False)
        _load_weights(torch_model, checkpoint)
        flax_module, variables = timm.vit_from_timm(torch_model)
        height, width = torch_model.patch_embed.img_size
        inputs = rng.standard_normal((1, height, width, flax_module.in_channels)).astype(np.float32)
    elif model == "taming-gpt":
        from taming.modules.transformer import mingpt

        if checkpoint:
            flax_module, variables = taming.gpt_from_taming(checkpoint, n_head=n_head)
            m = flax_module
            torch_model = mingpt.GPT(
                m.vocab_size, m.block_size, n_layer=m.n_layer, n_head=n_head, n_embd=m.n_embd
            )
            _load_weights(torch_model, checkpoint)
        else:
            torch_model = mingpt.GPT(64, 16, n_layer=2, n_head=n_head, n_embd=8 * n_head)
            flax_module, variables = taming.gpt_from_taming(torch_model.state_dict(), n_head=n_head)
        inputs = rng.integers(0, flax_module.vocab_size, (1, flax_module.block_size))
    elif model == "taming-vqgan":
        params = _taming_config(config)
        torch_model = _taming_vq_parts(params["ddconfig"], params["n_embed"], params["embed_dim"])
        _load_weights(torch_model, checkpoint)
        flax_module, variables = taming.vqgan_from_taming(
            torch_model.state_dict(), params["ddconfig"], params["n_embed"], params["embed_dim"]
        )
        size, channels = params["ddconfig"]["resolution"], params["ddconfig"]["in_channels"]
        inputs = rng.uniform(-1, 1, (1, size, size, channels)).astype(np.float32)
    elif model.startswith("torch:") and model[len("torch:") :] in torch_nn.TRANSFORMER_KINDS:
        torch_model = _torch_transformer(model[len("torch:") :], n_head)
        _load_weights(torch_model, checkpoint)
        flax_module, variables = torch_nn.transformer_from_torch(torch_model)
        inputs = rng.standard_normal((2, 10, 8 * n_head)).astype(np.float32)
        if "Decoder" in model or model == "torch:Transformer":
            inputs = (inputs, rng.standard_normal((2, 7, 8 * n_head)).astype(np.float32))
    else:
        raise ValueError(
            f"compare: --model {model!r}; expected timm:NAME, taming-gpt, taming-vqgan or "
            f"torch:KIND with KIND one of {torch_nn.TRANSFORMER_KINDS}"
        )
    return torch_model.eval(), flax_module, variables, inputs


def _taming_config(config) -> dict:
    """A taming YAML's ``model.params`` (ddconfig, n_embed, embed_dim), or a small default."""
    if config is None:
        return {"ddconfig": _SMALL_VQGAN, "n_embed": 32, "embed_dim": 8}
    import yaml

    with open(config) as f:
        params = yaml.safe_load(f)["model"]["params"]
    return {key: params[key] for key in ("ddconfig", "n_embed", "embed_dim")}


def _torch_transformer(kind: str, n_head: int):
    import torch

    d_model = 8 * n_head
    layer = dict(d_model=d_model, nhead=n_head, dim_feedforward=2 * d_model, batch_first=True)
    if kind == "Transformer":
        return torch.nn.Transformer(num_encoder_layers=2, num_decoder_layers=2, **layer)
    if kind.startswith("TransformerEncoder"):
        single = torch.nn.TransformerEncoderLayer(**layer)
        return (
            single
            if kind.endswith("Layer")
            else torch.nn.TransformerEncoder(single, 2, enable_nested_tensor=False)
        )
    single = torch.nn.TransformerDecoderLayer(**layer)
    return single if kind.endswith("Layer") else torch.nn.TransformerDecoder(single, 2)


def plant(torch_model, name: str, scale: float = 1e-2) -> None:
    """Perturb the weight of torch module ``name`` (after conversion): a known wrong layer."""
    import torch

    parameters = dict(torch_model.named_parameters())
    key = next(
        (k for k in (f"{name}.weight", name, f"{name}.in_proj_weight") if k in parameters), None
    )
    if key is None:
        raise ValueError(
            f"compare: --plant {name!r} names no parameter; e.g. {sorted(parameters)[:4]}"
        )
    parameters[key].data = parameters[key].data + scale * torch.randn_like(parameters[key])


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m attnjax.convert.compare", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--model", required=True, help="timm:NAME, taming-gpt, taming-vqgan, torch:KIND"
    )
    parser.add_argument(
        "--checkpoint", help="state dict file (.safetensors or torch.save); default random weights"
    )
    parser.add_argument("--config", help="taming YAML config (taming-vqgan)")
    parser.add_argument("--n-head", type=int, default=4, help="heads (taming-gpt, torch:KIND)")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--plant", help="torch module whose weight is perturbed after conversion")
    args = parser.parse_args(argv)
    torch_model, flax_module, variables, inputs = build(
        args.model, args.checkpoint, args.n_head, args.config
    )
    if args.plant:
        plant(torch_model, args.plant)
    rows = compare_layers(torch_model, flax_module, variables, inputs, args.tolerance)
    print(format_report(rows, args.tolerance))
    return 0 if first_failure(rows) is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
