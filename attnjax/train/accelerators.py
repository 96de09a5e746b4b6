"""What each accelerator holds and computes at most: the table MFU and the compile command use.

``CHIPS`` maps a short name (``"v5e"``, ``"h100"``) to its memory per device and its dense peak
FLOP/s. A device is matched to its row by ``device_kind`` (what JAX reports, compile-only
devices included). A CPU has no published peak: ``measured_matmul_flops`` times a large float32
matrix product on this machine, and MFU on a CPU is relative to that rate.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: ``memory_bytes`` per JAX device, dense peaks in FLOP/s (None: not
    published for that precision), and the ``device_kind`` prefixes that name it."""

    name: str
    memory_bytes: int
    peak_bf16: float
    peak_f32: float | None
    kinds: tuple[str, ...]


# Sources (dense peaks, no sparsity; one JAX device per chip, v4/v5p megacore included):
# TPU: cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e ("System architecture" tables). TPUs publish
# no float32 peak: XLA runs float32 matrix products at default precision as bf16 passes.
# GPU: NVIDIA datasheets (A100 80GB SXM: 312 TFLOP/s bf16, 19.5 fp32; H100 SXM and H200 SXM:
# 989 bf16, 67 fp32); memory as the devices report it (XLA's target specs in
# attnjax/compile/specs/: device_memory_size).
CHIPS = {
    "v4": Chip("TPU v4", 32 * GIB, 275e12, None, ("TPU v4",)),
    "v5e": Chip("TPU v5e", 16 * GIB, 197e12, None, ("TPU v5 lite", "TPU v5e")),
    "v5p": Chip("TPU v5p", 95 * GIB, 459e12, None, ("TPU v5p", "TPU v5")),
    "v6e": Chip("TPU v6e", 32 * GIB, 918e12, None, ("TPU v6 lite", "TPU v6e")),
    "a100": Chip("A100 80GB SXM", 85_100_068_864, 312e12, 19.5e12, ("NVIDIA A100",)),
    "h100": Chip("H100 80GB SXM", 84_942_979_072, 989e12, 67e12, ("NVIDIA H100",)),
    "h200": Chip("H200 141GB SXM", 151_397_597_184, 989e12, 67e12, ("NVIDIA H200",)),
}


def chip_of(device) -> Chip | None:
    """The ``CHIPS`` row of ``device`` (by ``device_kind``), or None (a CPU, an unknown chip)."""
    kind = getattr(device, "device_kind", "")
    for chip in CHIPS.values():
        if any(kind.startswith(prefix) for prefix in chip.kinds):
            return chip
    return None


@functools.lru_cache(maxsize=2)
@functools.cache
def measured_matmul_flops(size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of the fastest of ``repeats`` float32 ``[size, size] @ [size, size]`` products on
    the default device (all of its threads): a CPU's attainable rate, in place of a peak.
    Measured once per process: every run a process starts shares it."""
    a = jnp.ones((size, size), jnp.float32)
    product = jax.jit(lambda x: x @ x)
    product(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        product(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def peak_flops(device, config=None) -> tuple[float, str]:
    """``(FLOP/s, where it comes from)`` of one ``device`` for MFU: ``config.peak_flops`` when
    set (> 0), else the chip's bf16 peak from ``CHIPS``, else (a CPU) a measured matrix product."""
    given = float(config.get("peak_flops", 0.0)) if config is not None else 0.0
    if given > 0:
        return given, "config.peak_flops"
    chip = chip_of(device)
    if chip is not None:
        return chip.peak_bf16, f"{chip.name} bf16 peak"
    return measured_matmul_flops(), "measured float32 1024^3 matmul"
