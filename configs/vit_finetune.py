"""A pretrained ViT (timm or Google weights) fine-tuned on your own images, or used as it is.

    python -m attnjax.convert.vit_checkpoint vit_base_patch16_224.pth vit.npz
    python train.py --config configs/vit_finetune.py:vit.npz --workdir runs/finetune \
        --config.data.name=folder:/path/to/images

The converted file (attnjax/convert/vit_checkpoint.py) gives the architecture, the image size and
the mean and std its training normalised with, and is ``init_from``. The head is the checkpoint's
when the folder has its class count (``init_head``, timm's rule), else a fresh one; the class
count comes from the class folders. ``--config.num_train_steps=0`` trains nothing: the run then
holds the pretrained model itself (``python -m attnjax.inference.predict``). Without a file
(``configs/vit_finetune.py``) the model is ``--config.model.variant`` (B/16) and
``--config.init_from`` any file that ``load_pretrained`` reads.

Recipe: the ViT paper's transfer setup (Dosovitskiy et al. 2021, appendix B.1.1; big_vision's
transfer configs): SGD with momentum 0.9, no weight decay, global-norm clipping at 1, cosine decay
after a short warmup, no label smoothing; the paper's rates are {0.003, 0.01, 0.03, 0.06} at
batch 512, 0.01 here for batch 64. ``layer_decay`` (off here) scales the rate of the embeddings
by ``layer_decay ** (L + 1)`` and of block ``k`` (from 0, of ``L``) by ``layer_decay ** (L - k)``,
the final ``norm``'s as the last block's, and leaves the head's. Training crops are Inception crops
with flips; evaluation resizes the shorter side to image_size / 0.875 and takes the central square.
"""

import os

from attnjax.convert import vit_checkpoint
from configs import common


def get_config(pretrained: str = ""):
    meta = vit_checkpoint.read_metadata(pretrained) if pretrained else None
    preprocessing = meta["data"] if meta else dict(image_size=224, mean=(0.5,) * 3, std=(0.5,) * 3)
    data = common.image_data(
        "folder:", mean=tuple(preprocessing["mean"]), std=tuple(preprocessing["std"])
    )
    data.image_size = preprocessing["image_size"]
    data.train_crop = "inception"
    data.eval_crop = "center"
    data.crop_fraction = 0.875
    data.flip = True
    data.read_threads = 4  # decoding and cropping in grain's threads, not the training thread
    config = common.classification(data)

    config.init_from = os.path.abspath(pretrained) if pretrained else ""
    config.init_head = True  # the checkpoint's head where the class count is the same
    if meta:
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["model"].items()}
        config.model.update({k: v for k, v in fields.items() if k != "image_size"})
        config.model.variant = ""
    else:
        config.model.variant = "B/16"
    config.model.num_classes = 0  # 0: one per class folder (written into config.json)
    config.model.image_size = data.get_ref("image_size")
    config.model.in_channels = data.get_ref("channels")
    config.model.dropout_rate = 0.0
    config.model.drop_path_rate = 0.0

    config.optimizer = "sgd"
    config.momentum = 0.9
    config.nesterov = False
    config.learning_rate = 0.01
    config.warmup_steps = 100
    config.weight_decay = 0.0
    config.label_smoothing = 0.0
    config.grad_clip_norm = 1.0
    config.layer_decay = 0.0  # off; BEiT and MAE fine-tunes use 0.65-0.75 (attnjax.train.optim)

    config.batch_size = 64
    config.eval_batch_size = 64
    config.num_train_steps = 2_000
    config.log_every = 50
    config.eval_every = 500
    config.checkpoint_every = 500
    return config
