"""The GPU check: one call on a lent GPU machine measures attnjax beside PyTorch, into one JSON.

    bash benchmarks/gpu/run.sh [OUTDIR]                 # on the GPU machine (docs/accelerators.md)
    python benchmarks/gpu/check.py --dry-run --out DIR  # the same code, tiny, on this CPU
    python benchmarks/gpu/table.py OUTDIR/gpu_check.json  # the side-by-side table

Parts, each with its own time limit (``BUDGETS``) inside one total, in this order:

* attnjax (``measure.py``), one process: ``vit`` (ViT-B/16 of configs/vit_imagenet.py, bf16,
  at 224 px), ``vqgan`` (the f16 VQGAN's train step in bf16: autoencoder, discriminator, LPIPS),
  ``prior_sampling`` (the prior's KV-cached sampler), ``attention`` (cuDNN and XLA's path against
  PyTorch's SDPA with its backends named, 1k to 16k tokens).
* PyTorch (``measure_torch.py``), one process without JAX: ``torch_vit`` (timm, eager and
  ``torch.compile``), ``torch_vqgan`` (taming's modules and loss), ``torch_sampling`` (taming's
  GPT with a static KV cache, eager and as a CUDA graph).
* attnjax again, a second process over the first one's persistent compilation cache:
  ``first_steps`` (the ViT's and the VQGAN's first step from the cache, and a compile that reuses
  XLA's autotuning results), ``vqgan_float32`` (the bf16 loss curve's reference),
  ``vit_predicted`` (what ``python -m attnjax.compile`` predicts for the ViT row).
* ``vit_xla_flags`` (only when ``--parts`` names it): the ViT row in a process started with
  ``XLA_FLAG_TRIALS``.
* ``cuda_tests``: the suite's ``cuda``-marked tests (skipped in the dry run).

A worker process runs a group's parts (one start-up for them all); the parent stops it when a
part overruns its limit, records that part as timed out and starts a worker for the rest. The
JSON (``gpu_check.json`` in OUTDIR) is rewritten after every event, so a run cut short still
leaves what it measured. Each part has ``status`` (``ok``, ``failed`` with ``error``, ``timed
out``, ``skipped``) and ``seconds``. Exit status 0 when no part failed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# (kind, parts): one worker process each, in order. "jax_flags" is a JAX worker started with
# XLA_FLAG_TRIALS; "torch" imports no JAX.
WORKERS = (
    ("jax", ("vit", "vqgan", "prior_sampling", "attention")),
    ("torch", ("torch_vit", "torch_vqgan", "torch_sampling")),
    ("jax", ("first_steps", "vqgan_float32", "vit_predicted")),
    ("jax_flags", ("vit_xla_flags",)),
)
WORKER_PARTS = tuple(part for _, parts in WORKERS for part in parts)
PARTS = (*WORKER_PARTS, "cuda_tests")
# NVIDIA's GPU performance guide for JAX: GEMMs to cuBLAS rather than Triton, and the latency
# hiding scheduler (it orders independent work on one GPU too).
XLA_FLAG_TRIALS = (
    "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
)
# Seconds each part may take: about twice what it took on an H200
# (benchmarks/results/gpu_check_h200.json: vit 32 s, vqgan 96, prior_sampling 45, attention 72,
# torch_vit 50, torch_vqgan 20, first_steps 55, vqgan_float32 55, vit_predicted 22,
# vit_xla_flags 22, cuda_tests 66; each worker's start 3-6 s). TOTAL_SECONDS bounds them all, so
# that the call with the wheels' install ends inside the device's 10 minutes: the parts last in
# the order above are the ones it cuts. vit_xla_flags is left out unless asked for: its flags
# changed nothing there, and the cuda tests need its time.
BUDGETS = {"startup": 60, "vit": 70, "vqgan": 190, "prior_sampling": 90, "attention": 150,
           "torch_vit": 110, "torch_vqgan": 50, "torch_sampling": 40, "first_steps": 110,
           "vqgan_float32": 110, "vit_predicted": 50, "vit_xla_flags": 50,
           "cuda_tests": 130}  # fmt: skip
DEFAULT_PARTS = tuple(part for part in PARTS if part != "vit_xla_flags")
TOTAL_SECONDS = 560
DRY_RUN_TOTAL_SECONDS = 300
CUDA_TESTS = ("tests/ops/test_kernel_choice_cuda.py", "tests/compile/test_compile.py")
VERSIONS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "jax-cuda12-pjrt", "flax", "optax", "orbax-checkpoint", "chex", "numpy",
            "ml-collections", "grain", "tensorflow-datasets", "array-record", "protobuf",
            "etils", "torch", "torchvision", "timm", "taming-transformers", "triton",
            "nvidia-cudnn-cu13", "nvidia-cublas", "nvidia-cuda-nvrtc", "pytest")  # fmt: skip


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in VERSIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def _nvidia_smi() -> str | None:
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


class Record:
    """The JSON being built, written whole (atomically) after every change."""

    def __init__(self, path: pathlib.Path, data: dict):
        self.path, self.data = path, data
        self.write()

    def part(self, name: str) -> dict:
        return self.data["parts"][name]

    def update(self, name: str, **fields) -> None:
        self.part(name).update(fields)
        self.write()

    def write(self) -> None:
        temporary = self.path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(temporary, self.path)


# ---------------------------------------------------------------------------------------------
# The parent: a worker for the measuring parts, pytest for the cuda tests
# ---------------------------------------------------------------------------------------------


def worker_environment(kind: str, dry_run: bool, cache: str) -> dict:
    env = dict(os.environ)
    # Every JAX worker shares one persistent compilation cache, empty at the start: the first
    # compiles cold, the second reads what the first wrote.
    env["ATTNJAX_COMPILATION_CACHE"] = cache
    if kind == "jax_flags":
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {XLA_FLAG_TRIALS}".strip()
    if dry_run:
        env["JAX_PLATFORMS"] = "cpu"
    else:
        # The GPU first (the default device), the CPU beside it: the FLOP counts trace on it.
        env.setdefault("JAX_PLATFORMS", "cuda,cpu")
        # JAX takes 75% of the GPU's memory by default; PyTorch's kernels need some of the rest.
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.7")
    # The CPU branches of attention are traced on any platform: their fixed rules, not a timing.
    env["ATTNJAX_CPU_AUTOTUNE"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _stop(process: subprocess.Popen) -> None:
    """Ends ``process`` and what it started (its own process group)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def _events(path: pathlib.Path, offset: int) -> tuple[list, int]:
    """Whole lines appended to ``path`` after ``offset`` -> ``(events, new offset)``."""
    if not path.exists():
        return [], offset
    data = path.read_bytes()[offset:]
    complete = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in complete.splitlines()], offset + len(complete)


