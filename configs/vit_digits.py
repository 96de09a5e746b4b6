"""ViT on the embedded scikit-learn digits: the default run and ``demo.py``'s first stage.

    python train.py --config configs/vit_digits.py --workdir runs/digits

A 4-layer width-64 ViT on 16x16 digits (patch 4 -> 16 tokens), 2000 steps of 64 on one CPU
device: about 99% test accuracy in about a minute on 2 CPU cores. How the recipe was chosen:
benchmarks/results/digits_recipes.md.
"""

from configs import common


def get_config():
    data = common.image_data("digits", mean=(0.5,), std=(0.5,))  # attnjax.data.Digits, no network
    data.image_size = (
        16  # 8x8 up-sampled: patch 4 -> 16 tokens; native 8x8/patch 2 stalls at ~97.7%
    )
    data.crop_padding = 1  # +-1 pixel shifts at 16x16; no flips: a mirrored digit is another digit
    config = common.classification(data)  # 1437 train / 360 test images

    config.model.num_classes = 10
    config.model.image_size = 16
    config.model.in_channels = 1
    config.model.patch_size = 4
    config.model.width = 64
    config.model.depth = 4
    config.model.num_heads = 4
    config.model.mlp_dim = 128
    config.model.dropout_rate = 0.0

    # One CPU device: its matrix products use both cores already, so splitting the batch gains
    # nothing (benchmarks/results/cpu_devices.md).
    config.cpu_devices = 1

    config.learning_rate = 3e-3
    config.warmup_steps = 100
    config.batch_size = 64
    config.eval_batch_size = 120  # 360 test images = 3 batches
    # ~89 epochs: 98.6-100% over five seeds, mean 99.3%; 1500 steps: mean 98.6% over three
    config.num_train_steps = 2000
    config.log_every = 50
    config.eval_every = 500
    config.checkpoint_every = 500
    return config
