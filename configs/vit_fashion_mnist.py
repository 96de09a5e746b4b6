"""The MNIST ViT (``vit_mnist.py``) on Fashion-MNIST (28x28 grayscale clothing, 60000/10000).

python train.py --config configs/vit_fashion_mnist.py --workdir runs/fashion_mnist
"""

from configs import vit_mnist

EPOCH = vit_mnist.EPOCH


def get_config():
    config = vit_mnist.get_config()
    config.data.name = "fashion_mnist"
    config.data.mean = (0.2860,)
    config.data.std = (0.3530,)
    config.data.flip = True  # a mirrored shirt is still a shirt
    config.num_train_steps = 30 * EPOCH  # a harder task than digits
    config.eval_every = 2 * EPOCH
    config.checkpoint_every = 2 * EPOCH
    return config