def _start_worker(kind: str, parts, events: pathlib.Path, dry_run: bool, log, cache: str):
    command = [sys.executable, str(HERE / "check.py"), "--worker", kind, "--events", str(events),
               "--parts", ",".join(parts), "--spawned", repr(time.time()),
               *(["--dry-run"] if dry_run else [])]  # fmt: skip
    with open(log, "ab") as output:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=worker_environment(kind, dry_run, cache),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def run_worker_parts(kind: str, parts, record: Record, dry_run: bool, log, deadline, cache):
    """Runs ``parts`` in a worker process of ``kind``; after a part overruns its limit or the
    worker dies in one, in a new worker for the parts left."""
    remaining = list(parts)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as events_dir:
        attempt = 0
        while remaining:
            events, attempt = pathlib.Path(events_dir) / f"events_{attempt}.jsonl", attempt + 1
            worker = (kind, events, cache)
            if not _run_worker(remaining, worker, record, dry_run, log, deadline):
                return


def _run_worker(remaining: list, worker, record: Record, dry_run, log, deadline) -> bool:
    """One worker for the ``remaining`` parts, removed from it as they end -> whether to start
    another for the parts left (after a part that timed out or died)."""
    kind, events, cache = worker
    since = log.stat().st_size
    process = _start_worker(kind, remaining, events, dry_run, log, cache)
    # The part running (None: the worker's start, or between two parts) and since when.
    watch = {"ready": False, "current": None, "started": time.monotonic(), "ended": 0}
    offset = 0

    def follow():
        nonlocal offset
        new, offset = _events(events, offset)
        for event in new:
            what, name = event["event"], event.get("part")
            if what == "ready":
                watch.update(ready=True, started=time.monotonic())
                if event["kind"] == "torch":
                    record.data["device"]["torch"] = event["device"]
                else:
                    record.data["device"].update(event["device"])
                record.data["worker_starts"].append(
                    {
                        "kind": event["kind"],
                        "parts": list(remaining),
                        "seconds": event["start_seconds"],
                    }  # fmt: skip
                )
                record.write()
            elif what == "start":
                watch.update(current=name, started=time.monotonic())
                record.update(name, status="running")
            else:  # "update" or "end"
                record.update(name, **event["result"])
            if what == "end":
                print(f"{name}: {_brief(record.part(name))}", flush=True)
                remaining.remove(name)
                watch.update(current=None, started=time.monotonic(), ended=watch["ended"] + 1)

    while process.poll() is None:
        follow()
        current, now = watch["current"], time.monotonic()
        limit = BUDGETS[current or "startup"]
        if now <= min(watch["started"] + limit, deadline):
            time.sleep(0.2)
            continue
        ended = watch["ended"]
        _stop(process)
        follow()
        if watch["ended"] > ended:  # the part ended as its time ran out
            return True
        if now > deadline:
            _fail_all(record, remaining, "timed out", "the check's total time ran out")
            return False
        if current is None:
            why = f"the worker hung for {limit} s outside any part (starting, or between two)"
            _fail_all(record, remaining, "timed out", why)
            return False
        why = f"timed out after {now - watch['started']:.0f} s (its limit)"
        record.update(current, status="timed out", error=why, seconds=limit)
        print(f"{current}: {why}", flush=True)
        remaining.remove(current)
        return True
    follow()
    if not remaining:
        return False
    code = process.returncode
    how = f"signal {-code}" if code < 0 else f"exit status {code}"
    line = _last_line(log.read_bytes()[since:].decode(errors="replace"))
    current = watch["current"]
    if current is not None:
        why = f"the worker died ({how}); its last line: {line}"
        record.update(
            current, status="failed", error=why, seconds=time.monotonic() - watch["started"]
        )
        print(f"{current}: failed: {why}", flush=True)
        remaining.remove(current)
        return True
    what = "started" if watch["ready"] else "did not start"
    _fail_all(record, remaining, "failed", f"the worker {what} and died ({how}): {line}")
    return False


