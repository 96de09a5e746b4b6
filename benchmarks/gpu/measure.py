"""The measurements behind benchmarks/gpu/check.py, one function per part: ``PARTS[name](dry_run,
emit) -> dict``. ``emit(partial)`` hands over what a part has measured so far, so that a part
stopped at its time limit still reports it.

Every number comes from the library's own code: the configs, the tasks' models, train states and
train steps, the training loop's placement and jitted steps (``attnjax.train.loop`` and
``steps``), its FLOP count and MFU (``attnjax.train.performance.Utilization``), the compile
command's programs and report (``attnjax.compile``), the prior's sampler and attention's forced
implementations.
``dry_run`` runs the same code at tiny sizes on the CPU.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import measure_profile
import numpy as np
from measure_attention import attention_kernels
from timing import median_seconds

import configs
from attnjax import tasks
from attnjax.compile import programs, report, targets
from attnjax.models import lpips
from attnjax.tasks import prior as prior_task
from attnjax.tasks import vqgan as vqgan_task
from attnjax.train import accelerators, compilation_cache, executables, loop, performance, steps

# ViT-B/16 at 224 px: the resolution of the published H100 rate docs/accelerators.md compares its
# prediction with, and one whose train step has no loop of unknown length, so the compile command
# predicts it from the train step itself. The dry run keeps the config and shrinks the model.
VIT = {
    "gpu": dict(steps=30, warmup=3, profiled=3, overrides={"batch_size": 256,
                "eval_batch_size": 256, "data.image_size": 224, "model.image_size": 224}),
    "dry-run": dict(steps=3, warmup=1, profiled=2, overrides={"batch_size": 4,
                    "eval_batch_size": 4, "data.image_size": 32, "model.image_size": 32,
                    "model.patch_size": 8, "model.width": 32, "model.depth": 1,
                    "model.mlp_dim": 64, "model.num_heads": 2}),
}  # fmt: skip
# The f16 VQGAN as configured: autoencoder, PatchGAN discriminator and LPIPS (random weights; the
# dry run leaves LPIPS out: its VGG16 compile was most of the dry run's time, and tests/tasks
# train with it), on ``batches`` synthetic batches in turn, so that the loss curves of bf16 and
# float32 (same seeds, same batches) say something. measure_torch.VQGAN is the same work in
# PyTorch.
VQGAN = {
    "gpu": dict(steps=30, warmup=2, batches=4, lpips=True, overrides={"batch_size": 16,
                "eval_batch_size": 16}),
    "dry-run": dict(steps=4, warmup=1, batches=2, lpips=False, overrides={"batch_size": 2,
                    "eval_batch_size": 2, "data.image_size": 16, "model.ddconfig.resolution": 16,
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
    ``[0, high[key])`` (zeros for a key ``high`` leaves out: labels the task does not read)."""
    rng = np.random.default_rng(seed)
    batch = {}
    for key, spec in abstract.items():
        if jnp.issubdtype(spec.dtype, jnp.integer):
            batch[key] = rng.integers(0, high.get(key, 1), spec.shape).astype(spec.dtype)
        else:
            batch[key] = rng.uniform(-1, 1, spec.shape).astype(spec.dtype)
    return batch


def _stages_since(before: dict, counts: dict, kept: dict) -> dict:
    """Seconds of tracing, lowering and compiling since ``before``; the programs the persistent
    cache answered (hits) or had to compile (misses) since ``counts``; the compiled programs
    loaded whole from the kept executables (no tracing: ``attnjax.train.executables``) and
    written there since ``kept``."""
    now, hits, kept_now = (
        compilation_cache.stage_seconds(),
        compilation_cache.counts(),
        executables.counts(),
    )
    result = {stage: now[stage] - before[stage] for stage in now}
    result.update(
        cache_hits=hits["hits"] - counts["hits"],
        cache_misses=hits["misses"] - counts["misses"],
        kept_loaded=kept_now["loaded"] - kept["loaded"],
        kept_written=kept_now["written"] - kept["written"],
        loading=kept_now["load_seconds"] - kept["load_seconds"],
    )
    return result


def _snapshot() -> tuple[dict, dict, dict]:
    return compilation_cache.stage_seconds(), compilation_cache.counts(), executables.counts()


