"""The PyTorch side of ``first_step.py``: one process doing what the reference code does before its
first training step (imports, model, data, optimiser, one step, eager), then printing
``first step done``. Its parent times it from the process's start.

    python benchmarks/first_step_torch.py {vit_digits,vqgan_digits,prior_digits,vit_b16} BATCH
"""

import sys

import numpy as np
import torch

from attnjax.convert.common import make_torchvision_importable


def digits(batch: int, channels_first=True) -> torch.Tensor:
    """A batch of the embedded digits at 16x16 in [-1, 1], as the attnjax tasks read them."""
    from sklearn.datasets import load_digits

    images = load_digits().images[:batch].astype(np.float32) / 16.0
    images = torch.from_numpy(images)[:, None]
    images = torch.nn.functional.interpolate(images, size=16, mode="bilinear")
    return images * 2 - 1 if channels_first else (images * 2 - 1).permute(0, 2, 3, 1)


def vit(name: str, batch: int):
    make_torchvision_importable()
    import timm

    if name == "vit_b16":
        model = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=1000)
        images = torch.randn(batch, 3, 224, 224)
        labels = torch.randint(0, 1000, (batch,))
    else:
        model = timm.models.VisionTransformer(
            img_size=16, patch_size=4, in_chans=1, num_classes=10, embed_dim=64, depth=4,
            num_heads=4, mlp_ratio=2.0, global_pool="token",
        )  # fmt: skip
        images, labels = digits(batch), torch.randint(0, 10, (batch,))
    return model, lambda: torch.nn.functional.cross_entropy(model(images), labels)


def vqgan(batch: int):
    from taming.modules.diffusionmodules.model import Decoder, Encoder
    from taming.modules.vqvae.quantize import VectorQuantizer

    config = dict(
        ch=32, ch_mult=(1, 1, 2), num_res_blocks=1, attn_resolutions=(), in_channels=1,
        out_ch=1, resolution=16, z_channels=32, double_z=False, dropout=0.0,
    )  # fmt: skip
    model = torch.nn.ModuleDict(
        dict(
            encoder=Encoder(**config),
            decoder=Decoder(**config),
            quantize=VectorQuantizer(128, 32, beta=0.25),
            quant_conv=torch.nn.Conv2d(32, 32, 1),
            post_quant_conv=torch.nn.Conv2d(32, 32, 1),
        )
    )
    images = digits(batch)

    def loss():
        z = model["quant_conv"](model["encoder"](images))
        quantized, codebook_loss, _ = model["quantize"](z)
        reconstructed = model["decoder"](model["post_quant_conv"](quantized))
        return (reconstructed - images).abs().mean() + codebook_loss

    return model, loss


def prior(batch: int):
    from taming.modules.transformer import mingpt

    # 128 codes + 10 class tokens, the class as a prefix of the 16 codes of a 4x4 grid.
    model = mingpt.GPT(138, 17, n_layer=4, n_head=4, n_embd=128, embd_pdrop=0.0, resid_pdrop=0.0,
                       attn_pdrop=0.0)  # fmt: skip
    tokens = torch.randint(0, 128, (batch, 17))

    def loss():
        logits, _ = model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 138), tokens[:, 1:].flatten())

    return model, loss


def main(name: str, batch: int) -> None:
    torch.manual_seed(0)
    build = {"vit_digits": vit, "vit_b16": vit, "vqgan_digits": vqgan, "prior_digits": prior}
    model, loss = build[name](name, batch) if name.startswith("vit") else build[name](batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.zero_grad()
    loss().backward()
    optimizer.step()
    print(
        f"first step done: torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
