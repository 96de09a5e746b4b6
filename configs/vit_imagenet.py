"""Fine-tune a pre-trained ViT-B/16 on ImageNet-1k at 384x384. ``init_from``: a Google ViT .npz
(e.g. the ImageNet-21k ``augreg`` checkpoints, read with ``attnjax.torch_interop.load_google_npz``)
or a flat .npz of attnjax params (e.g. a timm model converted with ``attnjax.torch_interop``).

Recipe: the ViT paper's fine-tuning setup (Dosovitskiy et al. 2021, appendix B.1.1): SGD with
momentum 0.9, no weight decay, global-norm clipping at 1, batch 512, cosine decay with a short
warmup, 20k steps, learning rate from {0.003, 0.01, 0.03, 0.06} (0.03 here), higher resolution
(384) than pre-training with the position table resized (bicubic) to the 24x24 grid.

    python train.py --config configs/vit_imagenet.py --workdir runs/imagenet \
        --config.init_from=/path/to/vit_b16_in21k.npz
ImageNet-2012 must be prepared as array_record (manual download; needs TensorFlow).
"""
import ml_collections


def get_config():
    config = ml_collections.ConfigDict()
    config.task = "classification"
    config.seed = 0
    config.init_from = ""                  # set on the command line: .npz of converted params

    config.data = ml_collections.ConfigDict()
    config.data.name = "imagenet2012"
    config.data.data_dir = ""
    config.data.train_split = "train"
    config.data.eval_split = "validation"  # 50000
    config.data.image_key = "image"
    config.data.label_key = "label"
    config.data.image_size = 384           # square resize; pre-training was 224
    config.data.crop_padding = 0
    config.data.flip = True
    config.data.mean = (0.5, 0.5, 0.5)     # the augreg checkpoints' normalisation to [-1, 1]
    config.data.std = (0.5, 0.5, 0.5)

    config.model_name = "vit"
    config.model = ml_collections.ConfigDict()
    config.model.variant = "B/16"
    config.model.num_classes = 1000        # a fresh head; everything else comes from init_from
    config.model.image_size = 384
    config.model.dropout_rate = 0.0

    config.optimizer = "sgd"
    config.momentum = 0.9
    config.nesterov = False
    config.learning_rate = 0.03
    config.warmup_steps = 500
    config.min_lr_ratio = 0.0
    config.weight_decay = 0.0
    config.grad_clip_norm = 1.0
    config.grad_accum_steps = 1            # raise to fit batch 512 on fewer/smaller devices
    config.ema_decay = 0.0
    config.label_smoothing = 0.0

    config.batch_size = 512
    config.eval_batch_size = 500
    config.num_train_steps = 20_000
    config.parallel = "jit"
    config.mesh = {"data": -1, "fsdp": 1}  # devices per axis; fsdp > 1 splits the parameters
    config.distributed = False             # True on multi-host clusters

    config.log_every = 100
    config.eval_every = 2_000
    config.checkpoint_every = 1_000
    config.max_to_keep = 2
    config.best_metric = "eval/accuracy"
    config.best_mode = "max"
    return config
