"""A class-conditional GPT prior at LlamaGen's GPT-3B sizes over ImageNet's 16x16 code grids.

    JAX_PLATFORMS=cpu python -m attnjax.compile --config configs/prior_3b.py --target gpu:h100:8
    python -m attnjax.compile --config configs/prior_3b.py --target tpu:v5p:2x2x4

LlamaGen (Sun et al. 2024, arXiv 2406.06525): 24 layers of width 3200 with 32 heads, over the
256 codes (16x16, f=16 on 256x256 images) of a 16384-entry codebook, one class token of 1000.
The blocks are minGPT's (LayerNorm, GELU MLP of 4 x 3200, learned positions), not LlamaGen's
Llama blocks (RMSNorm, SwiGLU, RoPE): 3.062B parameters against LlamaGen's 3.1B
(tests/models/test_prior_3b.py counts them). Optimiser, dropout and batch are LlamaGen's
class-conditional recipe (AdamW 1e-4, betas (0.9, 0.95), decay 0.05, clipping 1, dropout 0.1,
batch 256, 300 epochs). Meant for compile-only fit checks: no VQGAN of these sizes is trained
here, so ``vqgan_codes`` sizes the prior; parameters and AdamW's moments are 37 GB in float32.
"""

from configs import common


def get_config():
    config = common.prior("runs/vqgan_imagenet_16384")  # a VQGAN of LlamaGen's tokenizer sizes
    config.vqgan_codes.n_embed = 16384
    config.vqgan_codes.grid = (16, 16)
    config.num_classes = 1000
    config.class_dropout = 0.1  # LlamaGen's: the null class of classifier-free guidance

    config.model.n_layer = 24
    config.model.n_head = 32
    config.model.n_embd = 3200
    config.model.embd_pdrop = 0.1  # LlamaGen's token, residual and FFN dropout; none on attention
    config.model.resid_pdrop = 0.1
    config.model.attn_pdrop = 0.0
    # 16384 codes + 1000 classes + the null class = 17385 tokens, which no model axis divides:
    # padded to 17408 (Megatron's multiple of 128), split evenly over model = 1 to 128.
    config.model.vocab_multiple = 128
    # Recompute each block in the backward pass: with fsdp over every chip, XLA otherwise keeps
    # all 24 layers' gathered weights for the backward (18.8 GiB of temporaries at one example
    # per v5e chip; benchmarks/results/fit_tables.md).
    config.model.remat = True
    config.compute_dtype = "bfloat16"  # bf16 matrix units; float32 parameters and optimiser

    # Megatron's layout over `model` (8 divides the 32 heads, the MLP's 12800 units and the
    # 17408 padded tokens); the rest of the devices split the batch and every parameter (fsdp).
    config.mesh = {"data": 1, "fsdp": -1, "model": 8}

    config.learning_rate = 1e-4
    config.weight_decay = 0.05
    config.b1 = 0.9
    config.b2 = 0.95
    config.grad_clip_norm = 1.0

    config.sampling.per_class = 1  # samples/<step>.png: one image for each of the 1000 classes
    config.batch_size = 256
    config.eval_batch_size = 256
    config.num_train_steps = 1_500_000  # 300 epochs of ImageNet's 1.28M images
    config.eval_every = 50_000
    config.checkpoint_every = 5_000
    config.max_to_keep = 3
    config.best_metric = "eval/nll"
    return config
