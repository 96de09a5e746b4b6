"""Class-conditional transformer prior over the digits VQGAN's codes (``demo.py``'s third stage).

    python train.py --config configs/vqgan_digits.py --workdir runs/vqgan_digits
    python train.py --config configs/prior_digits.py --workdir runs/prior_digits

The VQGAN turns a 16x16 digit into a 4x4 grid of codes; this GPT learns p(codes | class) over
those 16 tokens in raster order, the class as a prefix token: 4 layers of width 128, 600 steps
of 64 without dropout; samples at temperature 0.8, top-k 16, guidance 1.5. How the recipe and the
sampling settings were chosen: benchmarks/results/digits_recipes.md.
"""

from configs import common


def get_config():
    config = common.prior("runs/vqgan_digits")
    config.data.train_shifts = 1  # also encode +-1 pixel shifts: 9 code sequences per image

    config.model.n_layer = 4
    config.model.n_head = 4
    config.model.n_embd = 128
    # No dropout: over 600 steps (~3 epochs of the shifted codes) it only slows the fit down
    # (benchmarks/results/digits_recipes.md).
    config.model.embd_pdrop = config.model.resid_pdrop = config.model.attn_pdrop = 0.0

    config.sampling.temperature = 0.8  # below 1: fewer off-class strokes in the samples
    config.sampling.top_k = 16
    config.sampling.per_class = 10  # samples per class in samples/<step>.png
    config.sampling.png_scale = 4  # 16x16 digits are tiny on screen

    config.learning_rate = 1e-3
    config.warmup_steps = 100
    config.batch_size = 64
    config.eval_batch_size = 120  # 360 test digits = 3 batches
    config.num_train_steps = 600
    config.log_every = 50
    config.eval_every = 600  # samples cost a compilation: only at the end
    config.checkpoint_every = 300
    return config
