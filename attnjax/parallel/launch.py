"""Starts a multi-process JAX run on this machine, the way a cluster scheduler would.

    python -m attnjax.parallel.launch --processes 2 --devices-per-process 2 -- \\
        train.py --config configs/vit_digits.py --workdir runs/digits_2x2

Runs ``python <args after -->`` ``--processes`` times with ``JAX_COORDINATOR_ADDRESS`` (a free
local port), ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set, which
``attnjax.parallel.data_parallel.maybe_initialize_distributed`` turns into
``jax.distributed.initialize``.
``--devices-per-process N`` gives each process N simulated CPU devices
(``--xla_force_host_platform_device_count``). Output lines are prefixed ``[p<i>]``. When one
process fails (or is killed, or its watchdog ends it: status 124), the others are killed too (a
collective would wait for it) and the launcher exits with the failed process's code (128 + N
when signal N killed it); 0 when all succeed. A process that stopped for a preemption (status
75) is not a failure: the others stop at the same step after saving it, so they are given
``REQUEUE_GRACE_SECONDS`` to do so before they are killed, and the launcher exits 75.
On a GPU cluster or TPU pod use the scheduler instead (see docs/scaling.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_SECONDS = 5.0
# The others of a preempted run save the same step and stop; their own watchdogs bound that too.
REQUEUE_GRACE_SECONDS = 300.0
# attnjax.train.preemption.REQUEUE_EXIT_CODE and watchdog.EXIT_CODE, not imported: the launcher
# starts in a moment without JAX (tests/train/test_multiprocess_faults.py checks they agree).
REQUEUE_EXIT_CODE = 75
WATCHDOG_EXIT_CODE = 124
MEANINGS = {
    REQUEUE_EXIT_CODE: "stopped for a preemption after saving",
    WATCHDOG_EXIT_CODE: "its watchdog saw no progress within the bound",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(base: dict, *, index: int, count: int, port: int, devices_per_process: int) -> dict:
    env = dict(
        base,
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(count),
        JAX_PROCESS_ID=str(index),
        PYTHONUNBUFFERED="1",
    )
    if devices_per_process:
        env["XLA_FLAGS"] = with_cpu_device_count(env.get("XLA_FLAGS", ""), devices_per_process)
        env["JAX_PLATFORMS"] = "cpu"
    return env


def with_cpu_device_count(xla_flags: str, devices: int | None) -> str:
    """``xla_flags`` with its CPU device count replaced by ``devices`` (None: removed)."""
    flags = [
        f for f in xla_flags.split() if not f.startswith("--xla_force_host_platform_device_count")
    ]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


def _stream(proc: subprocess.Popen, prefix: str, lock: threading.Lock) -> None:
    for line in proc.stdout:
        with lock:
            sys.stdout.write(f"{prefix} {line}")
            sys.stdout.flush()


def _kill(procs) -> None:
    """SIGTERM to every live process group, SIGKILL to those still alive after a grace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + GRACE_SECONDS
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.05)


def launch(command: list[str], processes: int, devices_per_process: int = 0, port: int = 0) -> int:
    """Runs ``python command...`` on ``processes`` processes -> the exit code (0: all ok)."""
    if processes < 1:
        raise ValueError(f"--processes={processes}; expected at least 1.")
    if devices_per_process < 0:
        raise ValueError(f"--devices-per-process={devices_per_process}; expected >= 0.")
    if not command:
        raise ValueError(
            "no command after '--'; expected e.g. -- train.py --config ... --workdir ..."
        )
    port = port or free_port()
    lock = threading.Lock()
    procs, threads = [], []
    for index in range(processes):
        env = process_env(
            os.environ,
            index=index,
            count=processes,
            port=port,
            devices_per_process=devices_per_process,
        )
        proc, thread = _start(command, env, index, lock)
        procs.append(proc)
        threads.append(thread)

    def on_signal(signum, _):
        _kill(procs)
        sys.exit(128 + signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = _wait(procs, lock)
        for thread in threads:
            thread.join(timeout=GRACE_SECONDS)
        if code == 0:
            code = next((p.returncode for p in procs if p.returncode != 0), 0)
        return 128 - code if code < 0 else code  # killed by signal N: the shell's 128 + N
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _start(command: list[str], env: dict, index: int, lock: threading.Lock):
    """Process ``index`` running ``python command...`` and the thread forwarding its output."""
    # Own session per process: killing it also ends its children (data workers).
    proc = subprocess.Popen(
        [sys.executable, *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    with lock:
        print(f"[launch] process {index}: pid {proc.pid}", flush=True)
    thread = threading.Thread(target=_stream, args=(proc, f"[p{index}]", lock), daemon=True)
    thread.start()
    return proc, thread


def _wait(procs: list, lock: threading.Lock) -> int:
    """Waits for every process -> 0, or the exit code of the first that failed, once the
    others are killed. A preempted process's peers get ``REQUEUE_GRACE_SECONDS`` to save the
    same step and stop by themselves."""
    requeued_at = None
    while [p.poll() for p in procs].count(None):  # polls every one (any() would stop early)
        failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
        preempted = all(code == REQUEUE_EXIT_CODE for _, code in failed)
        if failed and preempted:
            requeued_at = requeued_at or time.monotonic()
        if failed and (not preempted or time.monotonic() - requeued_at > REQUEUE_GRACE_SECONDS):
            index, code = next((f for f in failed if f[1] != REQUEUE_EXIT_CODE), failed[0])
            meaning = f" ({MEANINGS[code]})" if code in MEANINGS else ""
            with lock:
                print(
                    f"[launch] process {index} exited with {code}{meaning}; stopping the others",
                    flush=True,
                )
            _kill(procs)
            return code
        time.sleep(0.1)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attnjax.parallel.launch",
        description="Run a JAX program on several local processes (see module docstring).",
    )
    parser.add_argument("--processes", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=0,
        help="simulated CPU devices per process (0: the platform's own)",
    )
    parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- script.py [args...], run with this Python"
    )
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        return launch(command, args.processes, args.devices_per_process, args.port)
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
