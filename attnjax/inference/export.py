"""Serialized inference: a trained run's jit-compiled functions in one file, run without attnjax.

    python -m attnjax.inference.export --workdir runs/demo/vit --out vit.jaxexport

The file holds ``jax.export`` programs (StableHLO, serialized with ``Exported.serialize()``) with
the trained weights baked in as constants, so it runs with ``jax`` and ``numpy`` alone: no model
code, no checkpoint, no config. What it holds depends on the run's ``config.task``:

* ``classification``: ``logits(images [batch, H, W, C] float32) -> [batch, num_classes]``;
  images normalised like the run's eval data (``config.data.mean``/``std``).
* ``vqgan``: ``encode(images [batch, H, W, C] float32) -> codes [batch, h, w] int32`` and
  ``decode(codes [batch, h, w] int32) -> images [batch, H, W, C]`` (normalised pixels).
* ``prior``: ``sample(labels [n] int32, seed [] uint32) -> images [n, H, W, C]`` in [0, 1]:
  the GPT's cached sampling with the run's ``config.sampling`` (temperature, top-k/p,
  guidance) and the VQGAN's decoding; ``n`` is fixed at export (``--number``), as the key/value
  cache is allocated for it.

``batch`` is symbolic: one program serves every batch size. ``--platforms cpu,cuda,tpu``
(default: this machine's) writes one program per function and platform, each lowered for its
platform alone, so each carries its platform's attention kernel (``attnjax.ops.kernel_choice``:
Pallas splash on TPU, cuDNN on CUDA, which needs the jax CUDA plugin installed where the file is
written). One program for all three cannot hold those kernels: JAX lowers every branch of a
``platform_dependent`` for every platform of a multi-platform export, and the Pallas TPU and
cuDNN calls have no CPU lowering. The container is an ``.npz``: one ``uint8`` array per function
and platform (its serialized bytes) and ``manifest`` (JSON: task, functions, their input and
output shapes, platforms, the run's data normalisation, the step exported). ``load`` picks the
programs for the platform it runs on.

    from attnjax.inference import export
    exported = export.load("vit.jaxexport")
    logits = exported["logits"](images)

``load`` imports only ``jax``, ``numpy`` and the standard library; ``export_workdir`` imports the
model code when it is called.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


class LoadedExport(dict):
    """Name -> callable of a loaded file, and ``manifest``: what the file says about itself."""

    def __init__(self, functions: dict, manifest: dict):
        super().__init__(functions)
        self.manifest = manifest


def load(path: str) -> LoadedExport:
    """Deserializes the file written by ``export_workdir``: ``{name: callable}`` + ``manifest``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"export.load: no file at {path!r}")
    with np.load(path) as contents:
        if "manifest" not in contents:
            raise ValueError(
                f"export.load: {path!r} holds no manifest; not a file written by "
                "python -m attnjax.inference.export"
            )
        manifest = json.loads(bytes(contents["manifest"]).decode())
        platform = this_platform()
        platforms = manifest.get("platforms")
        if platforms is not None and platform not in platforms:
            raise ValueError(
                f"export.load: {path!r} holds programs for {platforms}; this machine runs "
                f"{platform!r} (export again with --platforms {platform})"
            )
        suffix = "" if platforms is None else f"@{platform}"
        functions = {
            name: jax.export.deserialize(
                bytearray(contents[f"function/{name}{suffix}"].tobytes())
            ).call
            for name in manifest["functions"]
        }
    return LoadedExport(functions, manifest)


def this_platform() -> str:
    """The platform ``jax.export`` names this machine's default backend: cpu, cuda, rocm, tpu."""
    backend = jax.default_backend()
    if backend == "gpu":
        return "rocm" if "rocm" in jax.devices()[0].client.platform_version.lower() else "cuda"
    return backend


def export_for(function, specs, platform: str) -> jax.export.Exported:
    """``function`` exported for one platform. cuDNN's custom calls carry no stability promise
    across jaxlib versions (``jax.export`` refuses them by default): they are allowed by name,
    so the file runs with the jaxlib that wrote it."""
    jitted = jax.jit(function)
    checks = []
    if platform == "cuda":
        text = jitted.trace(*specs).lower(lowering_platforms=(platform,)).as_text()
        targets = sorted(set(re.findall(r"custom_call @(__cudnn\$\w+)", text)))
        checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]
    return jax.export.export(jitted, platforms=(platform,), disabled_checks=checks)(*specs)


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _classification(config, workdir, step):
    from attnjax.tasks import classification
    from attnjax.train import checkpoint

    _, variables = checkpoint.load(workdir, step=step, variables=classification.VARIABLE_FIELDS)
    model = classification.create_model(config)

    def logits(images):
        return model.apply(variables, images, train=False)

    height, width = _pair(config.data.image_size)
    patch_height, patch_width = _pair(model.patch_size)
    # The patch embedding reads (row, column, channel)-flattened patches: its fan-in has C in it.
    channels = variables["params"]["patch_embed"]["kernel"].shape[0] // (patch_height * patch_width)
    batch = jax.export.symbolic_shape("batch")[0]
    return {"logits": (logits, [_spec((batch, height, width, channels), jnp.float32)])}


def _pair(size):
    return tuple(size) if isinstance(size, (tuple, list)) else (size, size)