def _fail_all(record: Record, parts, status: str, error: str) -> None:
    for name in list(parts):
        record.update(name, status=status, error=error)
        print(f"{name}: {status}: {error}", flush=True)


def _brief(part: dict) -> str:
    """The status and, for a reader of the console alone, the headline numbers."""
    text = part["status"] + (f": {part['error']}" if part.get("error") else "")
    if "examples_per_second_at_40pct_mfu" in part:
        text += f"; predicted at 40% MFU: {part['examples_per_second_at_40pct_mfu']:,.0f}"
    for name in ("measured", "eager", "compiled", "cuda_graph"):
        row = part.get(name) or {}
        if row.get("images_per_second"):
            mfu = f", MFU {row['mfu']:.3f}" if row.get("mfu") else ""
            text += f"; {name} {row['images_per_second']:,.1f} images/s{mfu}"
            text += f", first step {row['first_step_seconds']:.1f} s"
        if row.get("tokens_per_second"):
            text += f"; {name} {row['tokens_per_second']:,.0f} tokens/s"
    if part.get("tokens_per_second"):
        text += f"; {part['tokens_per_second']:,.0f} tokens/s"
    for name in ("vit", "vqgan", "new_program"):
        if isinstance(part.get(name), dict) and "first_step" in part[name]:
            text += f"; {name} first step {part[name]['first_step']['seconds']:.1f} s"
    for row in part.get("rows", []) if isinstance(part.get("rows"), list) else []:
        times = ", ".join(
            f"{name} {path['forward_ms']:.3f}/{path['forward_backward_ms']:.3f}"
            for name, path in row.get("paths", {}).items()
            if "forward_backward_ms" in path
        )
        text += f"\n  {row['shape']} causal={row['causal']}: forward/forward+backward ms: {times}"
    if part.get("counts"):
        text += f"; {part['counts']}"
    return text


