"""A small ViT on MNIST (28x28 grayscale, 60000/10000); ~99% within a few epochs.

    python train.py --config configs/vit_mnist.py --workdir runs/mnist
Needs MNIST prepared as array_record (``pip install attnjax[tfds-prepare]``;
``tfds build mnist --file_format=array_record``).
"""
import ml_collections

EPOCH = 60_000 // 128  # 468 steps


def get_config():
    config = ml_collections.ConfigDict()
    config.task = "classification"
    config.seed = 0

    config.data = ml_collections.ConfigDict()
    config.data.name = "mnist"
    config.data.data_dir = ""
    config.data.train_split = "train"
    config.data.eval_split = "test"
    config.data.image_key = "image"
    config.data.label_key = "label"
    config.data.image_size = 0             # native 28x28; patch 4 -> 49 tokens
    config.data.crop_padding = 2           # +-2 pixel shifts
    config.data.flip = False               # mirrored digits are not digits
    config.data.mean = (0.1307,)
    config.data.std = (0.3081,)

    config.model_name = "vit"
    config.model = ml_collections.ConfigDict()
    config.model.num_classes = 10
    config.model.image_size = 28
    config.model.in_channels = 1
    config.model.patch_size = 4
    config.model.width = 128
    config.model.depth = 6
    config.model.num_heads = 4
    config.model.mlp_dim = 256
    config.model.dropout_rate = 0.1

    config.optimizer = "adamw"
    config.learning_rate = 1e-3
    config.warmup_steps = EPOCH
    config.min_lr_ratio = 0.0
    config.weight_decay = 0.05
    config.b1 = 0.9
    config.b2 = 0.999
    config.grad_clip_norm = 1.0
    config.grad_accum_steps = 1
    config.ema_decay = 0.0
    config.label_smoothing = 0.1

    config.batch_size = 128
    config.eval_batch_size = 500
    config.num_train_steps = 10 * EPOCH
    config.parallel = "jit"
    config.mesh = {"data": -1, "fsdp": 1}  # devices per axis; fsdp > 1 splits the parameters
    config.distributed = False

    config.log_every = 100
    config.eval_every = EPOCH
    config.checkpoint_every = EPOCH
    config.max_to_keep = 2
    config.best_metric = "eval/accuracy"
    config.best_mode = "max"
    return config
