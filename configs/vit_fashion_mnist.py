"""The MNIST ViT on Fashion-MNIST (28x28 grayscale clothing, 60000/10000): same table as
``vit_mnist.py`` except the dataset, its statistics, flips (clothes are left-right symmetric)
and a longer schedule (a harder task).

    python train.py --config configs/vit_fashion_mnist.py --workdir runs/fashion_mnist
"""
import ml_collections

EPOCH = 60_000 // 128  # 468 steps


def get_config():
    config = ml_collections.ConfigDict()
    config.task = "classification"
    config.seed = 0

    config.data = ml_collections.ConfigDict()
    config.data.name = "fashion_mnist"
    config.data.data_dir = ""
    config.data.train_split = "train"
    config.data.eval_split = "test"
    config.data.image_key = "image"
    config.data.label_key = "label"
    config.data.image_size = 0
    config.data.crop_padding = 2
    config.data.flip = True                # a mirrored shirt is still a shirt
    config.data.mean = (0.2860,)
    config.data.std = (0.3530,)

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
    config.num_train_steps = 30 * EPOCH
    config.parallel = "jit"
    config.mesh = {"data": -1, "fsdp": 1}  # devices per axis; fsdp > 1 splits the parameters
    config.distributed = False

    config.log_every = 100
    config.eval_every = 2 * EPOCH
    config.checkpoint_every = 2 * EPOCH
    config.max_to_keep = 2
    config.best_metric = "eval/accuracy"
    config.best_mode = "max"
    return config
