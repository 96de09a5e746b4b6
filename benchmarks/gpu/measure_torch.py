"""PyTorch's side of the GPU check (benchmarks/gpu/check.py): the work of ``measure.py``'s rows
in the code attnjax's users would otherwise run, on the same GPU in the same call, one function
per part: ``PARTS[name](dry_run, emit) -> dict``.

* ``torch_vit``: timm's ``vit_base_patch16_224`` trained as ``measure.vit`` trains ViT-B/16 (batch
  256, SGD with momentum 0.9, clipping at global norm 1, cross-entropy) under bf16 autocast,
  eager and ``torch.compile``-d.
* ``torch_vqgan``: taming's f16 autoencoder (``Encoder``, ``Decoder``, ``VectorQuantizer``) and
  ``VQLPIPSWithDiscriminator`` (random VGG16 and LPIPS weights: nothing can be downloaded), the
  autoencoder's and the discriminator's Adam steps of one batch as taming's ``VQModel`` takes
  them, under bf16 autocast with the quantizer in float32 (as attnjax keeps it). One autoencoder
  forward serves both steps, where Lightning's loop would run it twice: the faster PyTorch.
* ``torch_sampling``: taming's ``mingpt.GPT`` of ``prior_cifar10.py``'s size sampled with a
  static KV cache (``torch_sampler.py``: one token's step attends to the cache, as gpt-fast
  does), classifier-free guidance, top-k and temperature as attnjax's sampler; eager, and the
  step captured once in a CUDA graph and replayed for every token.

``dry_run`` runs the same code at tiny sizes on the CPU (``torch.compile`` with its ``eager``
backend there: no C++ compiler is needed, the wrapping is still exercised).
"""

from __future__ import annotations

import math
import time
import types

import measure_profile
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch_sampler import CachedSampler, GraphSampler, prefixes, sample_eager, sampling_model

# The sizes of measure.py's rows, so that each row's two sides do the same work.
VIT = {
    "gpu": dict(batch=256, image=224, steps=30, warmup=3, profiled=3,
                timm="vit_base_patch16_224"),
    "dry-run": dict(batch=4, image=32, steps=3, warmup=1, profiled=2,
                    model=dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                               mlp_ratio=2.0)),
}  # fmt: skip
VIT_RECIPE = dict(learning_rate=0.03, momentum=0.9, clip_norm=1.0, num_classes=1000)
VQGAN = {
    "gpu": dict(batch=16, steps=10, warmup=2, perceptual_weight=1.0,
                ddconfig=dict(ch=128, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2,
                              attn_resolutions=(16,), in_channels=3, out_ch=3, resolution=256,
                              z_channels=256, double_z=False, dropout=0.0),
                n_embed=1024, embed_dim=256, ndf=64, disc_layers=3),
    "dry-run": dict(batch=2, steps=2, warmup=1, perceptual_weight=0.0,
                    ddconfig=dict(ch=32, ch_mult=(1,), num_res_blocks=0, attn_resolutions=(),
                                  in_channels=3, out_ch=3, resolution=16, z_channels=8,
                                  double_z=False, dropout=0.0),
                    n_embed=16, embed_dim=8, ndf=8, disc_layers=1),
}  # fmt: skip
# configs/vqgan_imagenet_f16.py's loss and optimiser settings (taming's).
VQGAN_RECIPE = dict(disc_start=250001, disc_weight=0.8, codebook_weight=1.0, beta=0.25,
                    learning_rate=4.5e-6 * 12, betas=(0.5, 0.9))  # fmt: skip
# prior_cifar10.py's GPT over the f16 VQGAN's 16 x 16 grid of 1024 codes, 10 classes and the null
# class; top-k 100, temperature 1, guidance 1.5 (measure.prior_sampling).
SAMPLING = {
    "gpu": dict(batch=32, calls=3, n_layer=12, n_head=8, n_embd=512, codes=1024, grid=16,
                top_k=100),
    "dry-run": dict(batch=2, calls=2, n_layer=1, n_head=2, n_embd=32, codes=16, grid=16, top_k=8),
}  # fmt: skip
SAMPLING_RECIPE = dict(num_classes=10, temperature=1.0, guidance=1.5)


def _mode(dry_run: bool) -> str:
    return "dry-run" if dry_run else "gpu"


