"""Memory per device under data parallelism vs FSDP, computed from the models' shapes.

    python benchmarks/memory_table.py [--devices 8 64 256] [--json benchmarks/results/memory.json]

For ViT-B/16, ViT-L/16, ViT-H/14 (ImageNet, 224 px, 1000 classes), taming's ImageNet VQGAN f16
(``configs/vqgan_imagenet_f16.py``: autoencoder + PatchGAN discriminator, two Adam optimisers)
and a 1.4B-parameter GPT prior (taming's cin transformer: 48 layers x 1536 wide, 24 heads,
vocab 16384 codes + 1000 classes, block 256 + 1):

* parameters and optimiser bytes: ``jax.eval_shape`` of the task's own ``create_train_state``
  (no array is allocated), optimiser = AdamW (two float32 moments per parameter);
* activations per example: XLA's temporary buffers (``memory_analysis().temp_size_in_bytes``)
  of the compiled forward + backward at batch 1, float32, on this machine's backend. For the
  layered models the full depth is extrapolated from compiled 1- and 2-layer models
  (``act(L) = act(1) + (L - 1) * (act(2) - act(1))``); with per-block remat the backward keeps
  each block's input ``[tokens, width]`` and recomputes one block at a time:
  ``act_remat(L) = act(1) + (L - 1) * tokens * width * 4`` bytes. The VQGAN is compiled whole,
  without remat: XLA:CPU's schedule keeps the recomputed activations alive, so a compiled remat
  figure says nothing here (docs/scaling.md); ``benchmarks/largest_batch.py``'s H100 programs
  have the VQGAN's;
* model state per device = parameters + gradients + optimiser state (16 bytes per parameter
  with AdamW); data parallelism holds all of it on every device, FSDP ``1 / devices`` of it;
* examples / device: the largest per-device batch whose activations (with remat where the
  model has it) fit beside the model state in 16 GiB / 80 GiB; "no" = not even one.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import configs
from attnjax.models import gpt, vit
from attnjax.tasks import classification, vqgan
from attnjax.train import optim

GIB = 2**30
CAPACITIES_GIB = (16, 80)
GPT_1_4B = dict(vocab_size=16384 + 1000, block_size=256 + 1, n_layer=48, n_head=24, n_embd=1536)


def tree_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def tree_size(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def temp_bytes(loss, params, inputs) -> int:
    """Temporary buffers of the compiled ``grad(loss)(params, inputs)`` (shapes only)."""
    compiled = jax.jit(jax.grad(loss)).lower(params, inputs).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def adamw_config():
    return ml_collections.ConfigDict(
        dict(
            optimizer="adamw",
            learning_rate=1e-3,
            warmup_steps=0,
            num_train_steps=1000,
            weight_decay=0.05,
            grad_clip_norm=1.0,
        )
    )


def vit_row(name, variant, image_size):
    config = adamw_config()
    config.model = ml_collections.ConfigDict(
        dict(variant=variant, num_classes=1000, image_size=image_size, scan_layers=False)
    )
    model = classification.create_model(config)
    example = {"image": jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32)}
    state = jax.eval_shape(
        lambda r, ex: classification.create_train_state(r, config, model, ex),
        jax.random.PRNGKey(0),
        example,
    )

    def layered(depth):
        small = vit.create_vit(variant, num_classes=1000, image_size=image_size, depth=depth)
        params = jax.eval_shape(
            lambda r, x: small.init(r, x, train=False), jax.random.PRNGKey(0), example["image"]
        )["params"]
        loss = lambda p, x: small.apply({"params": p}, x, train=False).sum()  # noqa: E731
        return temp_bytes(loss, params, example["image"])

    tokens = (image_size // model.patch_size) ** 2 + 1
    return _layered_row(
        name, state.params, state.opt_state, layered, model.depth, tokens * model.width * 4
    )


def gpt_row(name):
    model = gpt.GPT(**GPT_1_4B)
    indices = jax.ShapeDtypeStruct((1, GPT_1_4B["block_size"]), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), indices)["params"]
    opt_state = jax.eval_shape(optim.make_optimizer(adamw_config()).init, params)

    def layered(depth):
        small = gpt.GPT(**{**GPT_1_4B, "n_layer": depth})
        small_params = jax.eval_shape(small.init, jax.random.PRNGKey(0), indices)["params"]
        loss = lambda p, x: small.apply({"params": p}, x).sum()  # noqa: E731
        return temp_bytes(loss, small_params, indices)

    return _layered_row(
        name,
        params,
        opt_state,
        layered,
        GPT_1_4B["n_layer"],
        GPT_1_4B["block_size"] * GPT_1_4B["n_embd"] * 4,
    )


def _layered_row(name, params, opt_state, layered, depth, block_input_bytes):
    one, two = layered(1), layered(2)
    per_layer = two - one
    return dict(
        model=name,
        parameters=tree_size(params),
        param_bytes=tree_bytes(params),
        optimizer_bytes=tree_bytes(opt_state),
        activation_bytes=one + (depth - 1) * per_layer,
        activation_bytes_remat=one + (depth - 1) * block_input_bytes,
    )


def vqgan_row(name):
    config = configs.load("vqgan_imagenet_f16")
    model = vqgan.create_model(config)
    size = config.model.ddconfig.resolution
    images = jax.ShapeDtypeStruct((1, size, size, 3), jnp.float32)
    state = jax.eval_shape(
        lambda r, ex: vqgan.create_train_state(r, config, model, ex),
        jax.random.PRNGKey(0),
        {"image": images},
    )
    params = {
        "autoencoder": state.params["autoencoder"],
        "discriminator": state.params["discriminator"],
    }
    opt_state = (state.opt_state, getattr(state, "disc_opt_state", None))

    def loss(p, inputs):
        x, vq_state, batch_stats = inputs
        reconstruction, _ = model["autoencoder"].apply(
            {"params": p["autoencoder"], "vq_state": vq_state}, x, mutable=["vq_state"]
        )[0]
        logits = model["discriminator"].apply(
            {"params": p["discriminator"], "batch_stats": batch_stats}, reconstruction, train=False
        )
        return jnp.sum(reconstruction) + jnp.sum(logits)

    inputs = (images, state.quantizer_state or {}, state.batch_stats)
    return dict(
        model=name,
        parameters=tree_size(params),
        param_bytes=tree_bytes(params),
        optimizer_bytes=tree_bytes(opt_state),
        activation_bytes=temp_bytes(loss, params, inputs),
        activation_bytes_remat=None,  # XLA:CPU's schedule: see the module docstring
    )


def per_device(row, devices: int, fsdp: bool) -> int:
    """Parameters + gradients + optimiser state held by one device."""
    state = 2 * row["param_bytes"] + row["optimizer_bytes"]
    return -(-state // devices) if fsdp else state


def examples_that_fit(row, devices, fsdp, capacity_gib) -> int:
    """Largest per-device batch whose activations (remat where available) fit beside the
    model state; 0: not even one example."""
    activations = row["activation_bytes_remat"] or row["activation_bytes"]
    return max(0, (capacity_gib * GIB - per_device(row, devices, fsdp)) // activations)


def format_table(rows, device_counts) -> str:
    gib = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    layouts = "DP / " + " / ".join(f"FSDP x{n}" for n in device_counts)
    lines = [
        "| model | parameters | params GiB | AdamW GiB | activations / example GiB "
        "(no remat / remat) | DP GiB / device | "
        + " | ".join(f"FSDP x{n} GiB / device" for n in device_counts)
        + "".join(f" | examples / device in {c} GiB ({layouts})" for c in CAPACITIES_GIB)
        + " |"
    ]
    lines.append("|" + "---|" * (6 + len(device_counts) + len(CAPACITIES_GIB)))
    for row in rows:
        remat = gib(row["activation_bytes_remat"]) if row["activation_bytes_remat"] else "n/a"
        fit = []
        for capacity in CAPACITIES_GIB:
            counts = [examples_that_fit(row, 1, False, capacity)]
            counts += [examples_that_fit(row, n, True, capacity) for n in device_counts]
            fit.append(" / ".join(str(c) if c else "**no**" for c in counts))
        lines.append(
            f"| {row['model']} | {row['parameters'] / 1e6:.1f} M | {gib(row['param_bytes'])} | "
            f"{gib(row['optimizer_bytes'])} | {gib(row['activation_bytes'])} / {remat} | "
            f"{gib(per_device(row, 1, False))} | "
            + " | ".join(gib(per_device(row, n, True)) for n in device_counts)
            + "".join(f" | {f}" for f in fit)
            + " |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--json", default="benchmarks/results/memory.json")
    parser.add_argument(
        "--from-json",
        action="store_true",
        help="reprint the table from --json instead of compiling again",
    )
    args = parser.parse_args()
    if args.from_json:
        with open(args.json) as f:
            print(format_table(json.load(f)["rows"], args.devices))
        return
    rows = [
        vit_row("ViT-B/16", "B/16", 224),
        vit_row("ViT-L/16", "L/16", 224),
        vit_row("ViT-H/14", "H/14", 224),
        vqgan_row("VQGAN f16 (ImageNet)"),
        gpt_row("GPT prior 1.4B"),
    ]
    table = format_table(rows, args.devices)
    print(f"backend: {jax.default_backend()} ({platform.processor() or platform.machine()})")
    print(table)
    pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"backend": jax.default_backend(), "rows": rows, "table": table}, f, indent=2)


if __name__ == "__main__":
    main()
