"""The GPU check: one call on a lent GPU machine measures what no CPU run can, into one JSON.

    bash benchmarks/gpu/run.sh [OUTDIR]                 # on the GPU machine (docs/accelerators.md)
    python benchmarks/gpu/check.py --dry-run --out DIR  # the same code, tiny, on this CPU

Parts (``measure.py``), each with its own time limit (``BUDGETS``) inside one total:

* ``vit``: ViT-B/16 (configs/vit_imagenet.py, bf16) trained on synthetic batches: images/s and
  MFU as the training loop logs them, beside what ``python -m attnjax.compile`` predicts for
  the same GPU.
* ``vqgan``: the train step of configs/vqgan_imagenet_f16.py on synthetic images.
* ``prior_sampling``: tokens/s of the prior's KV-cached sampler (a random GPT of
  configs/prior_cifar10.py's size over the f16 VQGAN's codes).
* ``attention``: ``dot_product_attention`` forced to cuDNN and to XLA's path against PyTorch's
  ``scaled_dot_product_attention`` at 1k, 4k and 16k tokens, bf16, causal and not.
* ``cuda_tests``: the suite's ``cuda``-marked tests, with the GPU's backend up (skipped in the
  dry run).

The measuring parts run in one worker process (one start-up for all); the parent stops the
worker when a part overruns its limit, records that part as timed out and starts a worker for
the rest. The JSON (``gpu_check.json`` in OUTDIR) is rewritten after every event, so a run cut
short still leaves what it measured. Each part has ``status`` (``ok``, ``failed`` with
``error``, ``timed out``, ``skipped``) and ``seconds``. Exit status 0 when no part failed.
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
WORKER_PARTS = ("vit", "vqgan", "prior_sampling", "attention")
PARTS = (*WORKER_PARTS, "cuda_tests")
# Seconds each part may take: about twice what it took on an H200 machine
# (benchmarks/results/gpu_check_h200.json: vit 77 s, vqgan 94 s, of which 42 s compile the train
# step and 37 s the autoencoder's initialisation for the GPU, now computed on the host instead,
# prior_sampling 40 s, attention 35 s, cuda_tests 66 s). The worker's start (imports, the GPU's
# backend) has its own; TOTAL_SECONDS bounds them all, so that the call with the wheels' install
# ends inside the device's 10 minutes.
BUDGETS = {"startup": 60, "vit": 150, "vqgan": 190, "prior_sampling": 80, "attention": 75,
           "cuda_tests": 130}  # fmt: skip
TOTAL_SECONDS = 540
DRY_RUN_TOTAL_SECONDS = 240
CUDA_TESTS = ("tests/ops/test_kernel_choice_cuda.py", "tests/compile/test_compile.py")
VERSIONS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "jax-cuda12-pjrt", "flax", "optax", "orbax-checkpoint", "chex", "numpy",
            "ml-collections", "grain", "tensorflow-datasets", "array-record", "protobuf",
            "etils", "torch", "pytest")  # fmt: skip


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


def worker_environment(dry_run: bool) -> dict:
    env = dict(os.environ)
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


def _start_worker(parts, events: pathlib.Path, dry_run: bool, log: pathlib.Path):
    command = [sys.executable, str(HERE / "check.py"), "--worker", "--events", str(events),
               "--parts", ",".join(parts), *(["--dry-run"] if dry_run else [])]  # fmt: skip
    with open(log, "ab") as output:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=worker_environment(dry_run),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def run_worker_parts(parts, record: Record, dry_run: bool, log: pathlib.Path, deadline: float):
    """Runs ``parts`` in a worker process; after a part overruns its limit or the worker dies
    in one, in a new worker for the parts left."""
    remaining = list(parts)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as events_dir:
        attempt = 0
        while remaining:
            events, attempt = pathlib.Path(events_dir) / f"events_{attempt}.jsonl", attempt + 1
            if not _run_worker(remaining, events, record, dry_run, log, deadline):
                return


def _run_worker(remaining: list, events, record: Record, dry_run, log, deadline) -> bool:
    """One worker for the ``remaining`` parts, removed from it as they end -> whether to start
    another for the parts left (after a part that timed out or died)."""
    since = log.stat().st_size
    process = _start_worker(remaining, events, dry_run, log)
    # The part running (None: the worker's start, or between two parts) and since when.
    watch = {"ready": False, "current": None, "started": time.monotonic(), "ended": 0}
    offset = 0

    def follow():
        nonlocal offset
        new, offset = _events(events, offset)
        for event in new:
            kind, name = event["event"], event.get("part")
            if kind == "ready":
                watch.update(ready=True, started=time.monotonic())
                record.data["device"].update(event["device"])
                record.write()
            elif kind == "start":
                watch.update(current=name, started=time.monotonic())
                record.update(name, status="running")
            else:  # "update" or "end"
                record.update(name, **event["result"])
            if kind == "end":
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
    measured, predicted = part.get("measured") or {}, part.get("predicted") or {}
    if measured.get("images_per_second"):
        text += f"; {measured['images_per_second']:,.1f} images/s, MFU {measured['mfu']:.3f}"
    if predicted.get("examples_per_second_at_40pct_mfu"):
        text += f" (predicted at 40% MFU: {predicted['examples_per_second_at_40pct_mfu']:,.0f})"
    if part.get("tokens_per_second"):
        text += f"; {part['tokens_per_second']:,.0f} tokens/s"
    for row in part.get("rows", []):
        times = ", ".join(
            f"{name} {path['forward_backward_ms']:.2f}"
            for name, path in row.get("paths", {}).items()
            if "forward_backward_ms" in path
        )
        text += f"\n  {row['shape']} causal={row['causal']}: forward + backward ms: {times}"
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
            "parts": {name: {"status": "pending"} for name in parts},
        },
    )
    total = DRY_RUN_TOTAL_SECONDS if args.dry_run else TOTAL_SECONDS
    deadline = time.monotonic() + total
    measuring = [p for p in parts if p in WORKER_PARTS]
    if measuring:
        run_worker_parts(measuring, record, args.dry_run, log, deadline)
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
    import measure  # imports jax: after the parent has set the environment

    from attnjax.train import collector

    collector.raise_thresholds()

    with open(args.events, "a") as events:

        def write(**event):
            events.write(json.dumps(event) + "\n")
            events.flush()

        write(event="ready", device=measure.device_info(args.dry_run))
        for name in args.parts.split(","):
            write(event="start", part=name)
            start = time.perf_counter()
            emit = lambda partial, name=name: write(event="update", part=name, result=partial)
            try:
                result = {**measure.PARTS[name](args.dry_run, emit), "status": "ok"}
            except Exception as error:
                traceback.print_exc()
                result = {"status": "failed", "error": measure.error_line(error)}
            result["seconds"] = time.perf_counter() - start
            write(event="end", part=name, result=result)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--out", help="folder of gpu_check.json (default $OUT, else "
                        "benchmarks/results)")  # fmt: skip
    parser.add_argument("--parts", default=",".join(PARTS), help=f"some of {','.join(PARTS)}")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--events", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return work(args) if args.worker else run(args)


if __name__ == "__main__":
    sys.exit(main())
