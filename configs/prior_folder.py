"""An unconditional transformer prior over the codes of ``configs/vqgan_folder.py``'s VQGAN.

    python train.py --config configs/vqgan_folder.py --workdir runs/vqgan_folder \
        --config.data.name=folder:/path/to/images
    python train.py --config configs/prior_folder.py --workdir runs/prior_folder \
        --config.vqgan_workdir=runs/vqgan_folder

The VQGAN's images (its config.data: the same folder, crops and split) are encoded once to codes
(cached in ``<vqgan_workdir>/codes``). ``--config.num_classes=N`` (N class folders) makes it
class-conditional with classifier-free guidance. Samples: ``python -m attnjax.inference.generate
--workdir runs/prior_folder``.
"""

from configs import common


def get_config():
    config = common.prior("runs/vqgan_folder")
    config.num_classes = 0  # unconditional: a folder need not have classes
    config.class_dropout = 0.0

    config.model.n_layer = 8
    config.model.n_head = 8
    config.model.n_embd = 512

    config.sampling.top_k = 100  # taming's default in Net2NetTransformer.log_images
    config.sampling.guidance = 1.0  # no classes to guide towards
    config.sampling.per_class = 16

    config.learning_rate = 4.5e-4
    config.warmup_steps = 1000
    config.batch_size = 32
    config.eval_batch_size = 64
    config.num_train_steps = 50_000
    config.log_every = 100
    config.eval_every = 5000
    config.checkpoint_every = 1000
    config.best_metric = "eval/nll"
    return config
