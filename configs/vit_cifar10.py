"""The seeds' CIFAR ViT (``create_vit("cifar")``: 6 layers, width 256, 8 heads, MLP 512, patch 4,
dropout 0.2) trained from scratch on CIFAR-10.

Recipe numbers follow omihub777/ViT-CIFAR (github.com/omihub777/ViT-CIFAR, 90.92% test accuracy
from scratch with a 7-layer width-384 ViT): batch 128, 200 epochs, 5 warmup epochs, cosine decay,
peak learning rate 1e-3, label smoothing 0.1. That run also used AutoAugment, which attnjax does
not implement (crop+flip only here), and Adam with L2 5e-5; we use AdamW with DeiT's 0.05 decay.
Expect a GPU and ~1 hour; not verified here (no GPU in the build session).

    python train.py --config configs/vit_cifar10.py --workdir runs/cifar10
Needs CIFAR-10 prepared as array_record: ``pip install attnjax[tfds-prepare]`` then
``tfds build cifar10 --file_format=array_record``.
"""
import ml_collections

EPOCH = 50_000 // 128  # 390 steps


def get_config():
    config = ml_collections.ConfigDict()
    config.task = "classification"
    config.seed = 0

    config.data = ml_collections.ConfigDict()
    config.data.name = "cifar10"
    config.data.data_dir = ""
    config.data.train_split = "train"      # 50000
    config.data.eval_split = "test"        # 10000
    config.data.image_key = "image"
    config.data.label_key = "label"
    config.data.image_size = 0             # native 32x32
    config.data.crop_padding = 4           # standard CIFAR: pad 4, random 32x32 crop
    config.data.flip = True
    config.data.mean = (0.4914, 0.4822, 0.4465)
    config.data.std = (0.2470, 0.2435, 0.2616)

    config.model_name = "vit"
    config.model = ml_collections.ConfigDict()
    config.model.variant = "cifar"         # the seeds' model, see attnjax.vit
    config.model.num_classes = 10

    config.optimizer = "adamw"
    config.learning_rate = 1e-3
    config.warmup_steps = 5 * EPOCH
    config.min_lr_ratio = 0.01
    config.weight_decay = 0.05
    config.b1 = 0.9
    config.b2 = 0.999
    config.grad_clip_norm = 1.0
    config.grad_accum_steps = 1
    config.ema_decay = 0.0
    config.label_smoothing = 0.1

    config.batch_size = 128
    config.eval_batch_size = 500
    config.num_train_steps = 200 * EPOCH
    config.parallel = "jit"
    config.mesh = {"data": -1, "fsdp": 1}  # devices per axis; fsdp > 1 splits the parameters
    config.distributed = False

    config.log_every = 100
    config.eval_every = 5 * EPOCH
    config.checkpoint_every = 5 * EPOCH
    config.max_to_keep = 2
    config.best_metric = "eval/accuracy"
    config.best_mode = "max"
    return config
