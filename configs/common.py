"""Defaults the configs share: each ``configs/<run>.py`` starts from the block of its task here and
lists only what it changes. Field meanings: ``attnjax/train/loop.py`` (the loop),
``attnjax/tasks/__init__.py`` (the task protocol), ``attnjax/train/optim.py`` (the optimiser)
and each task module's docstring.
"""

import ml_collections
from ml_collections import config_dict


def training(task: str) -> ml_collections.ConfigDict:
    """The loop and optimiser fields every task reads, at their usual values."""
    config = ml_collections.ConfigDict()
    config.task = task
    config.seed = 0

    config.optimizer = "adamw"
    config.learning_rate = 1e-3
    config.warmup_steps = 0
    config.min_lr_ratio = 0.0
    config.weight_decay = 0.0
    config.b1 = 0.9
    config.b2 = 0.999
    config.grad_clip_norm = 0.0
    config.grad_accum_steps = 1  # >1: one update every k steps (bigger effective batch)

    config.batch_size = 64  # global, split over devices
    config.eval_batch_size = 0  # 0: batch_size
    config.num_train_steps = 1000
    config.parallel = "jit"  # or "pmap"
    # Devices per axis: fsdp > 1 splits the parameters, model > 1 the heads, MLP units and
    # vocabulary (tensor parallelism; attnjax/parallel/sharding.py).
    config.mesh = {"data": -1, "fsdp": 1, "model": 1}
    config.distributed = False  # True on multi-host clusters
    config.heartbeat_timeout_seconds = 300  # a process silent this long is declared dead
    # A run's workdir lock not renewed this long is taken over, whatever its host (a recreated
    # slice has new hostnames); renewed every quarter of it.
    config.lock_expiry_seconds = 120.0
    # No progress in a step, evaluation or save for longer than this ends the process (status
    # 124): max(floor, factor * the measured time), first_seconds while compiling.
    config.watchdog = {"floor_seconds": 120.0, "factor": 20.0, "first_seconds": 1800.0}
    config.cpu_devices = 0  # CPU only: devices (cores) the batch splits over; 0: one per core
    config.nonfinite = "stop"  # or "skip": drop a non-finite update and go on
    config.max_skipped_steps = 10  # with "skip": stop after this many in a row

    config.log_every = 100
    config.eval_every = 1000
    config.checkpoint_every = 1000
    config.max_to_keep = 2
    config.best_metric = ""  # "" or an eval metric, e.g. "eval/accuracy"
    config.best_mode = "max"
    config.profile_steps = ""  # "100:110": a jax.profiler trace of them in workdir/profile
    config.peak_flops = 0.0  # FLOP/s per device for train/mfu; 0: chip table or CPU measured
    return config


def image_data(name: str, *, mean, std) -> ml_collections.ConfigDict:
    """An image dataset (``attnjax.data``) at native size, no augmentation: a TFDS name, or image
    files (``folder:ROOT``, ``filelist:LISTS``, ``shards:DIR``: attnjax/data/folder.py)."""
    data = ml_collections.ConfigDict()
    data.name = name
    data.data_dir = ""  # "" -> $TFDS_DATA_DIR or ~/tensorflow_datasets
    data.train_split = "train"
    data.eval_split = "test"
    data.image_key = "image"
    data.label_key = "label"
    data.image_size = 0  # 0: native size
    data.channels = len(mean)  # image files are converted to this many (1: gray, 3: RGB)
    # How an image becomes image_size x image_size (attnjax/data/preprocess.py): "resize" (the
    # whole image), "random", "center" (the shorter side resized, a square cut), "inception".
    data.train_crop = "resize"
    data.eval_crop = "resize"
    data.crop_fraction = 1.0  # random/center: the square is this share of the shorter side
    data.inception_area = (0.05, 1.0)  # share of the image an inception crop covers
    data.upscale = True  # False: a file smaller than the crops need is an error, not enlarged
    data.crop_padding = 0  # random shifts of up to this many pixels
    data.flip = False  # random left-right flips
    # A folder without split folders: this share of its files (by a hash of each file's path and
    # the seed, so adding files never moves others) is the eval split.
    data.holdout_fraction = 0.1
    data.holdout_seed = 0
    data.skip_unreadable = False  # True: leave out (and count) files that do not decode
    data.class_names = ()  # label i's name; image files: their class folders, filled in
    # grain's threads and worker processes that read, decode and crop (attnjax.data.make_iterator)
    data.read_threads = 0
    data.worker_count = 0
    data.mean = tuple(mean)
    data.std = tuple(std)
    return data


def fid() -> ml_collections.ConfigDict:
    """The FID a generative task reports at the end of training (attnjax/tasks/image_metrics.py):
    off until a feature network is named."""
    return ml_collections.ConfigDict(
        dict(
            inception="",  # converted Inception .npz (python -m attnjax.convert.inception)
            classifier="",  # or a classification workdir: its pre-logits, a domain FID
            num_images=1000,  # N per side: FID depends on it, reported next to it (eval/*_n)
            dims=2048,  # Inception features: 64, 192, 768 or 2048
            batch_size=50,
        )
    )


