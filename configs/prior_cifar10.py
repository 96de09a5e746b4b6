"""Class-conditional transformer prior over the codes of a CIFAR-10 VQGAN (a GPU-sized run).

    python train.py --config configs/vqgan_cifar10.py --workdir runs/vqgan_cifar10
    python train.py --config configs/prior_cifar10.py --workdir runs/prior_cifar10

Vocabulary and block size come from the VQGAN (its codebook and token grid, e.g. 8x8 = 64
tokens for 32x32 images at f=4). Sizes follow taming's smaller class-conditional transformers
(width 512, 8 heads) at a depth that suits 50k images; sampling uses taming's ``top_k=100``
at temperature 1 (``log_images``' defaults).
"""

from configs import common


def get_config():
    config = common.prior("runs/vqgan_cifar10")  # no train_shifts: 50k images are enough

    config.model.n_layer = 12
    config.model.n_head = 8
    config.model.n_embd = 512

    config.sampling.top_k = 100  # taming's default in Net2NetTransformer.log_images
    config.sampling.png_scale = 2

    config.learning_rate = 4.5e-6 * 256  # taming: base_learning_rate x batch size
    config.warmup_steps = 2000
    config.batch_size = 256
    config.eval_batch_size = 500  # 10k test images = 20 batches
    config.num_train_steps = 100_000
    config.eval_every = 5000
    config.checkpoint_every = 5000
    config.max_to_keep = 3
    config.best_metric = "eval/nll"
    return config
