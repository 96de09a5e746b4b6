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
from attnjax.train import accelerators, loop, performance

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
# The f16 VQGAN as configured: autoencoder and PatchGAN discriminator, no LPIPS weights (the
# perceptual term is off, as in the compiled rows of docs/accelerators.md).
VQGAN = {
    "gpu": dict(steps=10, warmup=2, overrides={"batch_size": 16, "eval_batch_size": 16}),
    "dry-run": dict(steps=2, warmup=1, overrides={"batch_size": 2, "eval_batch_size": 2,
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
    "gpu": dict(repeats=10, shapes=[("1k", 4, 1024, 8, 128), ("4k", 1, 4096, 8, 128),
                                    ("16k", 1, 16384, 8, 128)]),
    "dry-run": dict(repeats=2, shapes=[("64", 2, 64, 2, 32), ("128", 1, 128, 2, 32)]),
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


def time_training(config, steps: int, warmup: int, high: dict) -> dict:
    """``steps`` train steps of ``config``'s task on one device after ``warmup`` (the first
    compiles), on one synthetic batch, placed and jitted as the training loop does; MFU as the
    loop logs it (``train/mfu``)."""
    task = tasks.get_task(config.task)
    model = task.create_model(config)
    devices = jax.devices()[:1]
    dp = loop.make_data_parallel(config, task, devices=devices)
    host_batch = _synthetic_batch(task.abstract_batch(config, config.batch_size), high)
    start = time.perf_counter()
    state = loop.initial_state(task, config, model, host_batch, jax.random.PRNGKey(config.seed))
    state = jax.block_until_ready(dp.place_state(state))
    init_seconds = time.perf_counter() - start
    train_step, _ = loop.compile_steps(config, task, model, dp, state)
    batch = dp.shard_batch(host_batch)
    keys = list(jax.random.split(jax.random.PRNGKey(1), warmup + steps))
    start = time.perf_counter()
    state, metrics = train_step(state, batch, keys[0])
    first_loss = float(metrics["loss"])
    first_step_seconds = time.perf_counter() - start
    for key in keys[1:warmup]:
        state, metrics = train_step(state, batch, key)
    jax.block_until_ready(state)
    utilization = performance.Utilization(devices, config)
    utilization.count(train_step, state, batch, keys[0])
    start = time.perf_counter()
    for key in keys[warmup:]:
        state, metrics = train_step(state, batch, key)
    jax.block_until_ready((state, metrics))
    seconds = time.perf_counter() - start
    last_loss = float(metrics["loss"])
    if not np.isfinite(last_loss):
        raise FloatingPointError(f"the loss after {warmup + steps} steps is {last_loss}")
    scalars = utilization.scalars(steps / seconds)
    return {
        "batch_size": int(config.batch_size),
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
        "loss_first": first_loss,
        "loss_last": last_loss,
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


def vit(dry_run: bool, emit) -> dict:
    sizes = VIT[_mode(dry_run)]
    config = _config("vit_imagenet", sizes["overrides"])
    model = {k: config.model[k] for k in ("variant", "width", "depth", "mlp_dim", "num_heads",
             "patch_size", "image_size", "num_classes") if k in config.model}  # fmt: skip
    result = {"config": "configs/vit_imagenet.py", "overrides": sizes["overrides"],
              "model": model, "compute_dtype": config.compute_dtype}  # fmt: skip
    high = {"label": config.model.num_classes}
    result["measured"] = time_training(config, sizes["steps"], sizes["warmup"], high)
    emit(result)
    target = compile_target(dry_run)
    if target is None:
        result["predicted"] = {"skipped": f"no compile target for {jax.devices()[0].device_kind}"}
        return result
    predicted = predict(config, "configs/vit_imagenet.py", sizes["overrides"], target)
    result["predicted"] = predicted
    at_peak = predicted["examples_per_second_at_peak"]
    if at_peak:
        # The measured rate over the rate at the peak: the MFU the compile command's FLOP count
        # gives the measurement (equal to the measured MFU where the two counts agree).
        result["measured_over_predicted_at_peak"] = (
            result["measured"]["images_per_second"] / at_peak
        )
    return result


def vqgan(dry_run: bool, emit) -> dict:
    sizes = VQGAN[_mode(dry_run)]
    config = _config("vqgan_imagenet_f16", sizes["overrides"])
    result = {"config": "configs/vqgan_imagenet_f16.py", "overrides": sizes["overrides"],
              "image_size": config.data.image_size, "compute_dtype": config.compute_dtype,
              "perceptual_weight": vqgan_task.perceptual_weight(config)}  # fmt: skip
    result["measured"] = time_training(config, sizes["steps"], sizes["warmup"], {})
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


def _torch_paths(torch, device: str, causal: bool):
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None

    def forward(q, k, v):
        with torch.no_grad():
            out = sdpa(q, k, v, is_causal=causal)
        sync()
        return out

    def forward_backward(q, k, v):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        sdpa(q, k, v, is_causal=causal).float().sum().backward()
        sync()
        return q.grad, k.grad, v.grad

    return forward, forward_backward


def _summary(out: np.ndarray) -> dict:
    """What the JSON keeps of an output ``[batch, tokens, heads, dim]``: the mean of its
    magnitudes and, of batch 0 and head 0, the first dims of its first, middle and last rows."""
    rows = np.linspace(0, out.shape[1] - 1, PROBE_ROWS).astype(int)
    return {
        "abs_mean": float(np.mean(np.abs(out), dtype=np.float64)),
        "probe": out[0, rows, 0, :PROBE_DIMS].astype(float).round(5).tolist(),
    }


def _time_path(forward, forward_backward, args, repeats: int, flops: dict) -> tuple:
    out = forward(*args)
    forward_backward(*args)
    seconds = {
        "forward": median_seconds(lambda: jax.block_until_ready(forward(*args)), repeats),
        "forward_backward": median_seconds(
            lambda: jax.block_until_ready(forward_backward(*args)), repeats
        ),
    }
    timing = {}
    for name, value in seconds.items():
        timing[f"{name}_ms"] = value * 1e3
        timing[f"{name}_tflops"] = flops[name] / value / 1e12
    return out, timing


def _attention_row(torch, index: int, shape_row, causal: bool, repeats: int, on_gpu: bool):
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
        forward, grad = (jax.jit(f) for f in _jax_paths(implementation, causal))
        out, timing = _time_path(forward, grad, (q, k, v), repeats, flops)
        outputs[implementation] = np.asarray(out, np.float32)
        row["paths"][implementation] = timing
    if not on_gpu:
        row["paths"]["cudnn"] = {"status": "not on this platform"}
    if torch is None:
        row["paths"]["torch"] = {"status": "not installed"}
    else:
        device = "cuda" if on_gpu else "cpu"
        tq, tk, tv = (torch.from_numpy(np.asarray(x, np.float32)) for x in (q, k, v))
        tq, tk, tv = (
            x.to(device, torch.bfloat16).transpose(1, 2).contiguous() for x in (tq, tk, tv)
        )
        forward, grad = _torch_paths(torch, device, causal)
        out, timing = _time_path(forward, grad, (tq, tk, tv), repeats, flops)
        outputs["torch"] = out.transpose(1, 2).float().cpu().numpy()
        row["paths"]["torch"] = {**timing, "device": device}
    for path, out in outputs.items():
        difference = float(np.max(np.abs(out - outputs["xla"])))
        row["paths"][path].update(_summary(out), max_abs_diff_vs_xla=difference)
    row["agree"] = all(
        row["paths"][path]["max_abs_diff_vs_xla"] <= AGREEMENT_ATOL for path in outputs
    )
    return row


def attention_kernels(dry_run: bool, emit) -> dict:
    """Forward and forward + backward times of ``dot_product_attention`` forced to cuDNN and to
    XLA's path, and of ``torch.nn.functional.scaled_dot_product_attention`` on the same device,
    bf16, causal and not; their outputs compared."""
    # Only this part compares with PyTorch. The GPU machines have it; a CPU without it (the
    # newest-JAX environment) dry-runs the rest.
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
        "torch": None if torch is None else torch.__version__,
        "agreement_atol": AGREEMENT_ATOL,
        "rows": [],
    }
    for index, shape_row in enumerate(sizes["shapes"]):
        for causal in (False, True):
            try:
                row = _attention_row(torch, index, shape_row, causal, sizes["repeats"], on_gpu)
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
}
