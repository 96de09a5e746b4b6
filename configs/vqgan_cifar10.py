"""VQGAN on CIFAR-10: 32x32 images <-> 8x8 grids of 512 codes, with the PatchGAN from step 5000.

    python train.py --config configs/vqgan_cifar10.py --workdir runs/vqgan_cifar10 \
        --config.lpips.weights=lpips_vgg.npz

Needs the TFDS ``cifar10`` dataset prepared (``pip install attnjax[tfds-prepare]``). The
perceptual term is on when LPIPS weights are given (converted once from torchvision's VGG16 and
the ``lpips`` package's linear layers with ``python -m attnjax.convert.lpips``); without them it
is off and the log says so.
"""

import ml_collections

from configs import common


def get_config():
    data = common.image_data(
        "cifar10", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)
    )  # [-1, 1], as taming
    data.flip = True
    config = common.vqgan(data)  # 50000 train / 10000 test images

    config.model.ddconfig = ml_collections.ConfigDict(
        dict(
            ch=64,
            ch_mult=(1, 2, 2),
            num_res_blocks=2,
            attn_resolutions=(8,),
            in_channels=3,
            out_ch=3,
            resolution=32,
            z_channels=64,
            double_z=False,
            dropout=0.0,
        )
    )
    config.model.n_embed = 512
    config.model.embed_dim = 64
    config.model.quantizer.update(l2_normalize=True, usage_decay=0.99)
    config.reseed_threshold = 0.03
    config.loss.update(disc_start=5000, disc_weight=0.8, perceptual_weight=1.0)
    config.discriminator.update(n_layers=2)

    config.learning_rate = 4e-4
    config.disc_learning_rate = 4e-4
    config.warmup_steps = 500
    config.min_lr_ratio = 0.1
    config.batch_size = 128
    config.eval_batch_size = 500
    config.num_train_steps = 50000
    config.eval_every = 2500
    config.checkpoint_every = 2500
    return config
