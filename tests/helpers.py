"""Helpers shared by the test modules (fixtures live in conftest.py)."""

import contextlib
import functools
import os

import flax
import jax
import numpy as np

import configs
from attnjax import data
from attnjax.tasks import classification, train_and_evaluate
from attnjax.train import parallel, sharding

_RUNS: dict = {}


def assert_close(actual, expected, rtol=1e-5, atol=1e-6, what="value"):
    """Relative-error check with a small absolute floor for entries near zero."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (
        f"{what}: shape {actual.shape} != expected {expected.shape}"
    )
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


def lpips_distance(reference, a, b):
    """``reference`` on NHWC numpy images -> ``[batch]`` distances."""
    import torch

    nchw = lambda x: torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
    with torch.no_grad():
        return reference(nchw(a), nchw(b)).numpy().reshape(-1)


def write_pickle_that_runs_code(path):
    """A ``.pth`` whose unpickling would call ``print`` (as a real attack would call ``os.system``)."""
    import torch

    class RunsCode:
        def __reduce__(self):
            return (print, ("arbitrary code ran",))

    with open(path, "wb") as f:
        torch.save({"state_dict": RunsCode()}, f)
    return path


def random_timm_vit(seed=0, **kwargs):
    """A small timm VisionTransformer with every parameter randomised, in eval mode."""
    import torch
    from timm.models import vision_transformer as timm_vit

    config = dict(
        img_size=16, patch_size=4, embed_dim=24, depth=2, num_heads=3, mlp_ratio=2.0, num_classes=5
    )
    config.update(kwargs)
    torch.manual_seed(seed)
    model = timm_vit.VisionTransformer(**config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def random_images(batch, size, channels=3, seed=0):
    height, width = (size, size) if isinstance(size, int) else size
    return (
        np.random.default_rng(seed)
        .standard_normal((batch, height, width, channels))
        .astype(np.float32)
    )


def timm_logits(model, images_nhwc):
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(images_nhwc).permute(0, 3, 1, 2).contiguous()).numpy()


def jax_logits(model, variables, images):
    return np.asarray(jax.jit(model.apply)(variables, images))


def fsdp_config(data_dir, mesh, steps=3):
    config = load_config("vit_digits")
    config.data.data_dir = data_dir
    config.model.update(width=32, depth=1, num_heads=2, mlp_dim=64, dropout_rate=0.0)
    # SGD: Adam divides each gradient by its own magnitude, so parameters whose true gradient is
    # zero (attention key biases) would move by rounding noise that differs between layouts.
    config.update(
        batch_size=16,
        eval_batch_size=40,
        num_train_steps=steps,
        warmup_steps=1,
        log_every=1,
        eval_every=steps,
        checkpoint_every=2,
        max_to_keep=3,
        best_metric="",
        quiet=True,
        optimizer="sgd",
        learning_rate=0.3,
        mesh=mesh,
    )
    return config


def train_steps(config):
    """``num_train_steps`` steps on ``config.mesh`` -> (flat host params, bytes per device of
    params + optimiser state, the same state's bytes if every device held all of it)."""
    state, dp = jit_steps(config)
    held = (state.params, state.opt_state)
    whole = sum(x.nbytes for x in jax.tree.leaves(held))
    params = flax.traverse_util.flatten_dict(dp.to_host(state.params), sep="/")
    return params, sharding.bytes_per_device(held), whole


def trained_runs(digits_dir, root) -> dict:
    """Tiny ViT, VQGAN (8x8 digits -> 4x4 codes) and prior runs, trained once per session
    (``root`` of the first call holds them)."""
    if digits_dir in _RUNS:
        return _RUNS[digits_dir]
    steps = dict(
        num_train_steps=4, log_every=2, eval_every=4, checkpoint_every=4, warmup_steps=1, quiet=True
    )
    vit_config = load_config("vit_digits")
    vit_config.data.update(data_dir=digits_dir, image_size=8)  # the VQGAN's size: it judges samples
    vit_config.model.update(width=16, depth=1, num_heads=2, mlp_dim=32, image_size=8)
    vit_config.update(batch_size=16, eval_batch_size=120, **steps)

    vqgan_config = load_config("vqgan_digits")
    vqgan_config.data.update(data_dir=digits_dir, image_size=8, eval_split="test[:64]")
    vqgan_config.model.ddconfig.update(ch=32, ch_mult=(1, 1), resolution=8, z_channels=8)
    vqgan_config.model.update(n_embed=16, embed_dim=8)
    vqgan_config.update(batch_size=16, eval_batch_size=64, **steps)

    prior_config = load_config("prior_digits")
    prior_config.vqgan_workdir = os.path.join(root, "vqgan")
    prior_config.data.train_shifts = 0
    prior_config.model.update(n_layer=1, n_head=2, n_embd=16)
    prior_config.sampling.update(per_class=1, guidance=2.0)
    prior_config.update(batch_size=16, eval_batch_size=64, **steps)

    runs = {}
    for name, config in (("vit", vit_config), ("vqgan", vqgan_config), ("prior", prior_config)):
        runs[name] = os.path.join(root, name)
        train_and_evaluate(config, runs[name])
    _RUNS[digits_dir] = runs
    return runs


_compile_log: list | None = None


def _on_event_duration(event: str, duration: float, **kwargs) -> None:
    if _compile_log is not None and event == "/jax/core/compile/backend_compile_duration":
        _compile_log.append(event)


jax.monitoring.register_event_duration_secs_listener(_on_event_duration)


@contextlib.contextmanager
def count_compilations():
    """Yields the list of XLA compilations (JAX's own monitoring events) made inside the block."""
    global _compile_log
    _compile_log = []
    try:
        yield _compile_log
    finally:
        _compile_log = None


def tiny_config(data_dir, parallel_mode="jit"):
    config = load_config("vit_digits")
    config.data.data_dir = data_dir
    config.data.crop_padding = 1
    config.model.update(width=16, depth=1, num_heads=2, mlp_dim=32, dropout_rate=0.0)
    # SGD: Adam divides each gradient by its own magnitude, so parameters whose true gradient is
    # zero (attention key biases: softmax ignores them) would move by rounding noise / noise.
    config.update(
        batch_size=16,
        eval_batch_size=40,
        num_train_steps=3,
        warmup_steps=1,
        log_every=1,
        eval_every=3,
        checkpoint_every=3,
        best_metric="",
        parallel=parallel_mode,
        quiet=True,
        optimizer="sgd",
        learning_rate=0.3,
    )
    return config


def jit_steps(config):
    """The loop's first ``num_train_steps`` steps with ``DataParallel("jit")`` on ``config.mesh``
    (no eval/io) -> ``(state, dp)``, the state laid out on the mesh."""
    dp = parallel.DataParallel(
        "jit",
        config.batch_size,
        config.eval_batch_size,
        mesh=config.get("mesh"),
        rules=sharding.rules_for(config),
    )
    model = classification.create_model(config)
    ds = data.make_datasets(config)
    init_rng, train_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    state = classification.create_train_state(
        init_rng, config, model, next(data.make_iterator(ds.train))
    )
    state = dp.place_state(state)
    step = dp.compile_train_step(
        functools.partial(classification.train_step, config=config, model=model),
        dp.state_shardings(state),
    )
    batches = data.make_iterator(ds.train)
    for i in range(config.num_train_steps):
        state, _ = step(state, dp.shard_batch(next(batches)), jax.random.fold_in(train_rng, i))
    return state, dp


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name):
    return configs.load(name)
