"""Where the ViT-B/16 train step's time goes on the device (benchmarks/gpu/check.py's ``vit``
and ``torch_vit`` parts), from each framework's own profiler, summed by the same kernel families.

attnjax: a few steps run under ``jax.profiler.trace``; its Perfetto trace (a JSON of complete
events per process and thread) is read back and the device's events summed by kernel family and
by name, per step, beside the step's wall time: the share the device was busy, and what kept it
busy. PyTorch (``measure_torch``): ``torch.profiler``'s CUDA kernel events, summed the same way.
On a CPU (the dry run) there is no device lane: the host's XLA threads, or PyTorch's operators'
own times, are summed instead (XLA's run on both cores at once: the share can pass 1). This
module imports no framework: the PyTorch worker reads its families too.
"""

from __future__ import annotations

import gzip
import json
import pathlib
import tempfile
import time

# (family, lowercase substrings of a kernel's name): the first that matches names the family.
# Convolutions before products: cuDNN's are implicit GEMMs named by their pass (fprop, dgrad,
# wgrad).
FAMILIES = (
    ("attention", ("fmha", "flash", "sdpa", "attention")),
    ("convolutions", ("convolution", "fprop", "dgrad", "wgrad", "conv2d", "implicit_gemm")),
    (
        "matrix products",
        ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "matmul", "dot", "::mm", "addmm", "bmm"),
    ),
    ("copies and transposes", ("copy", "transpose", "memcpy", "memset", "dynamic-update-slice")),
    ("reductions", ("reduce", "reduction")),
    ("other fusions", ("fusion", "triton", "loop_", "input_")),
)
# XLA:CPU's thunk executor wraps the operations it runs in events of its own: counted once.
WRAPPERS = ("ThunkExecutor",)
DEVICE_LANES = ("/device:gpu", "/device:tpu", "gpu:", "stream")
TOP = 15


def family(name: str) -> str:
    lower = name.lower()
    for label, needles in FAMILIES:
        if any(needle in lower for needle in needles):
            return label
    return "other"


def read_trace(log_dir: str) -> dict:
    """The Perfetto trace ``jax.profiler.trace(create_perfetto_trace=True)`` wrote."""
    paths = sorted(pathlib.Path(log_dir).rglob("perfetto_trace.json.gz"))
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    with gzip.open(paths[-1], "rt") as f:
        return json.load(f)


def summary(microseconds: dict, steps: int, step_seconds: float, lanes: list) -> dict:
    """``{kernel name: microseconds over steps}`` -> per step: milliseconds by family and of the
    ``TOP`` longest names, their sum against the step's wall time."""
    by_name = {name: us / 1e3 / steps for name, us in microseconds.items()}
    by_family: dict[str, float] = {}
    for name, ms in by_name.items():
        by_family[family(name)] = by_family.get(family(name), 0.0) + ms
    busy = sum(by_family.values())
    step_ms = step_seconds * 1e3
    top = sorted(by_name.items(), key=lambda item: -item[1])[:TOP]
    return {
        "lanes": lanes,
        "step_ms": step_ms,
        "events_ms_per_step": busy,
        "busy_share": busy / step_ms if step_ms else None,
        "by_family_ms": dict(sorted(by_family.items(), key=lambda item: -item[1])),
        "top_ms": [{"name": name[:120], "ms": ms, "family": family(name)} for name, ms in top],
    }


def summarize(trace: dict, steps: int, step_seconds: float) -> dict:
    """``summary`` of a Perfetto trace's device lanes (the processes named like a device); none
    (a CPU): every complete event off the Python thread."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device = {pid for pid, name in names.items() if any(k in name.lower() for k in DEVICE_LANES)}
    threads = {
        (e["pid"], e["tid"]): e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    microseconds: dict[str, float] = {}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if device:
            if e["pid"] not in device:
                continue
        elif "python" in threads.get((e.get("pid"), e.get("tid")), "").lower():
            continue
        name = e.get("name", "")
        if any(wrapper in name for wrapper in WRAPPERS):
            continue
        microseconds[name] = microseconds.get(name, 0.0) + e["dur"]
    lanes = sorted(names[pid] for pid in device) or ["host (no device lane)"]
    return summary(microseconds, steps, step_seconds, lanes)


def profile_steps(train_step, state, batch, keys) -> dict:
    """``len(keys) - 1`` steps of a compiled ``train_step`` under JAX's profiler (one more before,
    outside it) -> the summary."""
    import jax

    state, metrics = train_step(state, batch, keys[0])  # compiled and warm before the trace
    jax.block_until_ready((state, metrics))
    with tempfile.TemporaryDirectory(prefix="gpu_check_trace_") as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            start = time.perf_counter()
            for key in keys[1:]:
                state, metrics = train_step(state, batch, key)
            jax.block_until_ready((state, metrics))
            seconds = time.perf_counter() - start
        trace = read_trace(log_dir)
    steps = len(keys) - 1
    return summarize(trace, steps, seconds / steps)
