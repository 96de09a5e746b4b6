"""Layer 1, Linen modules built on ``attnjax.ops``: multi-head attention, the torch Transformer
family, the ViT, the VQGAN with its quantizers and discriminator, LPIPS, the GPT prior and its
sampler. Parameter names follow timm, taming-transformers and minGPT."""
