"""ViT-22B (Dehghani et al. 2023, arXiv 2302.05442) classifying ImageNet-1k at 224x224.

    python -m attnjax.compile --config configs/vit_22b.py --target tpu:v5p:4x4x4
    JAX_PLATFORMS=cpu python -m attnjax.compile --config configs/vit_22b.py \\
        --target gpu:h100:64 --config.mesh.model=16 --config.batch_size=256

The paper's architecture at its pre-training resolution: width 6144, depth 48, 48 heads, MLP
24576, 14x14 patches, attention and MLP in parallel from one LayerNorm, LayerNorm on queries and
keys, no biases on q/k/v or in the LayerNorms. 21.757B parameters with this 1000-class head: the
paper's 21.743B are the blocks' weight matrices alone, 48 x (4 x 6144^2 + 2 x 6144 x 24576); the
rest is biases, LayerNorm scales, the patch embedding, the position table and the head
(tests/models/test_vit_22b.py counts both). Meant for compile-only fit checks: parameters and
AdamW's two moments alone are 261 GB in float32. The data and schedule are ImageNet-like, not the
paper's JFT-4B recipe.
"""

from configs import common


def get_config():
    data = common.image_data("imagenet2012", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    data.eval_split = "validation"  # 50000
    data.image_size = 224
    data.train_crop = "inception"  # the paper's pre-processing: inception crop and a flip
    data.flip = True
    config = common.classification(data)

    config.model.variant = "22B/14"  # width 6144, depth 48, 48 heads, MLP 24576
    config.model.num_classes = 1000
    config.model.image_size = 224
    # The variant's block, listed so that --config.model.<field> can take one change away.
    config.model.parallel_block = True
    config.model.qk_norm = True
    config.model.qkv_bias = False
    config.model.layer_norm_bias = False
    config.model.pool = "gap"  # the mean of the patch tokens; no class token
    config.model.class_token = False
    config.model.dropout_rate = 0.0
    config.model.scan_layers = True  # one block compiled instead of 48: compile time
    config.model.remat = True  # 48 layers of [batch, 256, 24576] activations otherwise
    config.compute_dtype = "bfloat16"  # bf16 matrix units; float32 parameters and optimiser

    # Megatron's layout over `model` (8 divides the 48 heads and the MLP's 24576 units); the
    # rest of the devices split the batch and every parameter (fsdp).
    config.mesh = {"data": 1, "fsdp": -1, "model": 8}

    config.optimizer = "adamw"
    config.learning_rate = 1e-3
    config.warmup_steps = 10_000
    config.weight_decay = 0.05
    config.label_smoothing = 0.1

    config.batch_size = 1024  # global, split over the fsdp devices
    config.eval_batch_size = 1024
    config.num_train_steps = 100_000
    config.eval_every = 5_000
    config.checkpoint_every = 1_000
    return config