_OUTCOME = re.compile(r"^(tests/\S.*?::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def run_cuda_tests(record: Record, log: pathlib.Path, limit: float) -> None:
    """The ``cuda``-marked tests, with the GPU's backend up beside the CPU's. They lower and
    compile for CUDA (compile-only devices too) and run CPU exports: the CPU stays the default
    device they were written for (``JAX_PLATFORMS=cpu,cuda``)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu,cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-rfE", "-p",
               "no:cacheprovider", *CUDA_TESTS]  # fmt: skip
    record.update("cuda_tests", status="running", command=" ".join(command[1:]))
    start = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, timed_out = process.communicate(timeout=limit)[0], False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, timed_out = process.communicate()[0], True
    text = output.decode(errors="replace")
    with open(log, "a") as f:
        f.write(text)
    result = parse_pytest(text)
    result.update(seconds=time.monotonic() - start, tail=text[-3000:])
    if timed_out:
        result.update(status="timed out", error=f"timed out after {limit:.0f} s")
    elif process.returncode == 0 and result["counts"].get("passed"):
        result.update(status="ok")
    else:
        failures = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
        summary = failures[0] if failures else _last_line(text)
        result.update(status="failed", error=f"pytest exit {process.returncode}: {summary}"[:300])
    record.update("cuda_tests", **result)
    print(f"cuda_tests: {_brief(record.part('cuda_tests'))}", flush=True)


def parse_pytest(text: str) -> dict:
    """pytest -v output -> ``{"outcomes": {test id: outcome}, "counts": {outcome: n}}``."""
    outcomes = {}
    for line in text.splitlines():
        match = _OUTCOME.match(line)
        if match:
            outcomes[match.group(1)] = match.group(2).lower()
    counts = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return {"outcomes": outcomes, "counts": counts}


def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def run(args) -> int:
    out = pathlib.Path(args.out or os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    parts = [p for p in PARTS if p in args.parts.split(",")]
    log = out / "gpu_check.log"
    log.write_text("")
    found = versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)
    device = {} if args.dry_run else {"nvidia_smi": _nvidia_smi()}
    record = Record(
        out / "gpu_check.json",
        {
            "mode": "dry-run" if args.dry_run else "gpu",
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device,
            "versions": found,
            "budgets_seconds": {**BUDGETS, "total": TOTAL_SECONDS},
            "xla_flag_trials": XLA_FLAG_TRIALS,
            "worker_starts": [],
            "parts": {name: {"status": "pending"} for name in parts},
        },
    )
    total = DRY_RUN_TOTAL_SECONDS if args.dry_run else TOTAL_SECONDS
    deadline = time.monotonic() + total
    with tempfile.TemporaryDirectory(prefix="gpu_check_cache_") as cache:
        for kind, group in WORKERS:
            measuring = [p for p in group if p in parts]
            if measuring and kind == "torch" and args.dry_run and not _has_torch():
                # A CPU without PyTorch (the newest-JAX environment) dry-runs attnjax's side.
                for name in measuring:
                    record.update(name, status="skipped", reason="dry run: PyTorch not installed")
                    print(f"{name}: skipped (dry run, no PyTorch)", flush=True)
            elif measuring:
                run_worker_parts(kind, measuring, record, args.dry_run, log, deadline, cache)
    if "cuda_tests" in parts:
        if args.dry_run:
            record.update("cuda_tests", status="skipped", reason="dry run: needs a GPU")
            print("cuda_tests: skipped (dry run)", flush=True)
        else:
            left = deadline - time.monotonic()
            run_cuda_tests(record, log, max(1.0, min(BUDGETS["cuda_tests"], left)))
    record.data["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"
    )
    record.write()
    print(f"wrote {record.path}", flush=True)
    statuses = [part["status"] for part in record.data["parts"].values()]
    return 0 if all(status in ("ok", "skipped") for status in statuses) else 1


# ---------------------------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------------------------


def work(args) -> int:
    sys.path.insert(0, str(ROOT))  # attnjax and configs of this checkout
    sys.path.append(str(ROOT / "benchmarks"))  # timing.py, behind every installed module
    sys.path.append(str(HERE))
    # After the parent has set the environment: measure imports JAX, measure_torch PyTorch.
    if args.worker == "torch":
        import measure_torch as measure
    else:
        import measure

        from attnjax.train import collector, compilation_cache

        collector.raise_thresholds()
        compilation_cache.enable()

    with open(args.events, "a") as events:

        def write(**event):
            events.write(json.dumps(event) + "\n")
            events.flush()

        device = measure.device_info(args.dry_run)
        # From the worker's spawn to here: the interpreter, the imports and the backend's start.
        start_seconds = time.time() - args.spawned
        write(event="ready", kind=args.worker, device=device, start_seconds=start_seconds)
        for name in args.parts.split(","):
            write(event="start", part=name)
            start = time.perf_counter()
            emit = lambda partial, name=name: write(event="update", part=name, result=partial)
            try:
                result = {**measure.PARTS[name](args.dry_run, emit), "status": "ok"}
            except Exception as error:
                traceback.print_exc()
                lines = str(error).strip().splitlines()
                why = f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
                result = {"status": "failed", "error": why}
            result["seconds"] = time.perf_counter() - start
            write(event="end", part=name, result=result)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--out", help="folder of gpu_check.json (default $OUT, else "
                        "benchmarks/results)")  # fmt: skip
    parser.add_argument(
        "--parts", default=",".join(DEFAULT_PARTS), help=f"some of {','.join(PARTS)}"
    )
    parser.add_argument("--worker", choices=("jax", "jax_flags", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--events", help=argparse.SUPPRESS)
    parser.add_argument("--spawned", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return work(args) if args.worker else run(args)


if __name__ == "__main__":
    sys.exit(main())
