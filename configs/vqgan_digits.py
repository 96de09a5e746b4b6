"""VQGAN on the embedded scikit-learn digits: 16x16 images <-> 4x4 grids of 128 codes.

    python train.py --config configs/vqgan_digits.py --workdir runs/vqgan_digits

The second stage of ``demo.py`` (its codes feed the transformer prior): 1000 steps of 32 images
at learning rate 3e-3, l2-normalised codes with dead-code re-seeding, L1 + codebook loss only.
At 16x16 the PatchGAN and LPIPS terms add little (docs/vqgan.md); switch them on with
``--config.loss.disc_weight=0.8`` and ``--config.lpips.weights=lpips_vgg.npz`` (converted once
with ``python -m attnjax.convert.lpips``). The LFQ settings below are the defaults for
``--config.model.quantizer.kind=lfq``. What it reaches and how the recipe was chosen:
benchmarks/results/digits_recipes.md.
"""

import ml_collections

from configs import common


def get_config():
    data = common.image_data("digits", mean=(0.5,), std=(0.5,))  # pixels in [-1, 1], as taming
    data.image_size = 16  # 8x8 up-sampled: f=4 gives a 4x4 token grid
    data.crop_padding = 1  # +-1 pixel shifts
    config = common.vqgan(data)  # 1437 train / 360 test images

    config.model.ddconfig = ml_collections.ConfigDict(
        dict(
            ch=32,
            ch_mult=(1, 1, 2),
            num_res_blocks=1,
            attn_resolutions=(),
            in_channels=1,
            out_ch=1,
            resolution=16,
            z_channels=32,
            double_z=False,
            dropout=0.0,
        )
    )
    config.model.n_embed = 128
    config.model.embed_dim = 32
    config.model.quantizer.l2_normalize = (
        True  # cosine codes: plain lookup uses ~30% of the codebook
    )
    config.model.quantizer.usage_decay = 0.95  # per-code usage average read by the re-seeding
    # kind=lfq: a lower commitment and entropy weight than MAGVIT-v2's (0.25, 0.1) and a softer
    # code distribution reconstruct better here (benchmarks/results/digits_recipes.md)
    config.model.quantizer.lfq_entropy_weight = 0.02
    config.model.quantizer.lfq_commitment_weight = 0.01
    config.model.quantizer.lfq_temperature = 0.1
    config.reseed_threshold = 0.03  # re-seed codes below 3% of a uniform share
    config.discriminator.update(ndf=32, n_layers=2)

    config.learning_rate = 3e-3
    config.disc_learning_rate = 2e-3
    config.warmup_steps = 50
    config.min_lr_ratio = 0.05
    config.batch_size = 32
    config.eval_batch_size = 360  # the whole test split: eval usage is the split's
    config.num_train_steps = 1000  # ~24.9 dB, all codes used
    config.log_every = 50
    config.eval_every = 500
    config.checkpoint_every = 500
    return config
