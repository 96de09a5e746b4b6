"""VQGAN on the embedded scikit-learn digits: 16x16 images <-> 4x4 grids of 128 codes.

    python train.py --config configs/vqgan_digits.py --workdir runs/vqgan_digits

The first stage of ``demo.py`` (its codes feed the transformer prior). L1 + codebook loss only:
at 16x16 the PatchGAN and LPIPS terms add little (see the README); switch them on with
``--config.loss.disc_weight=0.8`` and ``--config.lpips.vgg_path=...``.

Measured on the 2 shared CPU cores: 800 steps at 4.0 steps/s (3 min 43 s for the whole run at
load ~2; 1.6 steps/s at load ~10), held-out PSNR 24.9 dB, 100% of the 128 codes used
(perplexity 120), and the digits ViT (configs/vit_digits.py, 99.7% on the originals) classifies
98.3% of the reconstructions right. 600 steps: 24.4 dB, same usage and ViT accuracy.
"""
import ml_collections


def get_config():
    config = ml_collections.ConfigDict()
    config.task = "vqgan"
    config.seed = 0

    config.data = ml_collections.ConfigDict()
    config.data.name = "digits"
    config.data.data_dir = ""
    config.data.train_split = "train"     # 1437 images
    config.data.eval_split = "test"       # 360 images
    config.data.image_key = "image"
    config.data.label_key = "label"
    config.data.image_size = 16           # 8x8 up-sampled: f=4 gives a 4x4 token grid
    config.data.crop_padding = 1          # +-1 pixel shifts
    config.data.flip = False
    config.data.mean = (0.5,)             # pixels in [-1, 1], as taming
    config.data.std = (0.5,)

    config.model = ml_collections.ConfigDict()
    config.model.ddconfig = ml_collections.ConfigDict(dict(
        ch=32, ch_mult=(1, 1, 2), num_res_blocks=1, attn_resolutions=(), in_channels=1, out_ch=1,
        resolution=16, z_channels=32, double_z=False, dropout=0.0))
    config.model.n_embed = 128
    config.model.embed_dim = 32
    config.model.beta = 0.25
    config.model.quantizer = ml_collections.ConfigDict(dict(
        kind="vq",                        # or "fsq", "lfq", "simvq" (attnjax/quantizers.py)
        rotation_trick=False,             # vq, simvq: rotate onto the code instead of copying
        legacy=False,
        l2_normalize=True,                # cosine codes: plain lookup uses ~30% of the codebook
        lookup_dim=0,                     # 0: look up in embed_dim
        ema_decay=0.0,                    # 0: codebook trained by gradient
        usage_decay=0.95,                 # per-code usage average read by the re-seeding
        fsq_levels=(8, 4, 4),             # fsq: 8*4*4 = 128 codes
        lfq_entropy_weight=0.1,           # lfq: 7 signs = 128 codes; MAGVIT-v2's entropy weight
    ))
    config.reseed_threshold = 0.03        # re-seed codes below 3% of a uniform share

    config.loss = ml_collections.ConfigDict(dict(
        disc_start=0, disc_weight=0.0,    # 0: no discriminator
        disc_factor=1.0, disc_loss="hinge", codebook_weight=1.0, perceptual_weight=0.0))
    config.discriminator = ml_collections.ConfigDict(dict(ndf=32, n_layers=2, norm="batch"))
    config.lpips = ml_collections.ConfigDict(dict(vgg_path="", linear_path=""))

    config.optimizer = "adamw"            # Adam (weight_decay 0) with taming's betas
    config.learning_rate = 2e-3
    config.disc_learning_rate = 2e-3
    config.warmup_steps = 50
    config.min_lr_ratio = 0.05
    config.weight_decay = 0.0
    config.b1 = 0.5
    config.b2 = 0.9
    config.grad_clip_norm = 0.0
    config.grad_accum_steps = 1

    config.batch_size = 64
    config.eval_batch_size = 360          # the whole test split: eval usage is the split's
    config.num_train_steps = 800          # ~24.5 dB, all codes used
    config.parallel = "jit"
    config.distributed = False

    config.log_every = 50
    config.eval_every = 400
    config.checkpoint_every = 400
    config.max_to_keep = 2
    config.best_metric = "eval/psnr"
    config.best_mode = "max"
    return config
