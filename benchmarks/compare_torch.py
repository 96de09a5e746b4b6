"""attnjax (jit) against PyTorch (eager) on the same workloads and weights, in one process.

    python benchmarks/compare_torch.py [--rows sdpa,vit_cifar_train] [--quick] [--repeats 5]

Each row builds the PyTorch reference (torch, timm, taming-transformers), converts its weights
with ``attnjax.convert`` where a converter exists, and times one step on each side: the
median of ``--repeats`` steps after one warm-up step. attnjax's compile time is reported apart.
torch runs with one intra-op thread per core (CUDA when available, as JAX then uses its GPU).
Peak memory per row: XLA's temporary buffers of the compiled step (``memory_analysis``) and the
process's resident-set growth during the row (``getrusage``; torch's allocations are in it).
Prints a table and writes ``benchmarks/results/compare_torch_<platform>.json`` with the machine
(CPU model, cores, jax/torch versions). ``--quick`` shrinks repeats and the largest rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import platform
import resource
import tempfile
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from timing import median_seconds

from attnjax.convert.common import make_torchvision_importable
from attnjax.convert.lpips import lpips_from_torch
from attnjax.convert.taming import (
    gpt_from_taming,
    nlayer_discriminator_from_taming,
    vqgan_from_taming,
)
from attnjax.convert.timm import vit_from_timm
from attnjax.convert.torch_nn import mha_from_torch
from attnjax.models import lpips, sampling, vit
from attnjax.ops import attention
from attnjax.train import parallel

make_torchvision_importable()  # timm and lpips import torchvision
DEVICE = "cpu"  # torch's device; main() makes it "cuda" when JAX runs on a GPU too
LEARNING_RATE = 1e-4


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


class Jax:
    """A jitted step ``fn(state, *inputs) -> state`` (or outputs), compiled once, timed after.

    With several devices (one per CPU core, or GPUs) the inputs are split over every device along
    the axis ``split`` names for each (default: axis 0 of all; ``None``: that input is replicated)
    and the state is replicated: data parallelism, as ``train.py`` runs (SDPA splits its heads).
    Where a split axis does not divide evenly, the step runs on one device.
    """

    def __init__(self, fn, state, *inputs, donate: bool = False, split=None):
        split = (0,) * len(inputs) if split is None else tuple(split)
        devices = jax.devices()
        sizes = [
            np.shape(leaf)[s]
            for x, s in zip(inputs, split)
            if s is not None
            for leaf in jax.tree.leaves(x)
        ]
        if len(devices) > 1 and sizes and all(n % len(devices) == 0 for n in sizes):
            mesh = jax.sharding.Mesh(np.array(devices), ("data",))
            P = jax.sharding.PartitionSpec
            place = lambda s: jax.sharding.NamedSharding(
                mesh, P() if s is None else P(*[None] * s, "data")
            )
            state = jax.device_put(state, place(None))
            inputs = tuple(jax.device_put(x, place(s)) for x, s in zip(inputs, split))
            self.devices = len(devices)
        else:
            self.devices = 1
        jitted = jax.jit(fn, donate_argnums=(0,) if donate else ())
        start = time.perf_counter()
        self.compiled = jitted.lower(state, *inputs).compile()
        self.compile_s = time.perf_counter() - start
        memory = self.compiled.memory_analysis()
        self.temp_mib = memory.temp_size_in_bytes / 2**20 if memory is not None else float("nan")
        self.state, self.inputs, self.carry = state, inputs, donate

    def __call__(self):
        out = self.compiled(self.state, *self.inputs)
        jax.block_until_ready(out)
        if self.carry:
            self.state = out


def _to_torch(x):
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x))).to(DEVICE)


def _nchw(x):
    return _to_torch(np.asarray(x).transpose(0, 3, 1, 2))


def _torch_train_step(module, loss_fn):
    optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn().backward()
        optimizer.step()
        _sync()

    return step


def _jax_train_step(loss_fn, params):
    tx = optax.adamw(LEARNING_RATE)

    def step(state, *inputs):
        params, opt_state = state
        grads = jax.grad(loss_fn)(params, *inputs)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, (params, tx.init(params))


def _inference(fn):
    def step():
        with torch.no_grad():
            fn()
        _sync()

    return step


# --------------------------------------------------------------------------------------------
# Rows: each returns (description, attnjax Jax step, torch step)
# --------------------------------------------------------------------------------------------


def sdpa(length):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, length, 64), dtype=np.float32) for _ in range(3))

    def grads(_, q, k, v):
        return jax.grad(
            lambda *a: jnp.sum(attention.scaled_dot_product_attention(*a, is_causal=True)),
            (0, 1, 2),
        )(q, k, v)

    leaves = [_to_torch(x).requires_grad_(True) for x in (q, k, v)]

    def torch_step():
        for t in leaves:
            t.grad = None
        torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True).sum().backward()
        _sync()

    return (
        f"SDPA fwd+bwd causal 1x8x{length}x64",
        Jax(grads, (), q, k, v, split=(1, 1, 1)),
        torch_step,
    )


def mha():
    torch.manual_seed(0)
    reference = torch.nn.MultiheadAttention(256, 8, batch_first=True).to(DEVICE)
    module, variables = mha_from_torch(reference.cpu())
    reference.to(DEVICE)
    x = np.random.default_rng(0).standard_normal((16, 256, 256), dtype=np.float32)
    tx = _to_torch(x)

    def loss(params, x):
        return jnp.sum(module.apply({"params": params}, x) ** 2)

    def torch_loss():
        return (reference(tx, tx, tx, need_weights=False)[0] ** 2).sum()

    step, state = _jax_train_step(loss, variables["params"])
    return (
        "MHA train step 16x256 tokens, 256 wide, 8 heads",
        Jax(step, state, x, donate=True),
        _torch_train_step(reference, torch_loss),
    )


def _timm_vit(config, image_size, num_classes):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(
        img_size=image_size,
        patch_size=config["patch_size"],
        embed_dim=config["width"],
        depth=config["depth"],
        num_heads=config["num_heads"],
        mlp_ratio=config["mlp_dim"] / config["width"],
        num_classes=num_classes,
        norm_layer=functools.partial(torch.nn.LayerNorm, eps=config.get("layer_norm_eps", 1e-6)),
    )


def vit_row(variant, image_size, batch, train, num_classes):
    config = vit.variant_config(variant)
    reference = _timm_vit(config, image_size, num_classes).eval()
    model, variables = vit_from_timm(reference, dropout_rate=0.0, attention_dropout_rate=0.0)
    reference.to(DEVICE)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((batch, image_size, image_size, 3)).astype(np.float32)
    labels = rng.integers(0, num_classes, batch)
    timages, tlabels = _nchw(images), _to_torch(labels)
    name = f"ViT {variant} {image_size}px {'train step (AdamW)' if train else 'inference'}, batch {batch}"
    if not train:

        def forward(params, images):
            return model.apply({"params": params}, images)

        return (
            name,
            Jax(forward, variables["params"], images),
            _inference(lambda: reference(timages)),
        )

    def loss(params, images, labels):
        logits = model.apply({"params": params}, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    step, state = _jax_train_step(loss, variables["params"])
    return (
        name,
        Jax(step, state, images, labels, donate=True),
        _torch_train_step(
            reference, lambda: torch.nn.functional.cross_entropy(reference(timages), tlabels)
        ),
    )


DDCONFIG = dict(
    ch=64,
    ch_mult=(1, 2, 2),
    num_res_blocks=2,
    attn_resolutions=(8,),
    in_channels=3,
    out_ch=3,
    resolution=32,
    z_channels=64,
    double_z=False,
    dropout=0.0,
)


def vqgan_autoencoder(batch):
    from taming.modules.diffusionmodules.model import Decoder, Encoder
    from taming.modules.vqvae.quantize import VectorQuantizer

    torch.manual_seed(0)
    reference = torch.nn.ModuleDict(
        dict(
            encoder=Encoder(**DDCONFIG),
            decoder=Decoder(**DDCONFIG),
            quantize=VectorQuantizer(512, 64, beta=0.25),
            quant_conv=torch.nn.Conv2d(64, 64, 1),
            post_quant_conv=torch.nn.Conv2d(64, 64, 1),
        )
    )
    model, variables = vqgan_from_taming(reference.state_dict(), DDCONFIG, 512, 64)
    reference.to(DEVICE)
    images = np.random.default_rng(0).uniform(-1, 1, (batch, 32, 32, 3)).astype(np.float32)
    timages = _nchw(images)

    def torch_loss():
        h = reference["quant_conv"](reference["encoder"](timages))
        quantized, codebook_loss, _ = reference["quantize"](h)
        rec = reference["decoder"](reference["post_quant_conv"](quantized))
        return (rec - timages).abs().mean() + codebook_loss

    vq_state = variables.get("vq_state", {})

    def loss(params, images):
        (rec, aux), _ = model.apply(
            {"params": params, "vq_state": vq_state}, images, train=True, mutable=["vq_state"]
        )
        return jnp.mean(jnp.abs(rec - images)) + aux["loss"]

    step, state = _jax_train_step(loss, variables["params"])
    return (
        f"VQGAN autoencoder train step 32px ch64 batch {batch}",
        Jax(step, state, images, donate=True),
        _torch_train_step(reference, torch_loss),
    )


def _patch_taming_lpips():
    """taming's LPIPS builds a random VGG16 trunk (no download) and loads the linear layers the
    ``lpips`` package ships (the file taming would fetch)."""
    import lpips as lpips_package
    import taming.modules.losses.lpips as taming_lpips
    import torchvision

    shipped = os.path.join(os.path.dirname(lpips_package.__file__), "weights", "v0.1", "vgg.pth")
    taming_lpips.models = types.SimpleNamespace(
        vgg16=lambda pretrained: torchvision.models.vgg16(weights=None)
    )
    taming_lpips.LPIPS.load_from_pretrained = lambda self, name="vgg_lpips": self.load_state_dict(
        torch.load(shipped, map_location="cpu", weights_only=True), strict=False
    )


def vqgan_gan_step(batch, directory):
    """Generator + discriminator step with LPIPS (attnjax.tasks.vqgan vs VQLPIPSWithDiscriminator).

    Both sides start from the same weights: taming's random autoencoder, discriminator and LPIPS
    (random VGG16 trunk, shipped linear layers) are converted into the attnjax train state.
    """
    import ml_collections
    from taming.modules.diffusionmodules.model import Decoder, Encoder
    from taming.modules.losses.vqperceptual import VQLPIPSWithDiscriminator
    from taming.modules.vqvae.quantize import VectorQuantizer

    from attnjax.tasks import vqgan

    _patch_taming_lpips()
    torch.manual_seed(0)
    autoencoder = torch.nn.ModuleDict(
        dict(
            encoder=Encoder(**DDCONFIG),
            decoder=Decoder(**DDCONFIG),
            quantize=VectorQuantizer(512, 64, beta=0.25),
            quant_conv=torch.nn.Conv2d(64, 64, 1),
            post_quant_conv=torch.nn.Conv2d(64, 64, 1),
        )
    )
    loss = VQLPIPSWithDiscriminator(
        disc_start=0, disc_weight=0.8, disc_in_channels=3, disc_num_layers=3, disc_ndf=64
    )
    _, ae_variables = vqgan_from_taming(autoencoder.state_dict(), DDCONFIG, 512, 64)
    _, disc_variables = nlayer_discriminator_from_taming(loss.discriminator.state_dict())
    _, lpips_variables = lpips_from_torch(loss.perceptual_loss.state_dict())
    lpips_path = lpips.save_variables(
        lpips_variables, os.path.join(directory, "lpips_random_vgg.npz")
    )
    autoencoder.to(DEVICE), loss.to(DEVICE)

    config = ml_collections.ConfigDict(
        dict(
            seed=0,
            model=dict(
                ddconfig=DDCONFIG, n_embed=512, embed_dim=64, beta=0.25, quantizer=dict(legacy=True)
            ),
            loss=dict(
                disc_start=0,
                disc_weight=0.8,
                disc_factor=1.0,
                disc_loss="hinge",
                codebook_weight=1.0,
                perceptual_weight=1.0,
            ),
            discriminator=dict(ndf=64, n_layers=3, norm="batch"),
            lpips=dict(weights=lpips_path),
            optimizer="adamw",
            learning_rate=LEARNING_RATE,
            disc_learning_rate=LEARNING_RATE,
            warmup_steps=0,
            min_lr_ratio=1.0,
            weight_decay=0.0,
            b1=0.5,
            b2=0.9,
            grad_clip_norm=0.0,
            grad_accum_steps=1,
            num_train_steps=1000,
            reseed_threshold=0.0,
        )
    )
    model = vqgan.create_model(config)
    images = np.random.default_rng(0).uniform(-1, 1, (batch, 32, 32, 3)).astype(np.float32)
    state = vqgan.create_train_state(jax.random.PRNGKey(0), config, model, {"image": images})
    params = {"autoencoder": ae_variables["params"], "discriminator": disc_variables["params"]}
    # Fresh Adam moments are zeros of the parameters' shapes, so the initial optimiser states
    # already fit the converted weights; only the tree layout must agree.
    if jax.tree.structure(params) != jax.tree.structure(state.params):
        raise ValueError(
            "vqgan_gan_step: converted taming weights do not match the task's parameter tree"
        )
    state = state.replace(
        **jax.tree.map(
            jnp.asarray,
            dict(
                params=params,
                batch_stats=disc_variables["batch_stats"],
                quantizer_state=ae_variables.get("vq_state", {}),
            ),
        )
    )
    jax_step = functools.partial(vqgan.train_step, config=config, model=model)

    ae_opt = torch.optim.Adam(autoencoder.parameters(), lr=LEARNING_RATE, betas=(0.5, 0.9))
    d_opt = torch.optim.Adam(loss.discriminator.parameters(), lr=LEARNING_RATE, betas=(0.5, 0.9))
    timages = _nchw(images)
    last_layer = autoencoder["decoder"].conv_out.weight

    def torch_step():
        quantized, codebook_loss, _ = autoencoder["quantize"](
            autoencoder["quant_conv"](autoencoder["encoder"](timages))
        )
        rec = autoencoder["decoder"](autoencoder["post_quant_conv"](quantized))
        ae_opt.zero_grad(set_to_none=True)
        g_loss, _ = loss(codebook_loss, timages, rec, 0, 10, last_layer=last_layer, split="train")
        g_loss.backward()
        ae_opt.step()
        d_opt.zero_grad(set_to_none=True)
        d_loss, _ = loss(
            codebook_loss, timages, rec.detach(), 1, 10, last_layer=last_layer, split="train"
        )
        d_loss.backward()
        d_opt.step()
        _sync()

    def step(state, batch, rng):
        return jax_step(state, batch, rng)[0]

    return (
        f"VQGAN GAN step (disc + LPIPS) 32px ch64 batch {batch}, same weights",
        Jax(step, state, {"image": images}, jax.random.PRNGKey(1), donate=True, split=(0, None)),
        torch_step,
    )


def _taming_gpt(n_layer, n_embd, block_size, vocab):
    from taming.modules.transformer import mingpt

    torch.manual_seed(0)
    return mingpt.GPT(vocab, block_size, n_layer=n_layer, n_head=8, n_embd=n_embd)


def gpt_train(batch, length):
    reference = _taming_gpt(8, 256, length, 1024)
    model, variables = gpt_from_taming(reference.state_dict(), n_head=8)
    reference.to(DEVICE).train()
    tokens = np.random.default_rng(0).integers(0, 1024, (batch, length + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    tinputs, ttargets = _to_torch(inputs), _to_torch(targets)

    def loss(params, inputs, targets):
        logits = model.apply({"params": params}, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def torch_loss():
        logits, _ = reference(tinputs)
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ttargets.reshape(-1)
        )

    step, state = _jax_train_step(loss, variables["params"])
    return (
        f"GPT train step 8 layers x 256, length {length}, batch {batch}",
        Jax(step, state, inputs, targets, donate=True),
        _torch_train_step(reference, torch_loss),
    )


def gpt_sample(batch, steps):
    from taming.modules.transformer import mingpt

    reference = _taming_gpt(8, 256, steps + 1, 1024)
    model, variables = gpt_from_taming(reference.state_dict(), n_head=8)
    reference.to(DEVICE).eval()
    prefix = np.random.default_rng(0).integers(0, 1024, (batch, 1))
    tprefix = _to_torch(prefix)

    def sample(params, prefix, rng):
        return sampling.sample(model, params, prefix, rng, steps, temperature=1.0, top_k=100)

    torch_step = _inference(
        lambda: mingpt.sample(reference, tprefix, steps, temperature=1.0, sample=True, top_k=100)
    )
    return (
        f"GPT sampling {steps} tokens, batch {batch} (KV cache vs taming's loop)",
        Jax(sample, variables["params"], prefix, jax.random.PRNGKey(0), split=(0, None)),
        torch_step,
    )


def add_cpu_devices_flag(parser):
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        help="XLA:CPU devices attnjax splits a batch over (0: one per core; 1: one device)",
    )


def use_devices(cpu_devices: int):
    """Before anything touches a JAX device: ``cpu_devices`` XLA:CPU devices (0: one per core),
    as train.py gives itself (attnjax.train.parallel: XLA:CPU runs a convolution on one thread); torch
    on CUDA when JAX runs on a GPU."""
    if cpu_devices < 0:
        raise ValueError(f"--cpu-devices={cpu_devices} must be >= 0 (0: one per core)")
    parallel.set_cpu_devices(cpu_devices or parallel.cpu_cores())
    global DEVICE
    DEVICE = "cuda" if torch.cuda.is_available() and jax.default_backend() == "gpu" else "cpu"


def rows(quick, directory):
    """Row name -> thunk building (description, attnjax step, torch step)."""
    return {
        "sdpa_1024": lambda: sdpa(1024),
        "sdpa_4096": lambda: sdpa(1024 if quick else 4096),
        "mha": mha,
        "vit_cifar_train": lambda: vit_row("cifar", 32, 32 if quick else 128, True, 10),
        "vit_cifar_infer": lambda: vit_row("cifar", 32, 64 if quick else 256, False, 10),
        "vit_ti16_train": lambda: vit_row("Ti/16", 224, 2 if quick else 8, True, 1000),
        "vit_b16_infer": lambda: vit_row("B/16", 224, 2 if quick else 8, False, 1000),
        "vqgan_autoencoder": lambda: vqgan_autoencoder(4 if quick else 16),
        "vqgan_gan_step": lambda: vqgan_gan_step(4 if quick else 16, directory),
        "gpt_train": lambda: gpt_train(4 if quick else 16, 64 if quick else 256),
        "gpt_sample": lambda: gpt_sample(4 if quick else 16, 32 if quick else 256),
    }


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
            )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "jax_device": jax.devices()[0].device_kind,
        "jax_device_count": jax.device_count(),
        "torch": torch.__version__,
        "torch_device": DEVICE if DEVICE == "cpu" else torch.cuda.get_device_name(),
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    parser.add_argument(
        "--quick", action="store_true", help="small sizes and 2 repeats: a smoke run"
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=None)
    add_cpu_devices_flag(parser)
    args = parser.parse_args()
    use_devices(args.cpu_devices)
    torch.set_num_threads(os.cpu_count())
    repeats = args.repeats or (2 if args.quick else 5)

    meta = machine()
    out = pathlib.Path(
        args.out
        or pathlib.Path(__file__).parent / "results" / f"compare_torch_{jax.default_backend()}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as directory:
        table = rows(args.quick, directory)
        names = [n for n in args.rows.split(",") if n] or list(table)
        unknown = sorted(set(names) - set(table))
        if unknown:
            raise ValueError(f"--rows: unknown rows {unknown}; expected names from {sorted(table)}")
        for name in names:
            rss_before = _rss_mib()
            description, jax_step, torch_step = table[name]()
            jax_step(), torch_step()  # warm-up
            jax_ms, torch_ms = (
                1e3 * median_seconds(jax_step, repeats),
                1e3 * median_seconds(torch_step, repeats),
            )
            row = dict(
                row=name,
                workload=description,
                attnjax_ms=jax_ms,
                torch_ms=torch_ms,
                speedup=torch_ms / jax_ms,
                attnjax_devices=jax_step.devices,
                attnjax_compile_s=jax_step.compile_s,
                attnjax_xla_temp_mib=jax_step.temp_mib,
                rss_growth_mib=_rss_mib() - rss_before,
            )
            results.append(row)
            # Written after every row, so an interrupted run keeps the rows it finished.
            out.write_text(
                json.dumps(
                    {"machine": meta, "quick": args.quick, "repeats": repeats, "rows": results},
                    indent=2,
                )
            )
            print(
                f"{name:18s} attnjax {jax_ms:9.1f} ms  torch {torch_ms:9.1f} ms  "
                f"torch/attnjax {row['speedup']:5.2f}  ({jax_step.devices} device(s), compile "
                f"{jax_step.compile_s:.1f} s)",
                flush=True,
            )

    print(
        f"\nattnjax jit vs torch eager on {meta['cpu']} ({meta['cores']} cores, torch threads "
        f"{meta['torch_threads']}), jax {meta['jax']} {meta['jax_backend']}, torch {meta['torch']} {DEVICE}; "
        f"median of {repeats} after warm-up\n"
    )
    print(
        "| workload | attnjax ms | torch ms | torch / attnjax | attnjax devices | compile s | XLA temp MiB | RSS growth MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['workload']} | {r['attnjax_ms']:.1f} | {r['torch_ms']:.1f} | {r['speedup']:.2f} | {r['attnjax_devices']} | "
            f"{r['attnjax_compile_s']:.1f} | {r['attnjax_xla_temp_mib']:.0f} | {r['rss_growth_mib']:.0f} |"
        )
    speedups = [r["speedup"] for r in results]
    print(f"\ngeometric mean torch / attnjax: {float(np.exp(np.mean(np.log(speedups)))):.2f}")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
