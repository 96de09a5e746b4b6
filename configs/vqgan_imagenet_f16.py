"""taming-transformers' ImageNet VQGAN, f=16 (256x256 images <-> 16x16 grids of 1024 codes).

    python train.py --config configs/vqgan_imagenet_f16.py --workdir runs/vqgan_imagenet_f16 \
        --config.lpips.vgg_path=vgg16-397923af.pth \
        --config.lpips.linear_path=.venv/lib/python3.11/site-packages/lpips/weights/v0.1/vgg.pth

Hyper-parameters from taming's configs/imagenet_vqgan.yaml (ddconfig, n_embed 1024, embed_dim
256, disc_start 250001, disc_weight 0.8, codebook_weight 1.0) and the defaults of its
VQLPIPSWithDiscriminator (perceptual_weight 1.0, hinge loss, 3-layer PatchGAN with ndf 64 and
BatchNorm, disc_factor 1.0) and VQModel (VectorQuantizer beta 0.25; Adam betas (0.5, 0.9)). The
learning rate is taming's base_learning_rate 4.5e-6 times the global batch, as its main.py
scales it. The quantizer is taming 0.0.1's (``legacy``, no codebook options), so a published
taming checkpoint converted with ``attnjax.torch_interop.vqgan_from_taming`` fine-tunes as is.
Needs the TFDS ``imagenet2012`` dataset (manual download) and accelerators.
"""
import ml_collections

BASE_LEARNING_RATE = 4.5e-6  # taming: per image of the global batch


def get_config():
    config = ml_collections.ConfigDict()
    config.task = "vqgan"
    config.seed = 0

    config.data = ml_collections.ConfigDict()
    config.data.name = "imagenet2012"
    config.data.data_dir = ""
    config.data.train_split = "train"
    config.data.eval_split = "validation"
    config.data.image_key = "image"
    config.data.label_key = "label"
    config.data.image_size = 256
    config.data.crop_padding = 0
    config.data.flip = False
    config.data.mean = (0.5, 0.5, 0.5)     # [-1, 1], as taming
    config.data.std = (0.5, 0.5, 0.5)

    config.model = ml_collections.ConfigDict()
    config.model.ddconfig = ml_collections.ConfigDict(dict(
        ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2, attn_resolutions=(16,), in_channels=3,
        out_ch=3, resolution=256, z_channels=256, double_z=False, dropout=0.0))
    config.model.n_embed = 1024
    config.model.embed_dim = 256
    config.model.beta = 0.25
    config.model.quantizer = ml_collections.ConfigDict(dict(
        legacy=True, l2_normalize=False, lookup_dim=0, ema_decay=0.0, usage_decay=0.0))
    config.reseed_threshold = 0.0

    config.loss = ml_collections.ConfigDict(dict(
        disc_start=250001, disc_weight=0.8, disc_factor=1.0, disc_loss="hinge", codebook_weight=1.0,
        perceptual_weight=1.0))
    config.discriminator = ml_collections.ConfigDict(dict(ndf=64, n_layers=3, norm="batch"))
    config.lpips = ml_collections.ConfigDict(dict(vgg_path="", linear_path=""))

    config.batch_size = 12                 # taming: 3 per GPU; scale with your devices
    config.optimizer = "adamw"             # Adam, no weight decay
    config.learning_rate = BASE_LEARNING_RATE * config.batch_size
    config.disc_learning_rate = BASE_LEARNING_RATE * config.batch_size
    config.warmup_steps = 0
    config.min_lr_ratio = 1.0              # taming keeps the rate constant
    config.weight_decay = 0.0
    config.b1 = 0.5
    config.b2 = 0.9
    config.grad_clip_norm = 0.0
    config.grad_accum_steps = 1

    config.eval_batch_size = 50
    config.num_train_steps = 500000
    config.parallel = "jit"
    config.mesh = {"data": -1, "fsdp": 1}  # devices per axis; fsdp > 1 splits the parameters
    config.distributed = False

    config.log_every = 100
    config.eval_every = 10000
    config.checkpoint_every = 5000
    config.max_to_keep = 3
    config.best_metric = "eval/psnr"
    config.best_mode = "max"
    return config
