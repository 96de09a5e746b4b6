"""The ``attention`` part of benchmarks/gpu/check.py: attnjax's ``dot_product_attention`` forced
to cuDNN and to XLA's path beside PyTorch's ``scaled_dot_product_attention`` (its own choice of
backend, named, and each GPU backend forced), bf16, causal and not, on one device; their outputs
compared with each other. ``dry_run`` runs the same code at tiny sizes on the CPU.
"""

from __future__ import annotations

import importlib.util
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_seconds

from attnjax.ops import attention
from attnjax.train import performance

# (name, batch, tokens, heads, head_dim): benchmarks/attention_kernels.py's long shapes.
ATTENTION = {
    "gpu": dict(repeats=5, loop=20, shapes=[("1k", 4, 1024, 8, 128), ("4k", 1, 4096, 8, 128),
                                    ("16k", 1, 16384, 8, 128)]),
    "dry-run": dict(repeats=2, loop=2, shapes=[("64", 2, 64, 2, 32), ("128", 1, 128, 2, 32)]),
}  # fmt: skip
# Two bf16 attention kernels differ by a few bf16 roundings of outputs of size ~1.
AGREEMENT_ATOL = 3e-2
PROBE_ROWS, PROBE_DIMS = 3, 8


def _mode(dry_run: bool) -> str:
    return "dry-run" if dry_run else "gpu"


INPUTS = (
    "q, k, v [batch, tokens, heads, head_dim] = np.random.default_rng(seed).standard_normal("
    "(3, batch, tokens, heads, head_dim), dtype=np.float32), each rounded to bfloat16"
)


def attention_inputs(seed: int, shape) -> list:
    """q, k, v as ``INPUTS`` says."""
    draws = np.random.default_rng(seed).standard_normal((3, *shape), dtype=np.float32)
    return [jnp.asarray(x, jnp.bfloat16) for x in draws]


def _jax_paths(implementation: str, causal: bool):
    def forward(q, k, v):
        return attention.dot_product_attention(
            q, k, v, is_causal=causal, implementation=implementation
        )

    def loss(q, k, v):
        return jnp.sum(forward(q, k, v).astype(jnp.float32))

    return forward, jax.grad(loss, (0, 1, 2))


def _jax_chained(implementation: str, causal: bool):
    """Forward and forward + backward as maps ``q -> q'`` of q's shape (every gradient feeds
    ``q'``: none is dead code), for a loop of them inside one program."""
    forward, grad = _jax_paths(implementation, causal)

    def forward_backward(q, k, v):
        dq, dk, dv = grad(q, k, v)
        return q + 1e-3 * (dq + dk + dv)

    return {"forward": forward, "forward_backward": forward_backward}


def _in_one_program(step, loop: int):
    """``loop`` calls of ``step`` chained inside one jitted program, unrolled: the device's time
    per call without the host's dispatch, and without a loop's own cost per trip (XLA:GPU may
    read a ``while`` loop's condition on the host every trip)."""

    def run(q, k, v):
        for _ in range(loop):
            q = step(q, k, v).astype(q.dtype)
        return q

    return jax.jit(run)


def _time_jax(implementation: str, causal: bool, args, sizes: dict) -> tuple:
    forward = jax.jit(_jax_paths(implementation, causal)[0])
    out = jax.block_until_ready(forward(*args))
    call = median_seconds(lambda: jax.block_until_ready(forward(*args)), sizes["repeats"])
    timing = {"forward_call_ms": call * 1e3}
    for name, step in _jax_chained(implementation, causal).items():
        looped = _in_one_program(step, sizes["loop"])
        jax.block_until_ready(looped(*args))
        seconds = median_seconds(lambda: jax.block_until_ready(looped(*args)), sizes["repeats"])
        timing[f"{name}_ms"] = seconds / sizes["loop"] * 1e3
    return out, timing


