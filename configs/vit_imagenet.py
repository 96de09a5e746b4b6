"""Fine-tune a pre-trained ViT-B/16 on ImageNet-1k at 384x384.

    python train.py --config configs/vit_imagenet.py --workdir runs/imagenet \
        --config.init_from=/path/to/vit_b16_in21k.npz
ImageNet-2012 must be prepared as array_record (manual download; needs TensorFlow).

``init_from``: a Google ViT .npz (e.g. the ImageNet-21k ``augreg`` checkpoints), a flat .npz of
attnjax params (a timm file converted by ``python -m attnjax.convert.vit_checkpoint``), or the
timm ``.pth``/``.safetensors`` itself. Recipe: the ViT paper's fine-tuning setup (Dosovitskiy et
al. 2021, appendix B.1.1): SGD with momentum 0.9, no weight decay, global-norm clipping at 1,
batch 512, cosine decay with a short warmup, 20k steps, learning rate from {0.003, 0.01, 0.03,
0.06} (0.03 here), higher resolution (384) than pre-training with the position table resized
(bicubic) to the 24x24 grid.
"""

from configs import common


def get_config():
    data = common.image_data(
        "imagenet2012", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)
    )  # augreg's [-1, 1]
    data.eval_split = "validation"  # 50000
    data.image_size = 384  # square resize; pre-training was 224
    data.flip = True
    config = common.classification(data)

    config.model.variant = "B/16"
    config.model.num_classes = 1000  # a fresh head; everything else comes from init_from
    config.model.image_size = 384
    config.model.dropout_rate = 0.0

    config.optimizer = "sgd"
    config.momentum = 0.9
    config.nesterov = False
    config.learning_rate = 0.03
    config.warmup_steps = 500
    config.weight_decay = 0.0
    config.grad_accum_steps = 1  # raise to fit batch 512 on fewer/smaller devices
    config.label_smoothing = 0.0
    config.compute_dtype = "bfloat16"  # accelerators: bf16 matrix units; float32 parameters

    config.batch_size = 512
    config.eval_batch_size = 512  # splits over 8, 16, ... devices (500 does not)
    config.num_train_steps = 20_000
    config.eval_every = 2_000
    config.checkpoint_every = 1_000
    return config
