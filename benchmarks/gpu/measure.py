"""The measurements behind benchmarks/gpu/check.py, one function per part: ``PARTS[name](dry_run,
emit) -> dict``. ``emit(partial)`` hands over what a part has measured so far, so that a part
stopped at its time limit still reports it.

Every number comes from the library's own code: the configs, the tasks' models, train states and
train steps, the training loop's placement and jitted steps (``attnjax.train.loop``), its FLOP
count and MFU (``attnjax.train.performance.Utilization``), the compile command's programs and
report (``attnjax.compile``), the prior's sampler and attention's forced implementations.
``dry_run`` runs the same code at tiny sizes on the CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_seconds

import configs
from attnjax import tasks
from attnjax.compile import programs, report, targets
from attnjax.ops import attention
from attnjax.tasks import prior as prior_task
from attnjax.tasks import vqgan as vqgan_task
from attnjax.models import lpips
from attnjax.train import accelerators, compilation_cache, loop, performance

# ViT-B/16 at 224 px: the resolution of the published H100 rate docs/accelerators.md compares its
# prediction with, and one whose train step has no loop of unknown length, so the compile command
# predicts it from the train step itself. The dry run keeps the config and shrinks the model.
VIT = {
    "gpu": dict(steps=30, warmup=3, overrides={"batch_size": 256, "eval_batch_size": 256,
                "data.image_size": 224, "model.image_size": 224}),
    "dry-run": dict(steps=3, warmup=1, overrides={"batch_size": 4, "eval_batch_size": 4,
                    "data.image_size": 32, "model.image_size": 32, "model.patch_size": 8,
                    "model.width": 32, "model.depth": 1, "model.mlp_dim": 64,
                    "model.num_heads": 2}),
}  # fmt: skip
# The f16 VQGAN as configured: autoencoder, PatchGAN discriminator and LPIPS (random weights);
# ``batches`` synthetic batches in turn, so that the loss curves of bf16 and float32 (same seeds,
# same batches) say something. measure_torch.VQGAN is the same work in PyTorch.
VQGAN = {
    "gpu": dict(steps=30, warmup=2, batches=4, overrides={"batch_size": 16,
                "eval_batch_size": 16}),
    "dry-run": dict(steps=4, warmup=1, batches=2, overrides={"batch_size": 2, "eval_batch_size": 2,
                    "data.image_size": 16, "model.ddconfig.resolution": 16,
                    "model.ddconfig.ch": 32, "model.ddconfig.ch_mult": (1,),
                    "model.ddconfig.num_res_blocks": 0, "model.ddconfig.z_channels": 8,
                    "model.n_embed": 16, "model.embed_dim": 8, "discriminator.ndf": 8,
                    "discriminator.n_layers": 1}),
}  # fmt: skip
# prior_cifar10.py's GPT (12 layers of 512) over the f16 VQGAN's codes (its codebook, a 16 x 16
# grid), sampled with the config's settings (top-k 100, guidance 1.5: twice the rows).
PRIOR = {
    "gpu": dict(batch=32, calls=3, overrides={}),
    "dry-run": dict(batch=2, calls=2, overrides={"model.n_layer": 1, "model.n_head": 2,
                    "model.n_embd": 32, "sampling.top_k": 8}),
}  # fmt: skip
# (name, batch, tokens, heads, head_dim): benchmarks/attention_kernels.py's long shapes.
ATTENTION = {
    "gpu": dict(repeats=5, loop=20, shapes=[("1k", 4, 1024, 8, 128), ("4k", 1, 4096, 8, 128),
                                    ("16k", 1, 16384, 8, 128)]),
    "dry-run": dict(repeats=2, loop=2, shapes=[("64", 2, 64, 2, 32), ("128", 1, 128, 2, 32)]),
}  # fmt: skip
# Two bf16 attention kernels differ by a few bf16 roundings of outputs of size ~1.
AGREEMENT_ATOL = 3e-2
PROBE_ROWS, PROBE_DIMS = 3, 8


def _mode(dry_run: bool) -> str:
    return "dry-run" if dry_run else "gpu"


def device_info(dry_run: bool) -> dict:
    """The device the parts run on; on a GPU machine, an error if JAX found no GPU."""
    device = jax.devices()[0]
    if not dry_run and device.platform != "gpu":
        raise RuntimeError(f"no GPU: JAX's first device is {device.platform} ({device})")
    stats = device.memory_stats() or {}
    return {
        "kind": device.device_kind,
        "platform": device.platform,
        "count": jax.device_count(),
        "memory_bytes": stats.get("bytes_limit"),
    }


def _config(name: str, overrides: dict):
    config = configs.load(name)
    config.update_from_flattened_dict(overrides)
    return config


# ---------------------------------------------------------------------------------------------
# Training steps: ViT-B/16 and the f16 VQGAN
# ---------------------------------------------------------------------------------------------


def _synthetic_batch(abstract: dict, high: dict, seed: int = 0) -> dict:
    """Random host arrays of ``abstract``'s shapes: floats in [-1, 1], integers in
    ``[0, high[key])``."""
    rng = np.random.default_rng(seed)
    batch = {}
    for key, spec in abstract.items():
        if jnp.issubdtype(spec.dtype, jnp.integer):
            batch[key] = rng.integers(0, high[key], spec.shape).astype(spec.dtype)
        else:
            batch[key] = rng.uniform(-1, 1, spec.shape).astype(spec.dtype)
    return batch


def _stages_since(before: dict, counts: dict) -> dict:
    """Seconds of tracing, lowering and compiling since ``before``, and the programs the
    persistent cache answered (hits) or had to compile (misses) since ``counts``."""
    now, hits = compilation_cache.stage_seconds(), compilation_cache.counts()
    result = {stage: now[stage] - before[stage] for stage in now}
    result.update(cache_hits=hits["hits"] - counts["hits"],
                  cache_misses=hits["misses"] - counts["misses"])  # fmt: skip
    return result


def _snapshot() -> tuple[dict, dict]:
    return compilation_cache.stage_seconds(), compilation_cache.counts()


def time_training(config, steps: int, warmup: int, high: dict, batches: int = 1) -> dict:
    """``steps`` train steps of ``config``'s task on one device after ``warmup`` (the first
    compiles), cycling over ``batches`` synthetic batches, placed and jitted as the training loop
    does; MFU as the loop logs it (``train/mfu``); every step's loss, read after the clock
    stopped; the initialisation's and the first step's seconds split into JAX's tracing,
    lowering and compiling (a persistent-cache hit counts as compiling) and the rest (running,
    transfers)."""
    task = tasks.get_task(config.task)
    model = task.create_model(config)
    devices = jax.devices()[:1]
    dp = loop.make_data_parallel(config, task, devices=devices)
    abstract = task.abstract_batch(config, config.batch_size)
    host_batches = [_synthetic_batch(abstract, high, seed) for seed in range(batches)]
    before = _snapshot()
    start = time.perf_counter()
    state = loop.initial_state(
        task, config, model, host_batches[0], jax.random.PRNGKey(config.seed)
    )
    state = jax.block_until_ready(dp.place_state(state))
    init_seconds = time.perf_counter() - start
    init = {"seconds": init_seconds, **_stages_since(*before)}
    train_step, _ = loop.compile_steps(config, task, model, dp, state)
    device_batches = [dp.shard_batch(batch) for batch in host_batches]
    keys = list(jax.random.split(jax.random.PRNGKey(1), warmup + steps))
    before = _snapshot()
    start = time.perf_counter()
    state, metrics = train_step(state, device_batches[0], keys[0])
    losses = [float(metrics["loss"])]
    first_step_seconds = time.perf_counter() - start
    first = {"seconds": first_step_seconds, **_stages_since(*before)}
    first["running"] = first_step_seconds - sum(first[k] for k in compilation_cache.STAGES.values())
    for index in range(1, warmup):
        state, metrics = train_step(state, device_batches[index % batches], keys[index])
        losses.append(metrics["loss"])
    jax.block_until_ready(state)
    utilization = performance.Utilization(devices, config)
    utilization.count(train_step, state, device_batches[0], keys[0])
    start = time.perf_counter()
    for index in range(warmup, warmup + steps):
        state, metrics = train_step(state, device_batches[index % batches], keys[index])
        losses.append(metrics["loss"])
    jax.block_until_ready((state, metrics))
    seconds = time.perf_counter() - start
    losses = [float(loss) for loss in losses]
    if not all(np.isfinite(losses)):
        raise FloatingPointError(f"non-finite losses in {warmup + steps} steps: {losses}")
    scalars = utilization.scalars(steps / seconds)
    return {
        "batch_size": int(config.batch_size),
        "batches": batches,
        "steps": steps,
        "warmup_steps": warmup,
        "seconds": seconds,
        "images_per_second": steps * config.batch_size / seconds,
        "flops_per_step": utilization.flops_per_step,
        "peak_flops": utilization.peak,
        "peak_source": utilization.source,
        "mfu": scalars.get("train/mfu"),
        "tflops_per_device": scalars.get("train/tflops_per_device"),
        "init_seconds": init_seconds,
        "first_step_seconds": first_step_seconds,
        "init": init,
        "first_step": first,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "losses": losses,
    }


def compile_target(dry_run: bool) -> str | None:
    """The compile command's target for this machine's first device: ``gpu:<model>:1``, or
    ``cpu`` in the dry run; None for a GPU the command has no spec for."""
    if dry_run:
        return "cpu"
    chip = accelerators.chip_of(jax.devices()[0])
    for model, (_, key) in targets.GPU_MODELS.items():
        if chip is not None and accelerators.CHIPS[key] is chip:
            return f"gpu:{model}:1"
    return None


def predict(config, config_file: str, overrides: dict, target_name: str) -> dict:
    """What ``python -m attnjax.compile`` predicts for the train step of ``config`` on
    ``target_name``: its programs and report, the train step alone unless its FLOP count misses
    loop trips (then the eval step too, which the report's estimate needs)."""
    task = tasks.get_task(config.task)
    target = targets.parse(target_name)
    mesh, compiled = programs.compile_programs(config, task, target, only=("train",))
    if compiled[0].has_loops:
        compiled += programs.compile_programs(config, task, target, only=("eval",))[1]
    summary = report.summary(config_file, target, mesh, compiled)
    train = summary["programs"]["train"]
    flags = " ".join(f"--config.{key}={value}" for key, value in overrides.items())
    return {
        "command": f"python -m attnjax.compile --config {config_file} --target {target_name} "
        + flags,
        "target": target_name,
        "peak_flops_per_device": summary["peak_flops_per_device"],
        "peak_source": summary["peak_source"],
        "flops_per_example": train["flops_per_example"],
        "flops_per_example_estimate": train.get("flops_per_example_estimate"),
        "examples_per_second_at_peak": train["examples_per_second_at_peak"],
        "examples_per_second_at_40pct_mfu": train["examples_per_second_at_40pct_mfu"],
        "bytes_per_device": train["bytes_per_device"],
        "fits": train["fits"],
        "compile_seconds": train["compile_seconds"],
    }


def _vit_config(dry_run: bool, overrides: dict | None = None):
    sizes = VIT[_mode(dry_run)]
    return _config("vit_imagenet", {**sizes["overrides"], **(overrides or {})})


def vit(dry_run: bool, emit) -> dict:
    sizes = VIT[_mode(dry_run)]
    config = _vit_config(dry_run)
    model = {k: config.model[k] for k in ("variant", "width", "depth", "mlp_dim", "num_heads",
             "patch_size", "image_size", "num_classes") if k in config.model}  # fmt: skip
    result = {"config": "configs/vit_imagenet.py", "overrides": sizes["overrides"],
              "model": model, "compute_dtype": config.compute_dtype}  # fmt: skip
    high = {"label": config.model.num_classes}
    result["measured"] = time_training(config, sizes["steps"], sizes["warmup"], high)
    return result


def vit_predicted(dry_run: bool, emit) -> dict:
    """What the compile command predicts for the ``vit`` part's train step on this GPU (its
    FLOPs, memory and rate at the peak), to set beside the ``vit`` part's measurement."""
    sizes = VIT[_mode(dry_run)]
    target = compile_target(dry_run)
    if target is None:
        return {"skipped": f"no compile target for {jax.devices()[0].device_kind}"}
    config = _vit_config(dry_run)
    return predict(config, "configs/vit_imagenet.py", sizes["overrides"], target)


def vit_xla_flags(dry_run: bool, emit) -> dict:
    """The ``vit`` part again in a process started with ``XLA_FLAG_TRIALS``' flags (check.py sets
    them): what NVIDIA's GPU performance guide suggests, measured against the defaults."""
    import os

    sizes = VIT[_mode(dry_run)]
    config = _vit_config(dry_run)
    high = {"label": config.model.num_classes}
    return {
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "measured": time_training(config, sizes["steps"], sizes["warmup"], high),
    }


def random_lpips_weights(path) -> str:
    """LPIPS variables (VGG16 trunk and heads) initialised at random on the host's CPU, written
    where ``config.lpips.weights`` reads them: the perceptual term's cost, with no weights to
    download."""
    model = lpips.LPIPS()
    probe = np.zeros((1, 16, 16, 3), np.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        variables = jax.jit(model.init)(jax.random.key(7), probe, probe)
    return lpips.save_variables(jax.device_get(variables), path)


def vqgan_config(dry_run: bool, compute_dtype: str):
    """The f16 VQGAN's config at the mode's sizes with ``compute_dtype`` and random LPIPS
    weights (the recipe's perceptual term, at its weight 1)."""
    import tempfile

    sizes = VQGAN[_mode(dry_run)]
    config = _config("vqgan_imagenet_f16", {**sizes["overrides"], "compute_dtype": compute_dtype})
    folder = tempfile.mkdtemp(prefix="gpu_check_lpips_")
    config.lpips.weights = random_lpips_weights(f"{folder}/lpips.npz")
    return config


def _vqgan(dry_run: bool, compute_dtype: str) -> dict:
    sizes = VQGAN[_mode(dry_run)]
    config = vqgan_config(dry_run, compute_dtype)
    result = {"config": "configs/vqgan_imagenet_f16.py", "overrides": sizes["overrides"],
              "image_size": config.data.image_size, "compute_dtype": config.compute_dtype,
              "perceptual_weight": vqgan_task.perceptual_weight(config),
              "lpips_weights": "random (VGG16 trunk and heads)",
              "discriminator": config.discriminator.to_dict(),
              "disc_start": int(config.loss.disc_start)}  # fmt: skip
    result["measured"] = time_training(
        config, sizes["steps"], sizes["warmup"], {}, batches=sizes["batches"]
    )
    return result


def vqgan(dry_run: bool, emit) -> dict:
    """The f16 VQGAN's train step in bfloat16 (autoencoder, discriminator, LPIPS)."""
    return _vqgan(dry_run, "bfloat16")


def vqgan_float32(dry_run: bool, emit) -> dict:
    """The ``vqgan`` part in float32, same seeds and batches: the loss curve bf16's is compared
    with (``benchmarks/gpu/table.py``)."""
    return _vqgan(dry_run, "float32")


def first_steps(dry_run: bool, emit) -> dict:
    """In a second process over the first's persistent compilation cache (check.py gives both
    the same directory): the ViT's and the bf16 VQGAN's initialisation and first step again, every
    program now read from the cache; then the VQGAN's step at another learning rate, a program the
    cache lacks whose convolutions and fusions XLA's autotuning cache has seen (a compile without
    the autotuner's search)."""
    result = {
        "cache": compilation_cache.current_directory(),
        "xla_caches": jax.config.jax_persistent_cache_enable_xla_caches,
    }
    config = _vit_config(dry_run)
    runs = [("vit", config, {"label": config.model.num_classes})]
    config = vqgan_config(dry_run, "bfloat16")
    runs.append(("vqgan", config, {}))
    config = vqgan_config(dry_run, "bfloat16")
    config.learning_rate *= 1.5
    config.disc_learning_rate *= 1.5
    runs.append(("vqgan_new_program", config, {}))
    for name, config, high in runs:
        measured = time_training(config, 1, 1, high)
        result[name] = {key: measured[key] for key in ("init", "first_step")}
        emit(result)
    return result


# ---------------------------------------------------------------------------------------------
# The prior's cached sampler
# ---------------------------------------------------------------------------------------------


def prior_config(dry_run: bool):
    """``prior_cifar10.py`` (the mode's sizes) over the f16 VQGAN's code space, with no trained
    VQGAN -> ``(config, n_embed, grid)``."""
    mode = _mode(dry_run)
    autoencoder = _config("vqgan_imagenet_f16", VQGAN[mode]["overrides"])
    grid = autoencoder.data.image_size // 2 ** (len(autoencoder.model.ddconfig.ch_mult) - 1)
    n_embed = int(autoencoder.model.n_embed)
    config = _config("prior_cifar10", PRIOR[mode]["overrides"])
    config.vqgan_workdir = ""  # no trained VQGAN: its code space comes from vqgan_codes
    config.vqgan_codes.n_embed = n_embed
    config.vqgan_codes.grid = (grid, grid)
    return config, n_embed, grid


def prior_sampling(dry_run: bool, emit) -> dict:
    """Tokens per second of ``attnjax.tasks.prior.sample_step`` (the KV-cached sampler of
    ``attnjax.models.sampling``, as the compile command compiles it) with random weights."""
    sizes = PRIOR[_mode(dry_run)]
    config, n_embed, grid = prior_config(dry_run)
    model = prior_task.create_model(config)
    batch_size, tokens = sizes["batch"], grid * grid
    abstract = prior_task.abstract_batch(config, batch_size)
    batch = _synthetic_batch(abstract, {"codes": n_embed, "label": config.num_classes})
    state = prior_task.create_train_state(jax.random.PRNGKey(0), config, model, batch)
    sample = jax.jit(functools.partial(prior_task.sample_step, config=config, model=model))
    keys = list(jax.random.split(jax.random.PRNGKey(2), sizes["calls"] + 1))
    start = time.perf_counter()
    codes = np.asarray(sample(state, batch, keys[0]))
    first_call_seconds = time.perf_counter() - start
    calls = iter(keys[1:])
    seconds = median_seconds(
        lambda: jax.block_until_ready(sample(state, batch, next(calls))), sizes["calls"]
    )
    if codes.shape != (batch_size, grid, grid) or codes.min() < 0 or codes.max() >= n_embed:
        raise ValueError(f"sampled codes of shape {codes.shape} in [{codes.min()}, {codes.max()}]")
    return {
        "config": "configs/prior_cifar10.py",
        "overrides": sizes["overrides"],
        "model": {k: config.model[k] for k in ("n_layer", "n_head", "n_embd")},
        "vocab_size": model.vocab_size,
        "n_embed": n_embed,
        "grid": [grid, grid],
        "sampling": config.sampling.to_dict(),
        "guidance": prior_task.sampling_guidance(config),
        "compute_dtype": config.compute_dtype,
        "batch": batch_size,
        "tokens_per_call": batch_size * tokens,
        "calls": sizes["calls"],
        "seconds_per_call": seconds,
        "tokens_per_second": batch_size * tokens / seconds,
        "first_call_seconds": first_call_seconds,
        "codes_min": int(codes.min()),
        "codes_max": int(codes.max()),
    }


# ---------------------------------------------------------------------------------------------
# Attention: cuDNN vs XLA vs PyTorch
# ---------------------------------------------------------------------------------------------


INPUTS = (
    "q, k, v [batch, tokens, heads, head_dim] = np.random.default_rng(seed).standard_normal("
    "(3, batch, tokens, heads, head_dim), dtype=np.float32), each rounded to bfloat16"
)


def attention_inputs(seed: int, shape) -> list:
    """q, k, v as ``INPUTS`` says."""
    draws = np.random.default_rng(seed).standard_normal((3, *shape), dtype=np.float32)
    return [jnp.asarray(x, jnp.bfloat16) for x in draws]


def _jax_paths(implementation: str, causal: bool):
    def forward(q, k, v):
        return attention.dot_product_attention(
            q, k, v, is_causal=causal, implementation=implementation
        )

    def loss(q, k, v):
        return jnp.sum(forward(q, k, v).astype(jnp.float32))

    return forward, jax.grad(loss, (0, 1, 2))


def _jax_chained(implementation: str, causal: bool):
    """Forward and forward + backward as maps ``q -> q'`` of q's shape (every gradient feeds
    ``q'``: none is dead code), for a loop of them inside one program."""
    forward, grad = _jax_paths(implementation, causal)

    def forward_backward(q, k, v):
        dq, dk, dv = grad(q, k, v)
        return q + 1e-3 * (dq + dk + dv)

    return {"forward": forward, "forward_backward": forward_backward}


def _in_one_program(step, loop: int):
    """``loop`` calls of ``step`` chained in a ``fori_loop`` inside one jitted program: the
    device's time per call without the host's dispatch."""

    def run(q, k, v):
        return jax.lax.fori_loop(0, loop, lambda _, x: step(x, k, v).astype(x.dtype), q)

    return jax.jit(run)


def _time_jax(implementation: str, causal: bool, args, sizes: dict) -> tuple:
    forward = jax.jit(_jax_paths(implementation, causal)[0])
    out = jax.block_until_ready(forward(*args))
    call = median_seconds(lambda: jax.block_until_ready(forward(*args)), sizes["repeats"])
    timing = {"forward_call_ms": call * 1e3}
    for name, step in _jax_chained(implementation, causal).items():
        looped = _in_one_program(step, sizes["loop"])
        jax.block_until_ready(looped(*args))
        seconds = median_seconds(lambda: jax.block_until_ready(looped(*args)), sizes["repeats"])
        timing[f"{name}_ms"] = seconds / sizes["loop"] * 1e3
    return out, timing


def _torch_paths(torch, causal: bool):
    """Forward (no autograd) and forward + backward of PyTorch's SDPA, neither synchronising."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward(q, k, v):
        with torch.no_grad():
            return sdpa(q, k, v, is_causal=causal)

    def forward_backward(q, k, v):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        sdpa(q, k, v, is_causal=causal).float().sum().backward()
        return q.grad, k.grad, v.grad

    return {"forward": forward, "forward_backward": forward_backward}


def _time_torch(torch, causal: bool, args, sizes: dict, on_gpu: bool) -> tuple:
    """PyTorch's per-call forward (synchronised after each), and its device time per call over
    ``loop`` calls queued back to back between two CUDA events (the host's launches overlap the
    device's work: PyTorch's own way of hiding its per-call cost)."""
    sync = torch.cuda.synchronize if on_gpu else lambda: None
    paths = _torch_paths(torch, causal)
    out = paths["forward"](*args)
    paths["forward_backward"](*args)
    sync()

    def call():
        paths["forward"](*args)
        sync()

    timing = {"forward_call_ms": median_seconds(call, sizes["repeats"]) * 1e3}
    for name, fn in paths.items():
        times = []
        for _ in range(sizes["repeats"]):
            if on_gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True
                )
                start.record()
                for _ in range(sizes["loop"]):
                    fn(*args)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / sizes["loop"])
            else:
                begin = time.perf_counter()
                for _ in range(sizes["loop"]):
                    fn(*args)
                times.append((time.perf_counter() - begin) / sizes["loop"] * 1e3)
        timing[f"{name}_ms"] = float(np.median(times))
    return out, timing


def torch_backend_name(torch, q, k, v, causal: bool) -> str:
    """The SDPA backend PyTorch picks for these inputs (its own dispatch function)."""
    from torch.nn.attention import SDPBackend

    names = {int(value): name for name, value in SDPBackend.__members__.items()}
    return names.get(int(torch._fused_sdp_choice(q, k, v, is_causal=causal)), "unknown")


def _summary(out: np.ndarray) -> dict:
    """What the JSON keeps of an output ``[batch, tokens, heads, dim]``: the mean of its
    magnitudes and, of batch 0 and head 0, the first dims of its first, middle and last rows."""
    rows = np.linspace(0, out.shape[1] - 1, PROBE_ROWS).astype(int)
    return {
        "abs_mean": float(np.mean(np.abs(out), dtype=np.float64)),
        "probe": out[0, rows, 0, :PROBE_DIMS].astype(float).round(5).tolist(),
    }


# PyTorch's SDPA backends forced one at a time on a GPU (``torch.nn.attention.sdpa_kernel``),
# beside its own choice ("torch").
TORCH_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def _attention_row(torch, index: int, shape_row, causal: bool, sizes: dict, on_gpu: bool):
    name, batch, tokens, heads, depth = shape_row
    shape = (batch, tokens, heads, depth)
    q, k, v = attention_inputs(index, shape)
    xla_forward, xla_grad = _jax_paths("xla", causal)
    flops = {
        "forward": performance.traced_flops(xla_forward, q, k, v),
        "forward_backward": performance.traced_flops(xla_grad, q, k, v),
    }
    row = {"shape": name, "batch": batch, "tokens": tokens, "heads": heads, "head_dim": depth,
           "causal": causal, "seed": index,
           "automatic": attention.platform_choices(q, k, v, None, causal, timed=False),
           "flops": flops, "paths": {}}  # fmt: skip
    outputs = {}
    implementations = ("cudnn", "xla") if on_gpu else ("xla",)
    for implementation in implementations:
        out, timing = _time_jax(implementation, causal, (q, k, v), sizes)
        outputs[implementation] = np.asarray(out, np.float32)
        row["paths"][implementation] = timing
    if not on_gpu:
        row["paths"]["cudnn"] = {"status": "not on this platform"}
    if torch is None:
        row["paths"]["torch"] = {"status": "not installed"}
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        device = "cuda" if on_gpu else "cpu"
        tq, tk, tv = (torch.from_numpy(np.asarray(x, np.float32)) for x in (q, k, v))
        # PyTorch's layout: [batch, heads, tokens, head_dim].
        targs = tuple(
            x.to(device, torch.bfloat16).transpose(1, 2).contiguous() for x in (tq, tk, tv)
        )
        chosen = torch_backend_name(torch, *targs, causal)
        out, timing = _time_torch(torch, causal, targs, sizes, on_gpu)
        outputs["torch"] = out.transpose(1, 2).float().cpu().numpy()
        row["paths"]["torch"] = {**timing, "device": device, "backend": chosen}
        for backend in TORCH_BACKENDS if on_gpu else ():
            path = f"torch_{backend.split('_')[0].lower()}"
            try:
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    out, timing = _time_torch(torch, causal, targs, sizes, on_gpu)
            except RuntimeError as error:  # this backend refuses these inputs
                row["paths"][path] = {"status": "refused", "error": error_line(error)}
                continue
            outputs[path] = out.transpose(1, 2).float().cpu().numpy()
            row["paths"][path] = {**timing, "device": device, "backend": backend}
    for path, out in outputs.items():
        difference = float(np.max(np.abs(out - outputs["xla"])))
        timing = row["paths"][path]
        for kind in ("forward", "forward_backward"):
            timing[f"{kind}_tflops"] = flops[kind] / (timing[f"{kind}_ms"] / 1e3) / 1e12
        timing.update(_summary(out), max_abs_diff_vs_xla=difference)
    row["agree"] = all(
        row["paths"][path]["max_abs_diff_vs_xla"] <= AGREEMENT_ATOL for path in outputs
    )
    return row


def attention_kernels(dry_run: bool, emit) -> dict:
    """Forward and forward + backward of ``dot_product_attention`` forced to cuDNN and to XLA's
    path, and of ``torch.nn.functional.scaled_dot_product_attention`` (its own choice of backend,
    named, and each GPU backend forced) on the same device, bf16, causal and not; their outputs
    compared. Times per call on the device (``loop`` calls in one program, or queued back to
    back), and the per-call forward with the host's dispatch and a synchronisation."""
    # The GPU machines have PyTorch; a CPU without it (the newest-JAX environment) dry-runs
    # the rest.
    if dry_run and importlib.util.find_spec("torch") is None:
        torch = None
    else:
        import torch

    sizes = ATTENTION[_mode(dry_run)]
    on_gpu = not dry_run
    result = {
        "inputs": INPUTS,
        "flops": "products of the XLA path, as attnjax.train.performance counts them (every "
        "score, causal or not)",
        "timing": f"median of {sizes['repeats']}; *_ms: device time per call over "
        f"{sizes['loop']} calls (JAX: a fori_loop in one program; PyTorch: queued back to back "
        "between CUDA events); forward_call_ms: one call with dispatch and synchronisation",
        "torch": None if torch is None else torch.__version__,
        "agreement_atol": AGREEMENT_ATOL,
        "rows": [],
    }
    for index, shape_row in enumerate(sizes["shapes"]):
        for causal in (False, True):
            try:
                row = _attention_row(torch, index, shape_row, causal, sizes, on_gpu)
            except Exception as error:  # one shape out of memory must not end the others
                row = {"shape": shape_row[0], "causal": causal, "error": error_line(error)}
            result["rows"].append(row)
            emit(result)
    failed = [f"{r['shape']} causal={r['causal']}" for r in result["rows"] if "error" in r]
    if failed:
        raise RuntimeError(f"attention failed at {', '.join(failed)}")
    if not all(row["agree"] for row in result["rows"]):
        raise AssertionError(f"attention paths differ by more than {AGREEMENT_ATOL}")
    return result


def error_line(error: BaseException) -> str:
    """``Type: first line of the message``, at most 300 characters."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


PARTS = {
    "vit": vit,
    "vqgan": vqgan,
    "prior_sampling": prior_sampling,
    "attention": attention_kernels,
    "first_steps": first_steps,
    "vqgan_float32": vqgan_float32,
    "vit_predicted": vit_predicted,
    "vit_xla_flags": vit_xla_flags,
}
