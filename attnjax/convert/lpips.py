"""LPIPS weights -> ``attnjax.models.lpips.LPIPS``: torchvision's VGG16 trunk plus the ``lpips``
package's learned linear layers. Run once to write a numpy file the training code reads without
torch::

    python -m attnjax.convert.lpips vgg16-397923af.pth lpips/weights/v0.1/vgg.pth lpips_vgg.npz

The VGG16 file may be a ``.safetensors``; the linear-layer file may be left out when the first
file already holds the ``lin*`` weights (a whole ``lpips.LPIPS(net="vgg")`` state dict).
"""

from __future__ import annotations

import argparse
import sys

from attnjax.convert.common import apply_key_table, conv2d, load_state_dict, write_converted

# torchvision ``vgg16().features.N`` or lpips' ``net.sliceK.N`` -> the trunk conv ``features_N``;
# lpips' ``linK.model.1`` (``model.0`` when saved without dropout) -> the 1x1 conv ``linK``.
LPIPS_TABLE = (
    (r"(?:features|net\.slice\d)\.(\d+)", r"net/features_\1", conv2d),
    (r"lin(\d)\.model\.[01]", r"lin\1", conv2d),
)
# Not weights of the perceptual distance: VGG16's classifier, lpips' fixed input scaling (constants
# in attnjax.models.lpips), and lpips' ``lins`` list, which holds lin0..lin4 a second time.
_NOT_CONVERTED = r"^(classifier|scaling_layer|lins)\."


def lpips_from_torch(vgg_state_dict, linear_state_dict=None):
    """VGG16 + LPIPS linear weights -> ``(attnjax.models.lpips.LPIPS(), variables)``.

    ``vgg_state_dict``: torchvision's ``vgg16`` (keys ``features.N.*``; the ``classifier.*`` keys
    are ignored), or a whole ``lpips.LPIPS(net="vgg")`` / taming ``LPIPS`` state dict (keys
    ``net.sliceK.N.*``). ``linear_state_dict``: the ``lpips`` package's ``weights/v0.1/vgg.pth``
    (keys ``linK.model.1.weight``); omitted when the first state dict already holds them. Each
    may be a module, a mapping or a checkpoint file (``.pth``/``.pt``/``.safetensors``).
    """
    from attnjax.models import lpips

    state = load_state_dict(vgg_state_dict)
    if linear_state_dict is not None:
        state.update(load_state_dict(linear_state_dict))
    params = apply_key_table(state, LPIPS_TABLE, "lpips_from_torch", skip=_NOT_CONVERTED)["params"]
    trunk = params.get("net", {})
    expected = {f"features_{index}" for index, _ in lpips.VGG16_CONVS}
    if set(trunk) != expected:
        raise KeyError(
            f"lpips_from_torch: expected the 13 VGG16 convs {sorted(expected)} as 'features.N' or "
            f"'net.sliceK.N' keys, found {sorted(trunk)}"
        )
    for k in range(len(lpips.CHANNELS)):
        if f"lin{k}" not in params:
            raise KeyError(
                f"lpips_from_torch: no 'lin{k}.model.1.weight' (or model.0) in the linear weights"
            )
    return lpips.LPIPS(), {"params": params}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnjax.convert.lpips",
        description="Convert VGG16 + LPIPS linear weights into the .npz that "
        "attnjax.models.lpips.load_variables reads.",
    )
    parser.add_argument("vgg", help="torchvision vgg16 weights (.pth, .pt or .safetensors)")
    parser.add_argument(
        "linear", nargs="?", help="lpips weights/v0.1/vgg.pth (omit if VGG holds lin* keys)"
    )
    parser.add_argument("out", help="the converted weights to write (.npz)")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    args = parser.parse_args(argv)
    from attnjax.models import lpips

    return write_converted(
        "python -m attnjax.convert.lpips",
        args.out,
        [args.vgg, args.linear],
        lambda: lpips_from_torch(args.vgg, args.linear)[1],
        lpips.save_variables,
        args.force,
    )


if __name__ == "__main__":
    sys.exit(main())
