"""taming-transformers' ImageNet VQGAN, f=16 (256x256 images <-> 16x16 grids of 1024 codes).

    python train.py --config configs/vqgan_imagenet_f16.py --workdir runs/vqgan_imagenet_f16 \
        --config.lpips.weights=lpips_vgg.npz

Hyper-parameters from taming's configs/imagenet_vqgan.yaml (ddconfig, n_embed 1024, embed_dim
256, disc_start 250001, disc_weight 0.8, codebook_weight 1.0) and the defaults of its
VQLPIPSWithDiscriminator (perceptual_weight 1.0, hinge loss, 3-layer PatchGAN with ndf 64 and
BatchNorm, disc_factor 1.0) and VQModel (VectorQuantizer beta 0.25; Adam betas (0.5, 0.9)). The
learning rate is taming's base_learning_rate 4.5e-6 times the global batch, as its main.py
scales it. The quantizer is taming 0.0.1's (``legacy``, no codebook options), so a published
taming checkpoint converted with ``attnjax.convert.taming`` fine-tunes as is. LPIPS weights are
converted once with ``python -m attnjax.convert.lpips``. Needs the TFDS ``imagenet2012`` dataset
(manual download) and accelerators.
"""

import ml_collections

from configs import common

BASE_LEARNING_RATE = 4.5e-6  # taming: per image of the global batch


def get_config():
    data = common.image_data(
        "imagenet2012", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)
    )  # [-1, 1], as taming
    data.eval_split = "validation"
    data.image_size = 256
    config = common.vqgan(data)

    config.model.ddconfig = ml_collections.ConfigDict(
        dict(
            ch=128,
            ch_mult=(1, 1, 2, 2, 4),
            num_res_blocks=2,
            attn_resolutions=(16,),
            in_channels=3,
            out_ch=3,
            resolution=256,
            z_channels=256,
            double_z=False,
            dropout=0.0,
        )
    )
    config.model.n_embed = 1024
    config.model.embed_dim = 256
    config.model.quantizer.legacy = True
    config.loss.update(disc_start=250001, disc_weight=0.8, perceptual_weight=1.0)

    config.batch_size = 12  # taming: 3 per GPU; scale with your devices
    config.learning_rate = BASE_LEARNING_RATE * config.batch_size
    config.disc_learning_rate = BASE_LEARNING_RATE * config.batch_size
    config.min_lr_ratio = 1.0  # taming keeps the rate constant
    config.eval_batch_size = 50
    config.num_train_steps = 500000
    config.eval_every = 10000
    config.checkpoint_every = 5000
    config.max_to_keep = 3
    return config