def first_step(config, high: dict, batches: int = 1) -> dict:
    """``config``'s task set up on one device as the training loop does (placement, jitted step
    kept across processes), its initial state and its first step on ``batches`` synthetic
    batches -> what the rest of a run needs and the two timings, each split into JAX's tracing,
    lowering and compiling (a persistent-cache hit counts as compiling), loading kept programs,
    and the rest (running, transfers)."""
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
    init = {"seconds": time.perf_counter() - start, **_stages_since(*before)}
    train_step, eval_step = steps.compile_steps(config, task, model, dp, state)
    # As the training loop does: a repeated run loads the steps as compiled, without tracing.
    identity = executables.identity_of(config, task)
    train_step, _ = executables.cached_steps(identity, train_step, eval_step)
    device_batches = [dp.shard_batch(batch) for batch in host_batches]
    key = jax.random.PRNGKey(1)
    before = _snapshot()
    start = time.perf_counter()
    state, metrics = train_step(state, device_batches[0], key)
    loss = float(metrics["loss"])
    first = {"seconds": time.perf_counter() - start, **_stages_since(*before)}
    stages = [*compilation_cache.STAGES.values(), "loading"]
    first["running"] = first["seconds"] - sum(first[k] for k in stages)
    return dict(devices=devices, train_step=train_step, state=state, batches=device_batches,
                key=key, loss=loss, init=init, first_step=first)  # fmt: skip


def time_training(
    config, steps: int, warmup: int, high: dict, batches: int = 1, profiled: int = 0
) -> dict:
    """``steps`` train steps of ``config``'s task on one device after ``warmup`` (the first
    compiles: ``first_step``), cycling over ``batches`` synthetic batches; MFU as the loop logs
    it (``train/mfu``); every step's loss, read after the clock stopped; then, with
    ``profiled``, that many more steps under the profiler (``measure_profile``: the device's time
    by kernel family)."""
    started = first_step(config, high, batches)
    devices, train_step, state = started["devices"], started["train_step"], started["state"]
    device_batches, losses = started["batches"], [started["loss"]]
    keys = [started["key"], *jax.random.split(jax.random.PRNGKey(3), warmup + steps - 1)]
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
    profile = None
    if profiled:
        more = list(jax.random.split(jax.random.PRNGKey(2), profiled + 1))
        try:  # a profiler that fails must not cost the row its measurement
            profile = measure_profile.profile_steps(train_step, state, device_batches[0], more)
        except Exception as error:
            profile = {"error": f"{type(error).__name__}: {error}"[:300]}
    return {
        "profile": profile,
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
        "init_seconds": started["init"]["seconds"],
        "first_step_seconds": started["first_step"]["seconds"],
        "init": started["init"],
        "first_step": started["first_step"],
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
    result["measured"] = time_training(
        config, sizes["steps"], sizes["warmup"], high, profiled=sizes["profiled"]
    )
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


@functools.lru_cache(maxsize=1)
def random_lpips_weights() -> str:
    """A file of LPIPS variables (VGG16 trunk and heads) drawn at random on the host, written once
    a process where ``config.lpips.weights`` reads it: the perceptual term's cost, with no
    weights to download. He-normal kernels keep the trunk's activations of order one; the heads
    are non-negative, as LPIPS's are; biases zero."""
    import tempfile

    probe = jnp.zeros((1, 16, 16, 3))
    abstract = jax.eval_shape(lpips.LPIPS().init, jax.random.key(0), probe, probe)
    rng = np.random.default_rng(7)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "bias" in name:
            return np.zeros(leaf.shape, leaf.dtype)
        fan_in = int(np.prod(leaf.shape[:-1]))
        values = rng.standard_normal(leaf.shape) * np.sqrt(2.0 / fan_in)
        return (np.abs(values) if "lin" in name else values).astype(leaf.dtype)

    variables = jax.tree_util.tree_map_with_path(draw, abstract)
    folder = tempfile.mkdtemp(prefix="gpu_check_lpips_")
    return lpips.save_variables(variables, f"{folder}/lpips.npz")


def vqgan_config(dry_run: bool, compute_dtype: str):
    """The f16 VQGAN's config at the mode's sizes with ``compute_dtype`` and random LPIPS
    weights (the recipe's perceptual term, at its weight 1)."""
    sizes = VQGAN[_mode(dry_run)]
    config = _config("vqgan_imagenet_f16", {**sizes["overrides"], "compute_dtype": compute_dtype})
    if sizes["lpips"]:
        config.lpips.weights = random_lpips_weights()
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
    program now read from the cache; then a step the cache lacks, whose fusions and convolutions
    XLA's autotuning cache has seen (a compile without the autotuner's search): the VQGAN's at
    another learning rate (the dry run: the ViT's, a shorter compile)."""
    result = {
        "cache": compilation_cache.current_directory(),
        "xla_caches": jax.config.jax_persistent_cache_enable_xla_caches,
    }
    vit_config = _vit_config(dry_run)
    high = {"label": vit_config.model.num_classes}
    runs = [("vit", vit_config, high), ("vqgan", vqgan_config(dry_run, "bfloat16"), {})]
    changed, changed_high = (vit_config, high) if dry_run else (runs[1][1], {})
    changed = changed.copy_and_resolve_references()
    changed.learning_rate *= 1.5
    if "disc_learning_rate" in changed:
        changed.disc_learning_rate *= 1.5
    runs.append(("new_program", changed, changed_high))
    for name, config, high in runs:
        started = first_step(config, high)
        result[name] = {key: started[key] for key in ("init", "first_step")}
        if name == "new_program":
            result[name]["task"] = config.task
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
