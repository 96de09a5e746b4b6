"""Foreign weights <-> attnjax, one module per source; the only part of attnjax that imports torch,
and only inside functions (torch is a development extra).

- ``common``: safe loading of state dicts (``.pt``/``.pth`` with ``weights_only=True``,
  ``.safetensors``, in-memory), the per-layer converters and ``apply_key_table``; their inverses
  and ``export_with_key_table``, which reads a key table backwards.
- ``torch_nn``: ``torch.nn.MultiheadAttention`` and the ``nn.Transformer`` family
  (-> ``attnjax.models.transformer``), and their masks.
- ``timm``: timm's ``VisionTransformer`` <-> ``vit.ViT`` (``vit_to_timm``), and the reference
  PyTorch ViT layout -> ``vit.ViT``.
- ``google_npz``: Google ViT ``.npz`` checkpoints, read and written with numpy alone.
- ``vit_checkpoint``: a timm or Google ViT file -> the ``.npz`` ``config.init_from`` reads, its
  model config and preprocessing recorded (``python -m attnjax.convert.vit_checkpoint``).
- ``taming``: taming-transformers' ``VQModel``, ``NLayerDiscriminator`` and minGPT; ``VQModel`` and
  minGPT ``.safetensors`` exports.
- ``lpips``: torchvision VGG16 + ``lpips`` linear layers, with a command line that writes the
  converted file ``attnjax.models.lpips.load_variables`` reads.
- ``inception``: pytorch-fid's FID Inception v3, with a command line that writes the converted
  file ``attnjax.models.inception.load_variables`` reads.
- ``compare``: a layer-by-layer parity report against the PyTorch original
  (``python -m attnjax.convert.compare``).
"""
