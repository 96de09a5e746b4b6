"""A small ViT on MNIST (28x28 grayscale, 60000/10000); ~99% within a few epochs.

    python train.py --config configs/vit_mnist.py --workdir runs/mnist
Needs MNIST prepared as array_record (``pip install attnjax[tfds-prepare]``;
``tfds build mnist --file_format=array_record``).
"""

from configs import common

EPOCH = 60_000 // 128  # 468 steps


def get_config():
    data = common.image_data("mnist", mean=(0.1307,), std=(0.3081,))
    data.crop_padding = 2  # +-2 pixel shifts; no flips: mirrored digits are not digits
    config = common.classification(data)

    config.model.num_classes = 10
    config.model.image_size = 28  # patch 4 -> 49 tokens
    config.model.in_channels = 1
    config.model.patch_size = 4
    config.model.width = 128
    config.model.depth = 6
    config.model.num_heads = 4
    config.model.mlp_dim = 256
    config.model.dropout_rate = 0.1

    config.warmup_steps = EPOCH
    config.batch_size = 128
    config.eval_batch_size = 500
    config.num_train_steps = 10 * EPOCH
    config.eval_every = EPOCH
    config.checkpoint_every = EPOCH
    return config
