"""What moved between the JAX releases attnjax supports (pyproject.toml's range, from the pinned
environment's jax 0.10.2 to the newest on PyPI): the one module that knows, so that no other
module compares versions.

It reads versions from the installed packages' metadata, never by importing jax: callers may
need its answers before jax starts (XLA reads ``$XLA_FLAGS`` once, when its backend starts).
"""

from __future__ import annotations

import importlib.metadata


def _version(package: str) -> tuple[int, ...]:
    release = importlib.metadata.version(package).split("+")[0]
    return tuple(int(part) for part in release.split(".") if part.isdigit())


def xla_cpu_loop_emitter_flags() -> list[str]:
    """XLA flags that compile CPU fusions with the loop emitters instead of the fusion emitters
    (about 40% less compile time for the suite's small programs, the same values to float32
    rounding: benchmarks/results/compile_flags.md), or ``[]`` where XLA has only the fusion
    emitters. jaxlib 0.11.1 removed the flag (its name is reserved in XLA's DebugOptions since),
    and XLA ends the process on a flag it does not know."""
    if _version("jaxlib") < (0, 11, 1):
        return ["--xla_cpu_use_fusion_emitters=false"]
    return []


def persistent_cache_reloads_compile_only_programs() -> bool:
    """Whether JAX's persistent compilation cache can read back a program compiled for
    compile-only devices (``attnjax.compile``'s TPU and GPU targets): jaxlib 0.10.2 does; 0.12
    refuses each entry with a warning ("PjRtCompiler must be constructed with a Client"), so
    the compile command keeps the cache off there. 0.11 is taken as 0.12 (not measured)."""
    return _version("jaxlib") < (0, 11)


def xla_cpu_speed_flags() -> list[str]:
    """The XLA:CPU flags that make attnjax's operations fastest on this jaxlib (applied by
    ``attnjax.xla_cpu``; measured per operation family in benchmarks/results/xla_cpu_flags.md).

    From jaxlib 0.9.1 XLA:CPU hands f32 NHWC convolutions, elementwise fusions, reductions and
    some matrix products to YNNPACK. Keeping only the reductions there was fastest or within the
    noise in every family on both ends of the supported range: on jaxlib 0.10.2 YNNPACK's
    convolutions run on one thread (a VQGAN-sized layer with both gradients 40.6 ms against
    23.1 ms, 2-core EPYC) while its reductions are 4x XLA's own; on 0.12.0.1 its convolutions
    are threaded but no faster (21.9 against 21.2 ms).

    And XLA's concurrency-optimised scheduler off: it orders a train step so that more of its
    buffers are live at once. ViT-B/16's task step (batch 8, one device) holds 2058 MiB of
    temporaries with it and 1599 MiB without, the same bits, no step or first step slower
    (benchmarks/results/step_options_scheduler_off.md, first_step_flags_scheduler.md): a larger
    batch fits, and a step faults in less memory. Both flags exist on every jaxlib the range
    admits (pyproject.toml: from 0.10.2)."""
    return [
        "--xla_cpu_experimental_ynn_fusion_type=reduce",
        "--xla_cpu_enable_concurrency_optimized_scheduler=false",
    ]


def xla_backends_started() -> bool:
    """Whether this process has started an XLA backend (after which ``$XLA_FLAGS`` is not read
    again). Imports jax: call it only where jax is imported already."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def version(package: str) -> str:
    """The installed version of ``package``, as its metadata says."""
    return importlib.metadata.version(package)


def executable_device_ids(compiled) -> list[int] | None:
    """The ids of the devices a ``jax.stages.Compiled`` runs on, in its device assignment's
    order (what loading its serialized form needs: by default that loads onto every device of
    the backend), or None where this jax keeps them elsewhere. jax has no public accessor."""
    try:
        return [device.id for device in compiled._executable.xla_executable.local_devices()]
    except AttributeError:
        return None


def random_internals():
    """JAX's internals that ``attnjax.train.hashed_init`` rewrites a program with (no public API
    has them): ``(core, dtypes, prng, threefry2x32)``, the modules holding the key primitives,
    their implementations over the keys' data and the Threefry-2x32 hash; None where this jax
    keeps them elsewhere (the rewrite is then skipped). The same from jax 0.10.2 to 0.12.0.1."""
    try:
        from jax._src import core, dtypes
        from jax._src.random import prng, threefry2x32
    except ImportError:
        return None
    return core, dtypes, prng, threefry2x32