def _vqgan(config, workdir, step):
    from attnjax.tasks import prior as prior_task

    vqgan = prior_task.load_vqgan(workdir, step)
    model, variables = vqgan.model, vqgan.variables
    size = config.data.image_size or model.resolution
    batch = jax.export.symbolic_shape("batch")[0]

    def encode(images):
        return model.apply(variables, images, method=type(model).encode)[1].astype(jnp.int32)

    def decode(codes):
        return model.apply(variables, codes, method=type(model).decode_indices)

    return {
        "encode": (encode, [_spec((batch, size, size, model.in_channels), jnp.float32)]),
        "decode": (decode, [_spec((batch, *vqgan.grid_shape), jnp.int32)]),
    }


def _prior(config, workdir, step, number):
    from attnjax import data
    from attnjax.tasks import prior as prior_task
    from attnjax.train import checkpoint

    _, params = checkpoint.load(workdir, step=step)
    model = prior_task.create_model(config)
    vqgan = prior_task.load_vqgan(config.vqgan_workdir, config.get("vqgan_step"))
    sampling = config.sampling
    guidance = prior_task.sampling_guidance(config)

    def sample(labels, seed):
        codes = prior_task.sample_codes(
            model,
            params,
            labels if config.num_classes else None,
            jax.random.key(seed),
            grid_shape=vqgan.grid_shape,
            codebook_size=vqgan.model.n_embed,
            num_classes=config.num_classes,
            num_samples=number,
            temperature=sampling.temperature,
            top_k=sampling.get("top_k"),
            top_p=sampling.get("top_p"),
            guidance=guidance,
        )
        images = vqgan.model.apply(vqgan.variables, codes, method=type(vqgan.model).decode_indices)
        return data.denormalize(images, vqgan.config.data)

    return {"sample": (sample, [_spec((number,), jnp.int32), _spec((), jnp.uint32)])}


def export_workdir(
    workdir: str,
    out: str,
    *,
    step: int | None = None,
    number: int = 10,
    force: bool = False,
    platforms: tuple[str, ...] | None = None,
) -> dict:
    """Writes the inference functions of the run in ``workdir`` to ``out``; returns the manifest.

    ``step``: the checkpoint (default: the latest). ``number``: samples per call of a prior's
    ``sample``. ``platforms``: of ``PLATFORMS`` (default: this machine's). An existing ``out``
    is kept unless ``force``.
    """
    from attnjax.train import checkpoint

    if os.path.exists(out) and not force:
        raise ValueError(f"export: {out!r} exists; pass --force to overwrite it")
    if number < 1:
        raise ValueError(f"export: --number must be >= 1, got {number}")
    platforms = (this_platform(),) if platforms is None else tuple(platforms)
    unknown = [p for p in platforms if p not in PLATFORMS]
    if unknown or not platforms:
        raise ValueError(f"export: --platforms {list(platforms)}: expected some of {PLATFORMS}")
    if checkpoint.latest_step(workdir) is None:
        raise ValueError(f"export: --workdir {workdir!r} holds no checkpoint (train it first)")
    config = checkpoint.read_config(workdir)
    step = checkpoint.latest_step(workdir) if step is None else step
    builders = {
        "classification": lambda: _classification(config, workdir, step),
        "vqgan": lambda: _vqgan(config, workdir, step),
        "prior": lambda: _prior(config, workdir, step, number),
    }
    if config.task not in builders:
        raise ValueError(
            f"export: the run in {workdir!r} has task {config.task!r}; expected one "
            f"of {sorted(builders)}"
        )
    functions = builders[config.task]()
    serialized, described = {}, {}
    for name, (function, specs) in functions.items():
        for platform in platforms:
            exported = export_for(function, specs, platform)
            program = np.frombuffer(bytes(exported.serialize()), np.uint8)
            serialized[f"function/{name}@{platform}"] = program
        described[name] = {
            "inputs": [[str(d) for d in s.shape] + [str(s.dtype)] for s in specs],
            "outputs": [[str(d) for d in s.shape] + [str(s.dtype)] for s in exported.out_avals],
        }
    data_config = config.get("data") or {}
    manifest = {
        "task": config.task,
        "workdir": os.path.abspath(workdir),
        "step": int(step),
        "functions": described,
        "platforms": list(platforms),
        "mean": list(data_config.get("mean", ()) or ()),
        "std": list(data_config.get("std", ()) or ()),
    }
    buffer = io.BytesIO()
    np.savez(buffer, manifest=np.frombuffer(json.dumps(manifest).encode(), np.uint8), **serialized)
    partial = f"{out}.partial"  # written whole, then renamed: a failed run leaves ``out`` as it was
    with open(partial, "wb") as f:
        f.write(buffer.getvalue())
    os.replace(partial, out)
    return manifest


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m attnjax.inference.export", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--workdir", required=True, help="a trained run (classification, vqgan, prior)"
    )
    parser.add_argument("--out", required=True, help="the file to write")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--number", type=int, default=10, help="samples per call (prior runs)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")
    parser.add_argument(
        "--platforms",
        default=None,
        help=f"comma-separated, of {','.join(PLATFORMS)} (default: this machine's)",
    )
    args = parser.parse_args(argv)
    # Here, not at the top: loading an export must not import the training side.
    from attnjax.train import collector, compilation_cache

    compilation_cache.enable()
    collector.raise_thresholds()
    platforms = None if args.platforms is None else tuple(args.platforms.split(","))
    try:
        manifest = export_workdir(
            args.workdir,
            args.out,
            step=args.step,
            number=args.number,
            force=args.force,
            platforms=platforms,
        )
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"error: {error}")
    functions = ", ".join(
        f"{name}{tuple(spec['inputs'])}" for name, spec in manifest["functions"].items()
    )
    print(f"wrote {args.out}: {manifest['task']} run at step {manifest['step']}: {functions}")


if __name__ == "__main__":
    main()
