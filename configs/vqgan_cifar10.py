"""VQGAN on CIFAR-10: 32x32 images <-> 8x8 grids of 512 codes, with the PatchGAN from step 5000.

    python train.py --config configs/vqgan_cifar10.py --workdir runs/vqgan_cifar10

Needs the TFDS ``cifar10`` dataset prepared (``pip install attnjax[tfds-prepare]``). The
perceptual term is on when LPIPS weights are given (``--config.lpips.vgg_path=vgg16.pth``; the
linear layers default to the ``lpips`` package's own ``weights/v0.1/vgg.pth`` via
``--config.lpips.linear_path``); without them it is off and the log says so.
"""
import ml_collections


def get_config():
    config = ml_collections.ConfigDict()
    config.task = "vqgan"
    config.seed = 0

    config.data = ml_collections.ConfigDict()
    config.data.name = "cifar10"
    config.data.data_dir = ""
    config.data.train_split = "train"      # 50000
    config.data.eval_split = "test"        # 10000
    config.data.image_key = "image"
    config.data.label_key = "label"
    config.data.image_size = 0             # native 32x32
    config.data.crop_padding = 0
    config.data.flip = True
    config.data.mean = (0.5, 0.5, 0.5)     # [-1, 1], as taming
    config.data.std = (0.5, 0.5, 0.5)

    config.model = ml_collections.ConfigDict()
    config.model.ddconfig = ml_collections.ConfigDict(dict(
        ch=64, ch_mult=(1, 2, 2), num_res_blocks=2, attn_resolutions=(8,), in_channels=3, out_ch=3,
        resolution=32, z_channels=64, double_z=False, dropout=0.0))
    config.model.n_embed = 512
    config.model.embed_dim = 64
    config.model.beta = 0.25
    config.model.quantizer = ml_collections.ConfigDict(dict(
        legacy=False, l2_normalize=True, lookup_dim=0, ema_decay=0.0, usage_decay=0.99))
    config.reseed_threshold = 0.03

    config.loss = ml_collections.ConfigDict(dict(
        disc_start=5000, disc_weight=0.8, disc_factor=1.0, disc_loss="hinge", codebook_weight=1.0,
        perceptual_weight=1.0))
    config.discriminator = ml_collections.ConfigDict(dict(ndf=64, n_layers=2, norm="batch"))
    config.lpips = ml_collections.ConfigDict(dict(vgg_path="", linear_path=""))

    config.optimizer = "adamw"
    config.learning_rate = 4e-4
    config.disc_learning_rate = 4e-4
    config.warmup_steps = 500
    config.min_lr_ratio = 0.1
    config.weight_decay = 0.0
    config.b1 = 0.5
    config.b2 = 0.9
    config.grad_clip_norm = 0.0
    config.grad_accum_steps = 1

    config.batch_size = 128
    config.eval_batch_size = 500
    config.num_train_steps = 50000
    config.parallel = "jit"
    config.mesh = {"data": -1, "fsdp": 1}  # devices per axis; fsdp > 1 splits the parameters
    config.distributed = False

    config.log_every = 100
    config.eval_every = 2500
    config.checkpoint_every = 2500
    config.max_to_keep = 2
    config.best_metric = "eval/psnr"
    config.best_mode = "max"
    return config
