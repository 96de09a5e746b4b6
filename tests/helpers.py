"""Helpers shared by the test modules (fixtures live in conftest.py)."""

import contextlib
import functools
import os

import flax
import jax
import jax.numpy as jnp
import numpy as np

import configs
from attnjax import data
from attnjax.models import vit
from attnjax.parallel import data_parallel, launch, sharding
from attnjax.tasks import classification, train_and_evaluate


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
    """A ``.pth`` whose unpickling would call ``print`` (as a real attack would call
    ``os.system``)."""
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


# Batch and schedule of the tiny VQGAN and prior runs: batch 16, evaluated every 4 steps.
TINY_RUN_SCHEDULE = dict(
    batch_size=16,
    eval_batch_size=64,
    warmup_steps=1,
    log_every=2,
    eval_every=4,
    checkpoint_every=4,
    quiet=True,
)


def tiny_vqgan_config(data_dir, **overrides):
    """The canonical tiny VQGAN on the embedded digits (16x16, f=1: the fewest layers to
    compile), batch 16, evaluated on 64 test images every 4 steps."""
    config = load_config("vqgan_digits")
    config.data.data_dir = data_dir
    config.data.eval_split = "test[:64]"
    config.model.ddconfig.update(ch_mult=(1,), num_res_blocks=1)
    config.update(TINY_RUN_SCHEDULE, **overrides)
    return config


def tiny_prior_config(vqgan_workdir, **overrides):
    """The canonical tiny prior (one GPT layer of width 16) on the codes of ``vqgan_workdir``."""
    config = load_config("prior_digits")
    config.vqgan_workdir = vqgan_workdir
    config.data.train_shifts = 0
    config.model.update(n_layer=1, n_head=2, n_embd=16)
    config.sampling.update(per_class=1, guidance=2.0)
    config.update(TINY_RUN_SCHEDULE, **overrides)
    return config


def train_tiny_runs(digits_dir, runs):
    """Trains 4 steps of the tiny ViT on 8x8 digits, the tiny VQGAN made 8x8 -> 4x4 codes, and
    the tiny prior on its codes into ``runs["vit"]``, ``runs["vqgan"]`` and ``runs["prior"]``;
    conftest's ``trained_runs`` fixture trains them once per session."""
    steps = dict(
        num_train_steps=4, log_every=2, eval_every=4, checkpoint_every=4, warmup_steps=1, quiet=True
    )
    vit_config = tiny_vit_config(digits_dir, eval_batch_size=120, **steps)
    vit_config.data.image_size = vit_config.model.image_size = 8  # the VQGAN's: it judges samples

    vqgan_config = tiny_vqgan_config(digits_dir, num_train_steps=4)
    vqgan_config.data.image_size = 8
    vqgan_config.model.ddconfig.update(ch_mult=(1, 1), resolution=8, z_channels=8)
    vqgan_config.model.update(n_embed=16, embed_dim=8)

    prior_config = tiny_prior_config(runs["vqgan"], num_train_steps=4)

    for name, config in (("vit", vit_config), ("vqgan", vqgan_config), ("prior", prior_config)):
        train_and_evaluate(config, runs[name])


_compile_log: list | None = None


def _on_event_duration(event: str, duration: float, **kwargs) -> None:
    if _compile_log is not None and event == "/jax/core/compile/backend_compile_duration":
        _compile_log.append(event)


jax.monitoring.register_event_duration_secs_listener(_on_event_duration)


@contextlib.contextmanager
def count_compilations():
    """Yields the list of XLA compilations (JAX's own monitoring events) made inside the block.
    A load from the suite's persistent compilation cache counts too: JAX times it under the same
    event, around ``compile_or_get_cached``."""
    global _compile_log
    _compile_log = []
    try:
        yield _compile_log
    finally:
        _compile_log = None


TINY_VIT_MODEL = dict(width=16, depth=1, num_heads=2, mlp_dim=32)
TINY_VIT_BATCHES = dict(batch_size=16, eval_batch_size=40)


def tiny_vit_flags():
    """train.py's flags for the tiny ViT's model and batch sizes (see ``tiny_vit``)."""
    return [f"--config.model.{k}={v}" for k, v in TINY_VIT_MODEL.items()] + [
        f"--config.{k}={v}" for k, v in TINY_VIT_BATCHES.items()
    ]


def tiny_vit(config, **overrides):
    """Any ViT config shrunk to the suite's tiny ViT (width 16, depth 1, 2 heads, MLP 32; batch
    16, eval batch 40; logs every 2 steps, evaluates and saves every 4), then ``overrides``."""
    config.model.update(TINY_VIT_MODEL)
    config.update(
        dict(
            **TINY_VIT_BATCHES,
            warmup_steps=2,
            log_every=2,
            eval_every=4,
            checkpoint_every=4,
            quiet=True,
        ),
        **overrides,
    )
    return config


def tiny_vit_config(data_dir, **overrides):
    """The canonical tiny ViT on the embedded digits in ``data_dir``."""
    config = load_config("vit_digits")
    config.data.data_dir = data_dir
    return tiny_vit(config, **overrides)


