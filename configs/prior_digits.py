"""Class-conditional transformer prior over the codes of the digits VQGAN (`make demo`'s third stage).

    python train.py --config configs/vqgan_digits.py --workdir runs/vqgan_digits
    python train.py --config configs/prior_digits.py --workdir runs/prior_digits

The VQGAN turns a 16x16 digit into a 4x4 grid of codes; this GPT learns p(codes | class) over
those 16 tokens in raster order, the class as a prefix token.
"""
import ml_collections


def get_config():
    config = ml_collections.ConfigDict()
    config.task = "prior"
    config.seed = 0

    config.vqgan_workdir = "runs/vqgan_digits"  # a trained `vqgan` run; its data settings are used
    config.vqgan_step = None              # None: its latest checkpoint
    config.codes_cache_dir = ""           # "" -> <vqgan_workdir>/codes
    config.num_classes = 10               # class-conditional; 0 would make it unconditional
    config.class_dropout = 0.1            # hide the class of 10% of the sequences: also an
                                          # unconditional model, for classifier-free guidance

    config.data = ml_collections.ConfigDict()
    config.data.train_shifts = 1          # also encode +-1 pixel shifts: 9 code sequences per image

    config.model_name = "gpt"
    config.model = ml_collections.ConfigDict()
    config.model.n_layer = 4
    config.model.n_head = 4
    config.model.n_embd = 128
    config.model.embd_pdrop = 0.1
    config.model.resid_pdrop = 0.1
    config.model.attn_pdrop = 0.1

    config.sampling = ml_collections.ConfigDict()
    config.sampling.temperature = 0.8     # below 1: fewer off-class strokes in the samples
    config.sampling.top_k = 16
    config.sampling.top_p = None
    config.sampling.guidance = 1.5        # u + 1.5 (c - u): samples that look more like their class
    config.sampling.per_class = 10        # samples per class in samples/<step>.png
    config.sampling.png_scale = 4         # 16x16 digits are tiny on screen

    config.optimizer = "adamw"
    config.learning_rate = 1e-3
    config.warmup_steps = 100
    config.min_lr_ratio = 0.0
    config.weight_decay = 0.01            # minGPT's value for Net2NetTransformer
    config.b1 = 0.9
    config.b2 = 0.95                      # minGPT's betas
    config.grad_clip_norm = 1.0
    config.grad_accum_steps = 1
    config.ema_decay = 0.0

    config.batch_size = 64
    config.eval_batch_size = 120          # 360 test digits = 3 batches
    config.num_train_steps = 1000
    config.parallel = "jit"
    config.mesh = {"data": -1, "fsdp": 1}  # devices per axis; fsdp > 1 splits the parameters
    config.distributed = False

    config.log_every = 50
    config.eval_every = 1000              # samples cost a compilation: only at the end
    config.checkpoint_every = 500
    config.max_to_keep = 2
    config.best_metric = ""
    config.best_mode = "min"
    return config
