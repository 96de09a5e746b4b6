"""pytorch-fid's Inception weights -> ``attnjax.models.inception.InceptionV3``. Run once to write
a numpy file that FID reads without torch::

    python -m attnjax.convert.inception pt_inception-2015-12-05-6726825d.pth inception.npz

The input is the state dict ``fid_inception_v3()`` loads (pytorch-fid's ``FID_WEIGHTS_URL``) or
any state dict of that network (torchvision's ``Inception3`` with the FID blocks, 1008 classes,
no auxiliary head), read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import argparse
import sys

from attnjax.convert.common import (
    apply_key_table,
    batch_norm,
    check_against_init,
    conv2d,
    linear,
    load_state_dict,
    write_converted,
)

# Every conv is a BasicConv2d (``.conv`` + ``.bn``) in the stem (``Conv2d_1a_3x3``) or in a
# block's branch (``Mixed_6b.branch7x7_2``); the names are the Flax module names.
INCEPTION_TABLE = (
    (r"fc", "fc", linear),
    (r"(\w+)\.(\w+)\.conv", r"\1/\2/conv", conv2d),
    (r"(\w+)\.(\w+)\.bn", r"\1/\2/bn", batch_norm),
    (r"(\w+)\.conv", r"\1/conv", conv2d),
    (r"(\w+)\.bn", r"\1/bn", batch_norm),
)
# BatchNorm's step counter is bookkeeping, not a weight.
_NOT_CONVERTED = r"\.num_batches_tracked$"


def inception_from_torch(state_dict):
    """pytorch-fid's Inception state dict (a module, a mapping or a ``.pth`` file) ->
    ``variables`` of ``InceptionV3`` (``{"params": ..., "batch_stats": ...}``), checked against
    the module's own shapes."""
    import jax.numpy as jnp

    from attnjax.models import inception

    state = load_state_dict(state_dict)
    variables = apply_key_table(state, INCEPTION_TABLE, "inception_from_torch", _NOT_CONVERTED)
    model = inception.InceptionV3(outputs=inception.OUTPUTS)
    example = jnp.zeros((1, inception.SIZE, inception.SIZE, 3))
    check_against_init(model, variables, example, "inception_from_torch")
    return variables


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnjax.convert.inception",
        description="Convert pytorch-fid's Inception weights into the .npz that "
        "attnjax.models.inception.load_variables reads.",
    )
    parser.add_argument("weights", help="pytorch-fid's Inception state dict (.pth)")
    parser.add_argument("out", help="the converted weights to write (.npz)")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    args = parser.parse_args(argv)
    from attnjax.models import inception

    return write_converted(
        "python -m attnjax.convert.inception",
        args.out,
        [args.weights],
        lambda: inception_from_torch(args.weights),
        inception.save_variables,
        args.force,
    )


if __name__ == "__main__":
    sys.exit(main())