def tiny_config(data_dir, parallel_mode="jit"):
    """The tiny ViT for comparing layouts: 3 SGD steps without dropout, on ``parallel_mode``."""
    # SGD: Adam divides each gradient by its own magnitude, so parameters whose true gradient is
    # zero (attention key biases: softmax ignores them) would move by rounding noise / noise.
    config = tiny_vit_config(
        data_dir,
        num_train_steps=3,
        warmup_steps=1,
        log_every=1,
        eval_every=3,
        checkpoint_every=3,
        best_metric="",
        parallel=parallel_mode,
        optimizer="sgd",
        learning_rate=0.3,
    )
    config.data.crop_padding = 1
    config.model.dropout_rate = 0.0
    return config


def tiny_vit_params(depth=1):
    """A tiny ViT (8x8 single-channel images, patch 4, 3 classes, ``depth`` blocks) and its
    initial params."""
    model = vit.create_vit(
        num_classes=3,
        image_size=8,
        patch_size=4,
        width=8,
        depth=depth,
        num_heads=2,
        mlp_dim=16,
        in_channels=1,
    )
    return model, model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]


def flat(tree):
    return flax.traverse_util.flatten_dict(tree, sep="/")


def jit_steps(config):
    """The loop's first ``num_train_steps`` steps with ``DataParallel("jit")`` on ``config.mesh``
    (no eval/io) -> ``(state, dp)``, the state laid out on the mesh."""
    dp = data_parallel.DataParallel(
        "jit",
        config.batch_size,
        config.eval_batch_size,
        mesh=config.get("mesh"),
        rules=sharding.rules_for(config, classification.SHARDING_RULES),
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


def xla_flags(devices=None):
    """``$XLA_FLAGS`` (the suite's compile flags, see conftest) for a subprocess, with its CPU
    device count set to ``devices`` (None: no count, the process chooses)."""
    return launch.with_cpu_device_count(os.environ.get("XLA_FLAGS", ""), devices)


def load_config(name):
    return configs.load(name)


def assert_relative(actual, expected, tol=1e-5, what="value"):
    """Relative error in the max norm: ``|a - b| <= tol * (|b| + max |b|)`` elementwise, so that
    entries near zero in a deep float32 network are held to the scale of the output."""
    expected = np.asarray(expected)
    assert_close(actual, expected, rtol=tol, atol=tol * float(np.abs(expected).max()), what=what)


def relative_to_max(actual, expected) -> float:
    """``max |actual - expected| / max |expected|``: the error of a lower-precision computation
    on the scale of its output."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def randomise_norms(module, generator):
    """Default GroupNorm/BatchNorm affines are 1 and 0: perturb them so that their conversion
    counts."""
    import torch

    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, (torch.nn.GroupNorm, torch.nn.BatchNorm2d)):
                layer.weight.add_(0.2 * torch.randn(layer.weight.shape, generator=generator))
                layer.bias.add_(0.2 * torch.randn(layer.bias.shape, generator=generator))
            if isinstance(layer, torch.nn.BatchNorm2d):
                layer.running_mean.copy_(
                    0.1 * torch.randn(layer.running_mean.shape, generator=generator)
                )
                layer.running_var.copy_(
                    1 + torch.rand(layer.running_var.shape, generator=generator)
                )


def nchw(x):
    import torch

    return torch.from_numpy(np.ascontiguousarray(np.asarray(x).transpose(0, 3, 1, 2)))


def nhwc(t):
    return t.detach().numpy().transpose(0, 2, 3, 1)


@functools.cache
def random_fid_inception(seed=0):
    """pytorch-fid's FID Inception (torchvision's ``Inception3``, 1008 classes, its FID blocks)
    with random weights, in eval mode; built once per process and shared, so never modify it."""
    import torch
    from pytorch_fid import inception as pytorch_fid

    torch.manual_seed(seed)
    net = pytorch_fid._inception_v3(num_classes=1008, aux_logits=False, weights=None)
    net.Mixed_5b = pytorch_fid.FIDInceptionA(192, pool_features=32)
    net.Mixed_5c = pytorch_fid.FIDInceptionA(256, pool_features=64)
    net.Mixed_5d = pytorch_fid.FIDInceptionA(288, pool_features=64)
    net.Mixed_6b = pytorch_fid.FIDInceptionC(768, channels_7x7=128)
    net.Mixed_6c = pytorch_fid.FIDInceptionC(768, channels_7x7=160)
    net.Mixed_6d = pytorch_fid.FIDInceptionC(768, channels_7x7=160)
    net.Mixed_6e = pytorch_fid.FIDInceptionC(768, channels_7x7=192)
    net.Mixed_7b = pytorch_fid.FIDInceptionE_1(1280)
    net.Mixed_7c = pytorch_fid.FIDInceptionE_2(2048)
    randomise_norms(net, torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        for layer in net.modules():
            if isinstance(layer, torch.nn.Conv2d):
                # torch's default init shrinks activations by ~sqrt(6) per layer; He's scale
                # keeps the deep features of order one, where relative errors mean something.
                layer.weight.mul_(6**0.5)
    return net.eval()


@contextlib.contextmanager
def pytorch_fid_weights(state_dict):
    """Inside the block, pytorch-fid's ``fid_inception_v3`` loads ``state_dict`` where it would
    download its FID weights: its ``InceptionV3`` and ``fid_score`` run offline."""
    from unittest import mock

    from pytorch_fid import inception as pytorch_fid

    with mock.patch.object(pytorch_fid, "load_state_dict_from_url", lambda *a, **k: state_dict):
        yield


def long_vit(**overrides) -> vit.ViT:
    """A one-layer ViT over 32 x 32 one-pixel patches: 1,025 tokens of 2 heads of 16."""
    return vit.ViT(
        num_classes=4, patch_size=1, width=32, depth=1, num_heads=2, image_size=32, **overrides
    )


def long_attention_programs(dtype=jnp.float32):
    """``{name: (function, abstract args)}``: the forward and the parameter gradient of a ViT
    (1,025 tokens), a VQGAN attention block (a 32 x 32 map: 1,024 tokens, one head of 32) and a
    GPT prior (512 tokens, causal), each tiny but long enough for the accelerator kernels;
    parameters and activations in ``dtype``. Abstract: for lowering, not running."""
    from attnjax.models.gpt import GPT
    from attnjax.models.vqgan import AttnBlock

    models = {
        "vit": (
            long_vit(),
            jax.ShapeDtypeStruct((2, 32, 32, 3), dtype),
        ),
        "vqgan_attention": (AttnBlock(), jax.ShapeDtypeStruct((2, 32, 32, 32), dtype)),
        "prior": (
            GPT(vocab_size=16, block_size=512, n_layer=1, n_head=2, n_embd=32),
            jax.ShapeDtypeStruct((2, 512), jnp.int32),
        ),
    }
    programs = {}
    for name, (model, x) in models.items():
        params = jax.eval_shape(model.init, jax.random.key(0), x)
        params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype), params)

        def loss(params, x, model=model):
            return jnp.sum(model.apply(params, x).astype(jnp.float32))

        programs[f"{name} forward"] = (functools.partial(_apply, model), (params, x))
        programs[f"{name} backward"] = (jax.grad(loss), (params, x))
    return programs


def _apply(model, params, x):
    return model.apply(params, x)


def lowered_text(function, args, platform):
    """The StableHLO of ``function`` lowered for ``platform`` alone, traced on this host."""
    traced = jax.jit(function).trace(*args)
    return traced.lower(lowering_platforms=(platform,)).as_text()


def pytorch_fid_statistics(state_dict, images, dims):
    """pytorch-fid's ``InceptionV3`` (``state_dict`` loaded by its own loader) on pixels
    ``[n, H, W, C]`` in [0, 1], gray repeated to RGB -> ``(mu, sigma)`` of its ``dims``
    features, computed as its ``get_activations`` and ``calculate_activation_statistics`` do."""
    import torch
    from pytorch_fid.inception import InceptionV3
    from torch.nn.functional import adaptive_avg_pool2d

    images = np.asarray(images, np.float32)
    if images.shape[-1] == 1:
        images = np.repeat(images, 3, axis=-1)
    with pytorch_fid_weights(state_dict):
        model = InceptionV3([InceptionV3.BLOCK_INDEX_BY_DIM[dims]]).eval()
    with torch.no_grad():
        features = model(torch.from_numpy(images.transpose(0, 3, 1, 2).copy()))[0]
    if features.shape[2] != 1 or features.shape[3] != 1:
        features = adaptive_avg_pool2d(features, output_size=(1, 1))
    features = features.squeeze(3).squeeze(2).numpy().astype(np.float64)
    return features.mean(axis=0), np.cov(features, rowvar=False)


def write_digits_folder(digits_dir, root):
    """The embedded digits as PNG files in torchvision's ImageFolder layout,
    ``root/<split>/<digit>/<index>.png`` (``index``: the digit's position in its split), for the
    splits train and test -> ``root``."""
    for split in ("train", "test"):
        source = data.load_source("digits", split, digits_dir)
        for i in range(len(source)):
            _write_digit(source[i], os.path.join(root, split), i)
    return str(root)


def write_digits_class_tree(digits_dir, root, count):
    """The first ``count`` training digits as PNG files in one class tree without split folders,
    ``root/<digit>/<index>.png``, so that training holds out a share of them -> ``root``."""
    source = data.load_source("digits", "train", digits_dir)
    for i in range(count):
        _write_digit(source[i], root, i)
    return str(root)


def _write_digit(record, root, index):
    from PIL import Image

    folder = os.path.join(root, str(int(record["label"])))
    os.makedirs(folder, exist_ok=True)
    Image.fromarray(np.asarray(record["image"])[..., 0]).save(
        os.path.join(folder, f"{index:04d}.png")
    )
