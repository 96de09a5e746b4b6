"""The CIFAR ViT of ``attnjax.models.vit`` (``create_vit("cifar")``: 6 layers, width 256, 8 heads,
MLP 512, patch 4, dropout 0.2) trained from scratch on CIFAR-10.

    python train.py --config configs/vit_cifar10.py --workdir runs/cifar10
Needs CIFAR-10 prepared as array_record: ``pip install attnjax[tfds-prepare]`` then
``tfds build cifar10 --file_format=array_record``.

Recipe numbers follow omihub777/ViT-CIFAR (github.com/omihub777/ViT-CIFAR, 90.92% test accuracy
from scratch with a 7-layer width-384 ViT): batch 128, 200 epochs, 5 warmup epochs, cosine decay,
peak learning rate 1e-3, label smoothing 0.1. That run also used AutoAugment, which attnjax does
not implement (crop+flip only here), and Adam with L2 5e-5; we use AdamW with DeiT's 0.05 decay.
Expect a GPU and ~1 hour; this recipe has not been run to completion.
"""

from configs import common

EPOCH = 50_000 // 128  # 390 steps


def get_config():
    data = common.image_data("cifar10", mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616))
    data.crop_padding = 4  # standard CIFAR: pad 4, random 32x32 crop
    data.flip = True
    config = common.classification(data)  # 50000 train / 10000 test images

    config.model.variant = "cifar"
    config.model.num_classes = 10

    config.warmup_steps = 5 * EPOCH
    config.min_lr_ratio = 0.01
    config.batch_size = 128
    config.eval_batch_size = 500
    config.num_train_steps = 200 * EPOCH
    config.eval_every = 5 * EPOCH
    config.checkpoint_every = 5 * EPOCH
    return config