def _device(dry_run: bool) -> torch.device:
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("no GPU: torch.cuda.is_available() is False")
    return torch.device("cuda")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def device_info(dry_run: bool) -> dict:
    device = _device(dry_run)
    info = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        info.update(
            name=torch.cuda.get_device_name(),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
        )
    return info


def _seconds_since(start: float, device: torch.device) -> float:
    _sync(device)
    return time.perf_counter() - start


def time_steps(step, steps: int, warmup: int, device: torch.device, batch_size: int) -> dict:
    """``step()`` -> loss tensor, run ``warmup`` times (the first timed alone: PyTorch's first
    step pays for cuDNN's algorithm choice, CUDA's lazy loading and, compiled, the compile) and
    then ``steps`` times; losses read after the clock stops."""
    start = time.perf_counter()
    losses = [step()]
    first = _seconds_since(start, device)
    for _ in range(warmup - 1):
        losses.append(step())
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        losses.append(step())
    seconds = _seconds_since(start, device)
    values = [float(loss) for loss in losses]
    if not all(math.isfinite(v) for v in values):
        raise FloatingPointError(f"non-finite losses: {values}")
    return {
        "batch_size": batch_size,
        "steps": steps,
        "warmup_steps": warmup,
        "seconds": seconds,
        "images_per_second": steps * batch_size / seconds,
        "first_step_seconds": first,
        "losses": values,
    }


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# ViT-B/16: timm, eager and compiled
# ---------------------------------------------------------------------------------------------


def _importable_torchvision() -> None:
    """timm and taming's LPIPS import torchvision (see ``make_torchvision_importable``)."""
    from attnjax.convert.common import make_torchvision_importable

    make_torchvision_importable()


def _vit_model(sizes: dict):
    _importable_torchvision()
    import timm
    from timm.models.vision_transformer import VisionTransformer

    classes = VIT_RECIPE["num_classes"]
    if "timm" in sizes:
        return timm.create_model(sizes["timm"], num_classes=classes)
    return VisionTransformer(num_classes=classes, **sizes["model"])


def vit_training(sizes: dict, device: torch.device, compiled: bool, dry_run: bool) -> dict:
    torch.manual_seed(0)
    model = _vit_model(sizes).to(device).train()
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=VIT_RECIPE["learning_rate"],
        momentum=VIT_RECIPE["momentum"],
        **({"fused": True} if device.type == "cuda" else {}),
    )
    forward = model
    if compiled:
        forward = torch.compile(model, backend="eager" if dry_run else "inductor")
    generator = torch.Generator().manual_seed(1)
    shape = (sizes["batch"], 3, sizes["image"], sizes["image"])
    images = (torch.rand(shape, generator=generator) * 2 - 1).to(device)
    labels = torch.randint(0, VIT_RECIPE["num_classes"], (sizes["batch"],), generator=generator)
    labels = labels.to(device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with _autocast(device):
            logits = forward(images)
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), VIT_RECIPE["clip_norm"], foreach=True)
        optimizer.step()
        return loss.detach()

    result = time_steps(step, sizes["steps"], sizes["warmup"], device, sizes["batch"])
    result["compiled"] = (
        {"backend": "eager" if dry_run else "inductor", "mode": "default"} if compiled else None
    )
    result["profile"] = None
    if compiled:
        try:  # a profiler that fails must not cost the row its measurement
            result["profile"] = profile_steps(step, sizes["profiled"], device)
        except Exception as error:
            result["profile"] = {"error": f"{type(error).__name__}: {error}"[:300]}
    return result


