"""A pretrained ViT file -> the ``.npz`` that ``config.init_from`` reads, with the model's config
read from the weights:

    python -m attnjax.convert.vit_checkpoint vit_base_patch16_224.pth vit_b16.npz
    python -m attnjax.convert.vit_checkpoint model.safetensors vit.npz --num-heads 12 \\
        --mean 0.485 0.456 0.406 --std 0.229 0.224 0.225

Sources: a timm ``VisionTransformer`` state dict (``.pth``/``.pt``/``.bin``, read with
``torch.load(weights_only=True)``, or ``.safetensors``) or a Google ViT ``.npz`` (original or
big_vision layout). The shapes give width, depth, MLP size, patch size, the image size (the
position table's square grid), the class token, ``fc_norm`` (and with it the pooling: "gap"
when present, timm's rule) and the class count. The head count is not in a timm file's shapes:
``--num-heads``, default ``width // 64`` (every timm ViT from Ti to H, and the Google ones).

The output holds the params flattened with "/" (``params/blocks_0/attn/query/kernel``, ...) and,
under ``METADATA``, JSON ``{"model": ViT fields, "data": {"image_size", "mean", "std"},
"source": ...}``. The mean and std are what the checkpoint's training normalised with; no file
records them: timm's ``augreg`` ViTs and the Google ones use 0.5 (the default), timm's
ImageNet-1k ones ImageNet's statistics; its ``pretrained_cfg`` says which.
``configs/vit_finetune.py:OUT`` reads all of it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np

# The ``.npz`` key of the JSON that describes the converted model.
METADATA = "attnjax_metadata"
# timm's and Google's ViTs all have 64-dimensional heads.
HEAD_DIM = 64
STATE_DICT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")
# The ``ViT`` fields a converted file records: what a config needs to build the same model.
MODEL_FIELDS = (
    "width",
    "depth",
    "num_heads",
    "mlp_dim",
    "patch_size",
    "image_size",
    "in_channels",
    "num_classes",
    "pool",
    "class_token",
    "no_embed_class",
    "fc_norm",
    "layer_norm_eps",
    "representation_size",
    "parallel_block",
    "qk_norm",
    "qkv_bias",
    "layer_norm_bias",
)


def load_vit(source, *, num_heads: int | None = None):
    """A timm state dict or Google ``.npz`` file -> ``(ViT, variables)`` (params only).

    ``num_heads``: timm files only (Google files record it); None is ``width // 64``."""
    from attnjax.convert import google_npz, timm
    from attnjax.convert.common import load_state_dict, take

    path = pathlib.Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r}: no such file; expected a ViT checkpoint")
    if path.suffix == ".npz":
        return google_npz.load_google_npz(path)
    if path.suffix not in STATE_DICT_SUFFIXES:
        raise ValueError(
            f"{str(path)!r}: unknown kind of file; expected a timm state dict "
            f"({', '.join(STATE_DICT_SUFFIXES)}) or a Google ViT .npz"
        )
    state = load_state_dict(path)
    width = take(state, "patch_embed.proj", "weight").shape[0]
    heads = num_heads or width // HEAD_DIM
    if not heads or width % heads:
        raise ValueError(
            f"{str(path)!r}: width {width} is not divisible by {heads} heads; pass --num-heads"
        )
    return timm.vit_from_timm(state, num_heads=heads)


def model_fields(model) -> dict:
    """The ``MODEL_FIELDS`` of a ``ViT``, as JSON values (tuples become lists)."""
    fields = {name: getattr(model, name) for name in MODEL_FIELDS}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}


def metadata(model, *, mean, std, source: str) -> dict:
    image_size = model.image_size
    side = image_size[0] if isinstance(image_size, (tuple, list)) else image_size
    if len(mean) != model.in_channels or len(std) != model.in_channels:
        raise ValueError(
            f"--mean {list(mean)} / --std {list(std)}: expected {model.in_channels} values each, "
            "one per channel of the checkpoint's images"
        )
    return {
        "model": model_fields(model),
        "data": {"image_size": side, "mean": list(mean), "std": list(std)},
        "source": source,
    }


def save(path, variables, meta: dict) -> str:
    """``variables``' params flattened with "/" and ``meta`` as JSON, written to a temporary name
    and renamed: an interrupted conversion leaves no half-written file under ``path``."""
    import flax

    path = os.fspath(path)
    flat = flax.traverse_util.flatten_dict(variables["params"], sep="/")
    arrays = {f"params/{key}": np.asarray(value) for key, value in flat.items()}
    arrays[METADATA] = np.asarray(json.dumps(meta))
    partial = f"{path}.partial.npz"
    np.savez(partial, **arrays)
    os.replace(partial, path)
    return path


def read_metadata(path) -> dict:
    """The JSON ``save`` wrote into ``path`` (numpy only: configs call it)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path!r}: no such file; expected a converted ViT .npz")
    with np.load(path, allow_pickle=False) as archive:
        if METADATA not in archive.files:
            raise ValueError(
                f"{path!r} has no {METADATA!r}; expected a file written by "
                "python -m attnjax.convert.vit_checkpoint"
            )
        return json.loads(str(archive[METADATA]))


def read_params(path, num_heads: int) -> dict:
    """Flat ``{"a/b/kernel": array}`` params of a timm state-dict file (``init_from`` given the
    file itself; the heads only split q/k/v, which keeps their shapes)."""
    import flax

    _, variables = load_vit(path, num_heads=num_heads)
    return flax.traverse_util.flatten_dict(variables["params"], sep="/")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m attnjax.convert.vit_checkpoint", description=__doc__.splitlines()[0]
    )
    parser.add_argument("source", help="timm .pth/.pt/.bin/.safetensors or Google ViT .npz")
    parser.add_argument("out", help="the .npz to write (config.init_from)")
    parser.add_argument("--num-heads", type=int, default=None, help="default: width // 64")
    parser.add_argument("--mean", type=float, nargs="+", default=(0.5, 0.5, 0.5))
    parser.add_argument("--std", type=float, nargs="+", default=(0.5, 0.5, 0.5))
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    if not args.out.endswith(".npz"):
        raise ValueError(f"OUT {args.out!r} must end in .npz (what config.init_from reads)")
    if os.path.exists(args.out) and not args.overwrite:
        raise ValueError(f"OUT {args.out!r} exists; not overwriting it without --overwrite")
    model, variables = load_vit(args.source, num_heads=args.num_heads)
    meta = metadata(model, mean=args.mean, std=args.std, source=os.path.abspath(args.source))
    save(args.out, variables, meta)
    return meta


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        meta = run(args)
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"error: {error}")
    fields = ", ".join(f"{k}={v}" for k, v in meta["model"].items())
    data = meta["data"]
    print(f"wrote {args.out}: ViT {fields}")
    print(f"preprocessing: {data['image_size']} px, mean {data['mean']}, std {data['std']}")
    print(f"fine-tune: python train.py --config configs/vit_finetune.py:{args.out} ...")
    return meta


if __name__ == "__main__":
    main()
