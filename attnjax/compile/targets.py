"""Compile targets: ``"tpu:v5e:2x4"``, ``"gpu:h100:8"`` or ``"cpu"`` -> devices to compile for.

TPU devices come from libtpu's topology descriptions (``jax[tpu]`` installs libtpu; no TPU needed);
GPU devices from XLA's GPU target specs shipped in ``specs/`` (copied from openxla/xla,
``xla/backends/gpu/target_config/specs/``, fields jaxlib 0.10.2's proto rejects removed) and the
jax CUDA plugin (``jax[cuda12]``; no GPU needed). Both are compile-only: programs compile and
report their memory, nothing runs. ``"cpu"`` is this machine's CPU devices.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import jax

from attnjax.train import accelerators

SPECS_DIR = os.path.join(os.path.dirname(__file__), "specs")
# TPU generations by the name a target uses -> (libtpu's topology prefix, CHIPS key).
TPU_GENERATIONS = {"v4": ("v4", "v4"), "v5e": ("v5e", "v5e"), "v5p": ("v5", "v5p"),
                   "v6e": ("v6e", "v6e")}  # fmt: skip
# GPU models -> (spec file, CHIPS key).
GPU_MODELS = {
    "a100": ("a100_sxm_80.txtpb", "a100"),
    "h100": ("h100_sxm.txtpb", "h100"),
    "h200": ("h200.txtpb", "h200"),
}
# XLA:GPU options for jaxlib 0.10.2: its Triton GEMM fusions fail on the ViT's bf16 products.
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
FORMS = "tpu:<v4|v5e|v5p|v6e>:<topology, e.g. 2x4 or 2x2x1>, gpu:<a100|h100|h200>:<count> or cpu"


@dataclasses.dataclass(frozen=True)
class Target:
    """Devices to compile for and what each holds and computes at most."""

    name: str
    platform: str  # "tpu", "gpu" or "cpu"
    devices: tuple
    chip: accelerators.Chip | None  # None: a CPU
    chips: int  # physical chips (a v4 chip shows as two devices)
    compiler_options: dict

    @property
    def memory_per_device(self) -> int | None:
        if self.chip is None:
            return None
        return self.chip.memory_bytes * self.chips // len(self.devices)

    @property
    def peak_per_device(self) -> float | None:
        if self.chip is None:
            return None
        return self.chip.peak_bf16 * self.chips / len(self.devices)


def _bad(target: str, why: str) -> ValueError:
    return ValueError(f"--target={target!r}: {why}; expected {FORMS}.")


def parse(target: str) -> Target:
    """``"tpu:v5e:2x4"`` | ``"gpu:h100:8"`` | ``"cpu"`` -> its compile-only devices."""
    platform, _, rest = target.partition(":")
    if platform == "cpu" and not rest:
        return Target(target, "cpu", tuple(jax.devices("cpu")), None, 0, {})
    if platform == "tpu":
        return _tpu(target, rest)
    if platform == "gpu":
        return _gpu(target, rest)
    raise _bad(target, f"unknown platform {platform!r}")


def _tpu(target: str, rest: str) -> Target:
    generation, _, shape = rest.partition(":")
    if generation not in TPU_GENERATIONS:
        raise _bad(target, f"unknown TPU generation {generation!r}")
    if not re.fullmatch(r"\d+(x\d+){1,2}", shape):
        raise _bad(target, f"topology {shape!r} is not of the form AxB or AxBxC")
    dims = [int(d) for d in shape.split("x")]
    # libtpu takes a lock file per machine; compile-only use needs no exclusive device.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    prefix, chip = TPU_GENERATIONS[generation]
    # Hosts of up to 2x2 chips, as TPU VMs have; a single chip is its own host.
    per_host = (min(dims[0], 2), min(dims[1], 2), 1)
    try:
        topology = topologies.get_topology_desc(
            platform="tpu",
            topology_name=f"{prefix}:{shape}",
            chip_config_name="default",
            chips_per_host_bounds=per_host,
            num_slices=1,
            wrap=(False, False, False),
        )
    except Exception as error:  # libtpu missing or the shape unknown to it
        raise _bad(target, f"libtpu gave no topology ({str(error).splitlines()[0]})") from None
    devices = tuple(topology.devices)
    return Target(target, "tpu", devices, accelerators.CHIPS[chip], math.prod(dims), {})


def _gpu(target: str, rest: str) -> Target:
    model, _, count = rest.partition(":")
    if model not in GPU_MODELS:
        raise _bad(target, f"unknown GPU model {model!r}")
    if not count.isdigit() or int(count) < 1 or (int(count) > 8 and int(count) % 8):
        raise _bad(target, f"GPU count {count!r} must be 1..8 or a multiple of 8")
    count = int(count)
    spec_file, chip = GPU_MODELS[model]
    with open(os.path.join(SPECS_DIR, spec_file)) as f:
        spec = f.read()
    hosts, per_host = (1, count) if count <= 8 else (count // 8, 8)
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology_name="", target_config=spec, topology=f"1x{hosts}x{per_host}"
        )
    except Exception as error:
        raise _bad(
            target,
            f"no compile-only GPU devices ({str(error).splitlines()[0]}); this needs the jax "
            "CUDA plugin (pip install 'jax[cuda12]') and, where a GPU is absent, "
            "JAX_PLATFORMS=cpu",
        ) from None
    devices = tuple(topology.devices)
    return Target(target, "gpu", devices, accelerators.CHIPS[chip], count, GPU_COMPILER_OPTIONS)