def profile_steps(step, steps: int, device: torch.device) -> dict:
    """``steps`` calls of ``step`` under ``torch.profiler`` -> ``measure_profile.summary`` of the
    CUDA kernels' times (on a CPU: the operators' own times)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as recorded:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        seconds = _seconds_since(start, device)
    microseconds: dict[str, float] = {}
    for event in recorded.events():
        if on_gpu:
            if event.device_type != DeviceType.CUDA:
                continue
            spent = event.time_range.elapsed_us()
        else:
            spent = event.self_cpu_time_total
        microseconds[event.name] = microseconds.get(event.name, 0.0) + spent
    lanes = ["CUDA kernels" if on_gpu else "CPU operators (own time)"]
    return measure_profile.summary(microseconds, steps, seconds / steps, lanes)


def torch_vit(dry_run: bool, emit) -> dict:
    sizes = VIT[_mode(dry_run)]
    device = _device(dry_run)
    result = {
        "model": sizes.get("timm", "timm VisionTransformer " + str(sizes.get("model"))),
        "recipe": VIT_RECIPE,
        "autocast": "bfloat16",
        "device": device_info(dry_run),
    }
    result["eager"] = vit_training(sizes, device, compiled=False, dry_run=dry_run)
    _free(device)  # the eager row's model and optimiser, gone with its function
    emit(result)
    result["compiled"] = vit_training(sizes, device, compiled=True, dry_run=dry_run)
    return result


# ---------------------------------------------------------------------------------------------
# The f16 VQGAN: taming's modules and loss
# ---------------------------------------------------------------------------------------------


def taming_loss(sizes: dict):
    """taming's ``VQLPIPSWithDiscriminator`` with the recipe's settings; its two downloads (VGG16,
    the LPIPS heads) replaced by random weights."""
    _importable_torchvision()  # taming's LPIPS imports it
    import taming.modules.losses.lpips as taming_lpips
    import torchvision
    from taming.modules.losses.vqperceptual import VQLPIPSWithDiscriminator

    models, load = taming_lpips.models, taming_lpips.LPIPS.load_from_pretrained
    # taming calls torchvision.models.vgg16(pretrained=True) through this name.
    taming_lpips.models = types.SimpleNamespace(
        vgg16=lambda pretrained: torchvision.models.vgg16(weights=None)
    )
    taming_lpips.LPIPS.load_from_pretrained = lambda self, name="vgg_lpips": None
    try:
        return VQLPIPSWithDiscriminator(
            disc_start=VQGAN_RECIPE["disc_start"],
            codebook_weight=VQGAN_RECIPE["codebook_weight"],
            disc_num_layers=sizes["disc_layers"],
            disc_in_channels=3,
            disc_ndf=sizes["ndf"],
            disc_weight=VQGAN_RECIPE["disc_weight"],
            perceptual_weight=sizes["perceptual_weight"],
        )
    finally:
        taming_lpips.models, taming_lpips.LPIPS.load_from_pretrained = models, load


class TamingAutoencoder(nn.Module):
    """taming's ``VQModel`` without Lightning: encode, quantize (float32), decode."""

    def __init__(self, ddconfig: dict, n_embed: int, embed_dim: int):
        super().__init__()
        from taming.modules.diffusionmodules.model import Decoder, Encoder
        from taming.modules.vqvae.quantize import VectorQuantizer

        self.encoder = Encoder(**ddconfig)
        self.decoder = Decoder(**ddconfig)
        self.quantize = VectorQuantizer(n_embed, embed_dim, beta=VQGAN_RECIPE["beta"])
        self.quant_conv = nn.Conv2d(ddconfig["z_channels"], embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(embed_dim, ddconfig["z_channels"], 1)

    def forward(self, x):
        h = self.quant_conv(self.encoder(x))
        with torch.autocast(x.device.type, enabled=False):
            quant, codebook_loss, _ = self.quantize(h.float())
        return self.decoder(self.post_quant_conv(quant)), codebook_loss


def vqgan_training(sizes: dict, device: torch.device) -> dict:
    torch.manual_seed(0)
    autoencoder = TamingAutoencoder(sizes["ddconfig"], sizes["n_embed"], sizes["embed_dim"])
    autoencoder = autoencoder.to(device).train()
    loss = taming_loss(sizes).to(device).train()
    loss.perceptual_loss.eval()
    adam = dict(lr=VQGAN_RECIPE["learning_rate"], betas=VQGAN_RECIPE["betas"])
    if device.type == "cuda":
        adam["fused"] = True
    opt_ae = torch.optim.Adam(autoencoder.parameters(), **adam)
    opt_disc = torch.optim.Adam(loss.discriminator.parameters(), **adam)
    last_layer = autoencoder.decoder.conv_out.weight
    generator = torch.Generator().manual_seed(1)
    size = sizes["ddconfig"]["resolution"]
    images = (torch.rand((sizes["batch"], 3, size, size), generator=generator) * 2 - 1).to(device)
    global_step = [0]

    def step():
        with _autocast(device):
            reconstructions, codebook_loss = autoencoder(images)
            ae_loss, _ = loss(codebook_loss, images, reconstructions, 0, global_step[0],
                              last_layer=last_layer)  # fmt: skip
        opt_ae.zero_grad(set_to_none=True)
        ae_loss.backward()
        opt_ae.step()
        with _autocast(device):
            disc_loss, _ = loss(codebook_loss, images, reconstructions.detach(), 1,
                                global_step[0], last_layer=last_layer)  # fmt: skip
        opt_disc.zero_grad(set_to_none=True)
        disc_loss.backward()
        opt_disc.step()
        global_step[0] += 1
        return ae_loss.detach()

    return time_steps(step, sizes["steps"], sizes["warmup"], device, sizes["batch"])


def torch_vqgan(dry_run: bool, emit) -> dict:
    sizes = VQGAN[_mode(dry_run)]
    device = _device(dry_run)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # what a PyTorch user training convolutions sets
    result = {
        "model": "taming.modules Encoder/Decoder/VectorQuantizer + VQLPIPSWithDiscriminator",
        "sizes": {k: v for k, v in sizes.items() if k not in ("steps", "warmup")},
        "recipe": VQGAN_RECIPE,
        "autocast": "bfloat16 (the quantizer in float32)",
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "device": device_info(dry_run),
    }
    result["eager"] = vqgan_training(sizes, device)
    return result


# ---------------------------------------------------------------------------------------------
# The prior's sampler: taming's GPT with a static KV cache
# ---------------------------------------------------------------------------------------------


def _time_sampler(sample, prefix, tokens: int, calls: int, device) -> dict:
    start = time.perf_counter()
    codes = sample(prefix, tokens)
    first = _seconds_since(start, device)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        codes = sample(prefix, tokens)
        times.append(_seconds_since(start, device))
    codes = codes.cpu().numpy()
    seconds = float(np.median(times))
    return {
        "first_call_seconds": first,
        "calls": calls,
        "seconds_per_call": seconds,
        "tokens_per_second": codes.size / seconds,
        "codes_min": int(codes.min()),
        "codes_max": int(codes.max()),
    }


def torch_sampling(dry_run: bool, emit) -> dict:
    sizes = SAMPLING[_mode(dry_run)]
    device = _device(dry_run)
    # attnjax's float32 products on a GPU take TensorFloat-32 (XLA's default precision there);
    # PyTorch's default would be full float32.
    torch.set_float32_matmul_precision("high")
    torch.manual_seed(0)
    classes = SAMPLING_RECIPE["num_classes"]
    model = sampling_model(sizes, classes).to(device).eval()
    tokens = sizes["grid"] ** 2
    prefix = prefixes(sizes, classes, device)
    sampler = CachedSampler(model, prefix.shape[0], tokens, sizes["top_k"],
                            SAMPLING_RECIPE["temperature"], SAMPLING_RECIPE["guidance"],
                            sizes["codes"])  # fmt: skip
    result = {
        "model": {k: sizes[k] for k in ("n_layer", "n_head", "n_embd")},
        "recipe": {**SAMPLING_RECIPE, "top_k": sizes["top_k"]},
        "batch": sizes["batch"],
        "rows": int(prefix.shape[0]),
        "tokens_per_call": sizes["batch"] * tokens,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "device": device_info(dry_run),
    }
    result["eager"] = _time_sampler(
        lambda p, n: sample_eager(sampler, p, n), prefix, tokens, sizes["calls"], device
    )
    emit(result)
    if device.type == "cuda":
        start = time.perf_counter()
        graph = GraphSampler(sampler, prefix)
        capture = _seconds_since(start, device)
        result["cuda_graph"] = _time_sampler(graph.sample, prefix, tokens, sizes["calls"], device)
        result["cuda_graph"]["capture_seconds"] = capture
        result["cuda_graph"]["first_call_seconds"] += capture
    else:
        result["cuda_graph"] = {"status": "not on this platform"}
    return result


PARTS = {
    "torch_vit": torch_vit,
    "torch_vqgan": torch_vqgan,
    "torch_sampling": torch_sampling,
}