def _torch_paths(torch, causal: bool):
    """Forward (no autograd) and forward + backward of PyTorch's SDPA, neither synchronising."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward(q, k, v):
        with torch.no_grad():
            return sdpa(q, k, v, is_causal=causal)

    def forward_backward(q, k, v):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        sdpa(q, k, v, is_causal=causal).float().sum().backward()
        return q.grad, k.grad, v.grad

    return {"forward": forward, "forward_backward": forward_backward}


def _time_torch(torch, causal: bool, args, sizes: dict, on_gpu: bool) -> tuple:
    """PyTorch's per-call forward (synchronised after each), and its device time per call over
    ``loop`` calls queued back to back between two CUDA events (the host's launches overlap the
    device's work: PyTorch's own way of hiding its per-call cost)."""
    sync = torch.cuda.synchronize if on_gpu else lambda: None
    paths = _torch_paths(torch, causal)
    out = paths["forward"](*args)
    paths["forward_backward"](*args)
    sync()

    def call():
        paths["forward"](*args)
        sync()

    timing = {"forward_call_ms": median_seconds(call, sizes["repeats"]) * 1e3}
    for name, fn in paths.items():
        times = []
        for _ in range(sizes["repeats"]):
            if on_gpu:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                for _ in range(sizes["loop"]):
                    fn(*args)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / sizes["loop"])
            else:
                begin = time.perf_counter()
                for _ in range(sizes["loop"]):
                    fn(*args)
                times.append((time.perf_counter() - begin) / sizes["loop"] * 1e3)
        timing[f"{name}_ms"] = float(np.median(times))
    return out, timing


def torch_backend_name(torch, q, k, v, causal: bool) -> str:
    """The SDPA backend PyTorch picks for these inputs (its own dispatch function)."""
    from torch.nn.attention import SDPBackend

    names = {int(value): name for name, value in SDPBackend.__members__.items()}
    return names.get(int(torch._fused_sdp_choice(q, k, v, is_causal=causal)), "unknown")


def _summary(out: np.ndarray) -> dict:
    """What the JSON keeps of an output ``[batch, tokens, heads, dim]``: the mean of its
    magnitudes and, of batch 0 and head 0, the first dims of its first, middle and last rows."""
    rows = np.linspace(0, out.shape[1] - 1, PROBE_ROWS).astype(int)
    return {
        "abs_mean": float(np.mean(np.abs(out), dtype=np.float64)),
        "probe": out[0, rows, 0, :PROBE_DIMS].astype(float).round(5).tolist(),
    }


# PyTorch's SDPA backends forced one at a time on a GPU (``torch.nn.attention.sdpa_kernel``),
# beside its own choice ("torch").
TORCH_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def _attention_row(torch, index: int, shape_row, causal: bool, sizes: dict, on_gpu: bool):
    name, batch, tokens, heads, depth = shape_row
    shape = (batch, tokens, heads, depth)
    q, k, v = attention_inputs(index, shape)
    xla_forward, xla_grad = _jax_paths("xla", causal)
    flops = {
        "forward": performance.traced_flops(xla_forward, q, k, v),
        "forward_backward": performance.traced_flops(xla_grad, q, k, v),
    }
    row = {"shape": name, "batch": batch, "tokens": tokens, "heads": heads, "head_dim": depth,
           "causal": causal, "seed": index,
           "automatic": attention.platform_choices(q, k, v, None, causal, timed=False),
           "flops": flops, "paths": {}}  # fmt: skip
    outputs = {}
    implementations = ("cudnn", "xla") if on_gpu else ("xla",)
    for implementation in implementations:
        out, timing = _time_jax(implementation, causal, (q, k, v), sizes)
        outputs[implementation] = np.asarray(out, np.float32)
        row["paths"][implementation] = timing
    if not on_gpu:
        row["paths"]["cudnn"] = {"status": "not on this platform"}
    if torch is None:
        row["paths"]["torch"] = {"status": "not installed"}
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        device = "cuda" if on_gpu else "cpu"
        tq, tk, tv = (torch.from_numpy(np.asarray(x, np.float32)) for x in (q, k, v))
        # PyTorch's layout: [batch, heads, tokens, head_dim].
        targs = tuple(
            x.to(device, torch.bfloat16).transpose(1, 2).contiguous() for x in (tq, tk, tv)
        )
        chosen = torch_backend_name(torch, *targs, causal)
        out, timing = _time_torch(torch, causal, targs, sizes, on_gpu)
        outputs["torch"] = out.transpose(1, 2).float().cpu().numpy()
        row["paths"]["torch"] = {**timing, "device": device, "backend": chosen}
        for backend in TORCH_BACKENDS if on_gpu else ():
            path = f"torch_{backend.split('_')[0].lower()}"
            try:
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    out, timing = _time_torch(torch, causal, targs, sizes, on_gpu)
            except RuntimeError as error:  # this backend refuses these inputs
                row["paths"][path] = {"status": "refused", "error": error_line(error)}
                continue
            outputs[path] = out.transpose(1, 2).float().cpu().numpy()
            row["paths"][path] = {**timing, "device": device, "backend": backend}
    for path, out in outputs.items():
        difference = float(np.max(np.abs(out - outputs["xla"])))
        timing = row["paths"][path]
        for kind in ("forward", "forward_backward"):
            timing[f"{kind}_tflops"] = flops[kind] / (timing[f"{kind}_ms"] / 1e3) / 1e12
        timing.update(_summary(out), max_abs_diff_vs_xla=difference)
    row["agree"] = all(
        row["paths"][path]["max_abs_diff_vs_xla"] <= AGREEMENT_ATOL for path in outputs
    )
    return row


def attention_kernels(dry_run: bool, emit) -> dict:
    """Forward and forward + backward of ``dot_product_attention`` forced to cuDNN and to XLA's
    path, and of ``torch.nn.functional.scaled_dot_product_attention`` (its own choice of backend,
    named, and each GPU backend forced) on the same device, bf16, causal and not; their outputs
    compared. Times per call on the device (``loop`` calls in one program, or queued back to
    back), and the per-call forward with the host's dispatch and a synchronisation."""
    # The GPU machines have PyTorch; a CPU without it (the newest-JAX environment) dry-runs
    # the rest.
    if dry_run and importlib.util.find_spec("torch") is None:
        torch = None
    else:
        import torch

    sizes = ATTENTION[_mode(dry_run)]
    on_gpu = not dry_run
    result = {
        "inputs": INPUTS,
        "flops": "products of the XLA path, as attnjax.train.performance counts them (every "
        "score, causal or not)",
        "timing": f"median of {sizes['repeats']}; *_ms: device time per call over "
        f"{sizes['loop']} calls (JAX: chained, unrolled in one program; PyTorch: queued back to "
        "back between CUDA events); forward_call_ms: one call with dispatch and synchronisation",
        "torch": None if torch is None else torch.__version__,
        "agreement_atol": AGREEMENT_ATOL,
        "rows": [],
    }
    for index, shape_row in enumerate(sizes["shapes"]):
        for causal in (False, True):
            try:
                row = _attention_row(torch, index, shape_row, causal, sizes, on_gpu)
            except Exception as error:  # one shape out of memory must not end the others
                row = {"shape": shape_row[0], "causal": causal, "error": error_line(error)}
            result["rows"].append(row)
            emit(result)
    failed = [f"{r['shape']} causal={r['causal']}" for r in result["rows"] if "error" in r]
    if failed:
        raise RuntimeError(f"attention failed at {', '.join(failed)}")
    if not all(row["agree"] for row in result["rows"]):
        raise AssertionError(f"attention paths differ by more than {AGREEMENT_ATOL}")
    return result


def error_line(error: BaseException) -> str:
    """``Type: first line of the message``, at most 300 characters."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
