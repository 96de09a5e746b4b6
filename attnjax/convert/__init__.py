"""Foreign weights -> attnjax, one module per source; the only part of attnjax that imports torch,
and only inside functions (torch is a development extra).

- ``common``: safe loading of state dicts (``.pt``/``.pth`` with ``weights_only=True``,
  ``.safetensors``, in-memory), the per-layer converters and ``apply_key_table``.
- ``torch_nn``: ``torch.nn.MultiheadAttention`` and its masks.
- ``timm``: timm's ``VisionTransformer`` and the reference PyTorch ViT layout -> ``vit.ViT``.
- ``google_npz``: Google ViT ``.npz`` checkpoints, read and written with numpy alone.
- ``taming``: taming-transformers' ``VQModel``, ``NLayerDiscriminator`` and minGPT.
- ``lpips``: torchvision VGG16 + ``lpips`` linear layers, with a command line that writes the
  converted file ``attnjax.lpips.load_variables`` reads.
"""