def classification(data: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A ViT classifier trained with AdamW (DeiT's decay 0.05), clipping and label smoothing."""
    config = training("classification")
    config.data = data
    config.init_from = ""  # optional .npz of pretrained params
    config.model_name = "vit"
    config.model = ml_collections.ConfigDict()  # attnjax.models.vit.create_vit fields (+ variant)
    # Recompute each block's activations in the backward pass: memory for compute (the compile
    # command's refusal names it, so `--config.model.remat=True` must find the field).
    config.model.remat = False
    config.weight_decay = 0.05
    config.grad_clip_norm = 1.0
    config.label_smoothing = 0.1
    config.ema_decay = 0.0  # >0: evaluate an EMA of the parameters
    config.compute_dtype = "float32"  # or "bfloat16" activations; parameters stay float32
    config.best_metric = "eval/accuracy"
    return config


def vqgan(data: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A VQGAN with taming's objective and optimiser (Adam, betas (0.5, 0.9), no decay)."""
    config = training("vqgan")
    config.data = data
    config.model = ml_collections.ConfigDict()
    config.model.beta = 0.25
    config.model.remat = False  # recompute the encoder's and decoder's blocks: memory for compute
    config.model.quantizer = ml_collections.ConfigDict(
        dict(
            kind="vq",  # or "fsq", "lfq", "simvq" (attnjax/models/quantizers.py)
            rotation_trick=False,  # vq, simvq: rotate onto the code instead of copying
            legacy=False,
            l2_normalize=False,
            lookup_dim=0,
            ema_decay=0.0,
            usage_decay=0.0,
            fsq_levels=(),  # fsq: () -> quantizers.FSQ_LEVELS[n_embed]
            lfq_entropy_weight=0.1,  # lfq: MAGVIT-v2's entropy weight
            lfq_diversity=1.0,  # lfq: weight of the batch entropy inside the penalty
            lfq_temperature=0.01,  # lfq: of the code distribution the entropies are taken of
            lfq_commitment_weight=0.25,
        )
    )  # lfq: its commitment weight (MAGVIT-v2's), not model.beta
    config.reseed_threshold = 0.0  # >0: re-seed codes used below this share of uniform
    config.loss = ml_collections.ConfigDict(
        dict(
            disc_start=0,
            disc_weight=0.0,  # disc_weight 0: no discriminator
            disc_factor=1.0,
            disc_loss="hinge",
            codebook_weight=1.0,
            # None: taming's 1.0 when config.lpips.weights is given, else 0; 0 with weights:
            # eval/lpips without the perceptual term
            perceptual_weight=config_dict.placeholder(float),
        )
    )
    config.discriminator = ml_collections.ConfigDict(dict(ndf=64, n_layers=3, norm="batch"))
    config.lpips = ml_collections.ConfigDict(dict(weights=""))  # converted LPIPS .npz; "": off
    config.fid = fid()  # eval/rfid: reconstructions of N eval images against them
    config.disc_learning_rate = config.learning_rate
    config.b1 = 0.5
    config.b2 = 0.9
    # or "bfloat16": encoder, decoder and discriminator activations; parameters, the quantizer,
    # the last decoder layer, the losses and LPIPS stay float32
    config.compute_dtype = "float32"
    config.best_metric = "eval/psnr"
    return config


def prior(vqgan_workdir: str) -> ml_collections.ConfigDict:
    """A class-conditional GPT over a trained VQGAN's codes, minGPT's optimiser settings."""
    config = training("prior")
    config.vqgan_workdir = vqgan_workdir  # a trained `vqgan` run; its data settings are used
    config.vqgan_step = None  # None: its latest checkpoint
    config.codes_cache_dir = ""  # "" -> <vqgan_workdir>/codes
    # The VQGAN's codebook size and token grid, read only where vqgan_workdir holds no
    # checkpoints: python -m attnjax.compile sizes a prior before its VQGAN is trained.
    config.vqgan_codes = ml_collections.ConfigDict(dict(n_embed=0, grid=(0, 0)))
    config.num_classes = 10  # 0: unconditional
    config.class_dropout = 0.1  # hide the class of 10% of the sequences: also an
    # unconditional model, for classifier-free guidance
    config.data = ml_collections.ConfigDict(dict(train_shifts=0))
    config.model_name = "gpt"
    # + n_layer, n_head, n_embd; remat recomputes each block in the backward pass;
    # vocab_multiple pads the vocabulary to a multiple a `model` mesh axis divides
    config.model = ml_collections.ConfigDict(
        dict(embd_pdrop=0.1, resid_pdrop=0.1, attn_pdrop=0.1, remat=False, vocab_multiple=1)
    )
    config.sampling = ml_collections.ConfigDict(
        dict(
            temperature=1.0,
            top_k=None,
            top_p=None,
            guidance=1.5,  # u + 1.5 (c - u): samples that look more like their class
            per_class=8,
            png_scale=1,
        )
    )
    config.fid = fid()  # eval/fid: N samples against the VQGAN's eval split
    config.weight_decay = 0.01  # minGPT / Net2NetTransformer
    config.b2 = 0.95
    config.ema_decay = 0.0  # >0: evaluate an EMA of the parameters
    config.compute_dtype = "float32"  # or "bfloat16" activations; parameters stay float32
    config.grad_clip_norm = 1.0
    config.best_mode = "min"
    return config
