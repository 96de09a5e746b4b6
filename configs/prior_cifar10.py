"""Class-conditional transformer prior over the codes of a CIFAR-10 VQGAN (a GPU-sized run).

    python train.py --config configs/vqgan_cifar10.py --workdir runs/vqgan_cifar10
    python train.py --config configs/prior_cifar10.py --workdir runs/prior_cifar10

Vocabulary and block size come from the VQGAN (its codebook and token grid, e.g. 8x8 = 64
tokens for 32x32 images at f=4). Sizes follow taming's smaller class-conditional transformers
(width 512, 8 heads) at a depth that suits 50k images; sampling uses taming's ``top_k=100``
at temperature 1 (``log_images``' defaults).
"""
import ml_collections


def get_config():
    config = ml_collections.ConfigDict()
    config.task = "prior"
    config.seed = 0

    config.vqgan_workdir = "runs/vqgan_cifar10"
    config.vqgan_step = None
    config.codes_cache_dir = ""
    config.num_classes = 10
    config.class_dropout = 0.1            # for classifier-free guidance

    config.data = ml_collections.ConfigDict()
    config.data.train_shifts = 0          # 50k images are enough; shifts would be 9x the encoding

    config.model_name = "gpt"
    config.model = ml_collections.ConfigDict()
    config.model.n_layer = 12
    config.model.n_head = 8
    config.model.n_embd = 512
    config.model.embd_pdrop = 0.1
    config.model.resid_pdrop = 0.1
    config.model.attn_pdrop = 0.1

    config.sampling = ml_collections.ConfigDict()
    config.sampling.temperature = 1.0
    config.sampling.top_k = 100           # taming's default in Net2NetTransformer.log_images
    config.sampling.top_p = None
    config.sampling.guidance = 1.5
    config.sampling.per_class = 8
    config.sampling.png_scale = 2

    config.optimizer = "adamw"
    config.learning_rate = 4.5e-6 * 256   # taming: base_learning_rate x batch size
    config.warmup_steps = 2000
    config.min_lr_ratio = 0.0
    config.weight_decay = 0.01            # minGPT / Net2NetTransformer
    config.b1 = 0.9
    config.b2 = 0.95
    config.grad_clip_norm = 1.0
    config.grad_accum_steps = 1
    config.ema_decay = 0.0

    config.batch_size = 256
    config.eval_batch_size = 500          # 10k test images = 20 batches
    config.num_train_steps = 100_000
    config.parallel = "jit"
    config.mesh = {"data": -1, "fsdp": 1}  # devices per axis; fsdp > 1 splits the parameters
    config.distributed = False

    config.log_every = 100
    config.eval_every = 5000
    config.checkpoint_every = 5000
    config.max_to_keep = 3
    config.best_metric = "eval/nll"
    config.best_mode = "min"
    return config
