"""A VQGAN on your own images: 128x128 crops <-> 16x16 grids of 1024 codes (f=8).

    python train.py --config configs/vqgan_folder.py --workdir runs/vqgan_folder \
        --config.data.name=folder:/path/to/images

Labels are not used: any folder layout of docs/own_images.md works, a flat folder too. Images
are cropped as taming's custom datasets crop them (the shorter side resized to image_size, a
random square for training, the central one for evaluation); an image smaller than image_size
is an error rather than an enlarged blur: lower ``--config.data.image_size`` for small images
(a multiple of 8). taming's objective with its PatchGAN from step 10,000; taming's perceptual
term (weight 1) is on with LPIPS weights, ``--config.lpips.weights=lpips_vgg.npz`` (converted once
with ``python -m attnjax.convert.lpips``).
"""

import ml_collections

from configs import common


def get_config():
    data = common.image_data("folder:", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))  # taming's
    data.image_size = 128
    data.train_crop = "random"
    data.eval_crop = "center"
    data.flip = True
    data.upscale = False
    data.read_threads = 4  # decoding and cropping in grain's threads, not the training thread
    config = common.vqgan(data)

    config.model.ddconfig = ml_collections.ConfigDict(
        dict(
            ch=64,
            ch_mult=(1, 1, 2, 4),
            num_res_blocks=2,
            attn_resolutions=(16,),
            in_channels=data.get_ref("channels"),
            out_ch=data.get_ref("channels"),
            resolution=data.get_ref("image_size"),
            z_channels=128,
            double_z=False,
            dropout=0.0,
        )
    )
    config.model.n_embed = 1024
    config.model.embed_dim = 64
    config.model.quantizer.l2_normalize = True  # cosine codes with re-seeding: codes stay in use
    config.model.quantizer.usage_decay = 0.95
    config.reseed_threshold = 0.03
    config.loss.update(disc_start=10_000, disc_weight=0.8)

    config.learning_rate = 2e-4
    config.disc_learning_rate = 2e-4
    config.warmup_steps = 500
    config.batch_size = 16
    config.eval_batch_size = 64
    config.num_train_steps = 50_000
    config.log_every = 100
    config.eval_every = 2500
    config.checkpoint_every = 1000
    return config
