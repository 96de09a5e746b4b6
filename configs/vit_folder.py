"""A ViT-S/16 classifier from scratch on your own images, one class folder per class.

    python train.py --config configs/vit_folder.py --workdir runs/vit_folder \
        --config.data.name=folder:/path/to/images

The folder is ``ROOT/<split>/<class>/*`` or ``ROOT/<class>/*`` (10% held out): docs/own_images.md.
The class count comes from the class folders. Augmentation is big_vision's from-scratch ViT's:
an Inception crop (5-100% of the image) and a flip; evaluation resizes the shorter side to
image_size / 0.875 and takes the central square. Small images: lower ``--config.data.image_size``
(a multiple of ``--config.model.patch_size``).
"""

from configs import common


def get_config():
    data = common.image_data("folder:", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))  # [-1, 1]
    data.image_size = 224
    data.train_crop = "inception"
    data.eval_crop = "center"
    data.crop_fraction = 0.875  # evaluation: 224 of 256
    data.flip = True
    data.read_threads = 4  # decoding and cropping in grain's threads, not the training thread
    config = common.classification(data)

    config.model.num_classes = 0  # 0: one per class folder (written into config.json)
    config.model.image_size = data.get_ref("image_size")
    config.model.in_channels = data.get_ref("channels")
    config.model.patch_size = 16
    config.model.width = 384  # S/16
    config.model.depth = 12
    config.model.num_heads = 6
    config.model.mlp_dim = 1536
    config.model.dropout_rate = 0.0

    config.learning_rate = 1e-3
    config.warmup_steps = 1000
    config.batch_size = 128
    config.eval_batch_size = 128
    config.num_train_steps = 30_000
    config.log_every = 100
    config.eval_every = 2000
    config.checkpoint_every = 1000
    return config
