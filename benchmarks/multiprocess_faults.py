"""Random faults of one process of a 2-process run, again and again; then checks it lost nothing.

    python benchmarks/multiprocess_faults.py [--faults 10] [--steps 200] [--seed 0] \\
        [--data_dir DIR] [--json OUT] [-- --config.model.width=16 ...]   # extra train.py flags

``configs/vit_digits.py`` (SGD, parameters split over both processes, 2 CPU devices each) to
``--steps`` steps with a checkpoint every 10: first an uninterrupted run, then the same command
started again and again in a second workdir, each time as two processes (as a scheduler starts
them, no launcher) of which one, drawn at random, meets a fault drawn at random:

* ``SIGSTOP`` (a stalled peer), some steps past the last log; the stopped one is killed once
  the other has ended;
* ``kill -9`` mid-step (some steps past the last log) or mid-save (while Orbax's temporary
  directory of a new step is on disk);
* ``SIGTERM`` to that process only (expected: both save the same step and exit 75);
* a full disk for that process (``ulimit -f``: EFBIG, ENOSPC's per-process sibling), from
  its start (expected: one line from each process, status 1, no new complete checkpoint).

A row per fault: the statuses, the seconds from the fault to the last survivor's exit (the
watchdog's floor is ``--floor`` seconds), the checkpoints before and after. Then one run to the
end, and the final parameters against the uninterrupted run's (gloo's reduction order is fixed,
so they should be bit-identical).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import flax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from attnjax.ops.platform import cpu_cores, processor  # noqa: E402
from attnjax.parallel import launch  # noqa: E402
from attnjax.train import checkpoint  # noqa: E402

KINDS = ("SIGSTOP", "kill -9 mid-step", "kill -9 mid-save", "SIGTERM", "disk full")
# Files of at most 4 KiB for the wrapped process (EFBIG, ENOSPC's per-process sibling; SIGXFSZ
# ignored), its output passed on through a pipe, which the limit does not cover: it would cut
# the process's own log short. tests/train/test_multiprocess_faults.py uses it too.
FULL_DISK = [
    "bash",
    "-c",
    "set -o pipefail; trap '' XFSZ; (ulimit -f 4; exec \"$@\") 2>&1 | cat",
    "bash",
]


def train_command(workdir, args) -> list[str]:
    command = [
        "train.py",
        "--config=configs/vit_digits.py",
        f"--workdir={workdir}",
        "--config.optimizer=sgd",
        "--config.learning_rate=0.3",
        f"--config.num_train_steps={args.steps}",
        "--config.log_every=5",
        "--config.checkpoint_every=10",
        f"--config.eval_every={args.steps}",
        "--config.best_metric=",
        "--config.mesh.data=1",
        "--config.mesh.fsdp=-1",
        f"--config.watchdog.floor_seconds={args.floor}",
    ]
    if args.data_dir:
        command.append(f"--config.data.data_dir={args.data_dir}")
    return command + args.train_flags


def start(command, logs: str, env: dict, full_disk: int | None = None) -> list:
    port = launch.free_port()
    procs = []
    for index in range(2):
        proc_env = launch.process_env(env, index=index, count=2, port=port, devices_per_process=2)
        prefix = FULL_DISK if index == full_disk else []
        if prefix:  # compilation cache entries are larger than the limit
            proc_env.pop("JAX_COMPILATION_CACHE_DIR", None)
        with open(f"{logs}-p{index}.err", "w") as err:
            procs.append(
                subprocess.Popen(
                    [*prefix, sys.executable, *command],
                    env=proc_env,
                    cwd=ROOT,
                    stdout=err,
                    stderr=err,
                )
            )
    return procs


def logged(workdir: str) -> int:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return max((json.loads(line)["step"] for line in f if "train/loss" in line), default=0)


def saved(workdir: str) -> int:
    names = os.listdir(os.path.join(workdir, "checkpoints")) if os.path.isdir(workdir) else []
    return max((int(n) for n in names if n.isdigit()), default=0)


def writing(workdir: str) -> set:
    return set(glob.glob(os.path.join(workdir, "checkpoints", "*.orbax-checkpoint-tmp*")))


def last_line(path: str) -> str:
    lines = [line for line in open(path).read().splitlines() if line.strip()]
    wanted = [line for line in lines if line.startswith(("train.py:", "watchdog:", "error:"))]
    return (wanted or lines or [""])[-1][:110]


def fault(command, workdir, env, kind: str, target: int, rng, logs: str) -> dict:
    """One run of two processes and one fault -> a table row."""
    before, old_writes = saved(workdir), writing(workdir)
    target_step = logged(workdir) + 5 * rng.randint(1, 3)
    procs = start(command, logs, env, full_disk=target if kind == "disk full" else None)
    moment, struck = "at start", time.monotonic()
    while kind != "disk full" and all(p.poll() is None for p in procs):
        new_write = writing(workdir) - old_writes
        if kind == "kill -9 mid-save" and new_write:
            moment = f"writing {sorted(new_write)[0].split('/')[-1].split('.')[0]}"
            break
        if kind != "kill -9 mid-save" and logged(workdir) >= target_step:
            moment = f"after logging step {target_step}"
            break
        time.sleep(0.005)
    sig = {"SIGSTOP": signal.SIGSTOP, "SIGTERM": signal.SIGTERM}.get(kind, signal.SIGKILL)
    if kind != "disk full":
        procs[target].send_signal(sig)
        struck = time.monotonic()
    others = [p for i, p in enumerate(procs) if i != target or kind in ("SIGTERM", "disk full")]
    deadline, hung = struck + 600, False
    while any(p.poll() is None for p in others):
        if time.monotonic() > deadline:
            hung = True
            break
        time.sleep(0.05)
    seconds = time.monotonic() - struck
    for p in procs:
        if p.poll() is None:
            p.kill()  # the stopped one (SIGKILL ends a stopped process too), or a hung one
        p.wait()
    return {
        "kind": kind,
        "target": target,
        "moment": moment,
        "from": before,
        "statuses": [p.returncode for p in procs],
        "seconds": seconds,
        "hung": hung,
        "saved": saved(workdir),
        "lines": [last_line(f"{logs}-p{i}.err") for i in range(2)],
    }


def expected(row) -> bool:
    """What the row's kind promises: nobody hung, and the statuses."""
    statuses, target = row["statuses"], row["target"]
    survivor = statuses[1 - target]
    if row["hung"]:
        return False
    if row["kind"] == "SIGTERM":
        return statuses == [75, 75]
    if row["kind"] == "disk full":
        return statuses == [1, 1] and row["saved"] == row["from"]
    # Stalled or killed: the survivor stopped by itself, by an error or its watchdog. A killed
    # process 0 takes JAX's coordination service with it, and the survivor's client aborts at once.
    aborted = (-signal.SIGABRT,) if row["kind"].startswith("kill") and target == 0 else ()
    return survivor in (1, 124, *aborted)


def final_params(workdir: str) -> dict:
    return flax.traverse_util.flatten_dict(checkpoint.load(workdir)[1], sep="/")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--floor", type=float, default=10.0, help="config.watchdog.floor_seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data_dir", default="", help="TFDS data dir (default: TFDS's)")
    parser.add_argument("--workdir", default="", help="parent of both runs (default: a tmp dir)")
    parser.add_argument("--json", help="write the rows and the final comparison here too")
    parser.add_argument("train_flags", nargs="*", help="more train.py flags (after --)")
    args = parser.parse_args()
    base = args.workdir or tempfile.mkdtemp(prefix="attnjax_multiprocess_faults_")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(base, "jax_cache")
    straight, faulted = os.path.join(base, "straight"), os.path.join(base, "faulted")

    began = time.perf_counter()
    for proc in start(train_command(straight, args), os.path.join(base, "straight"), env):
        assert proc.wait() == 0, "the uninterrupted run failed"
    print(f"uninterrupted run (2 processes x 2 devices): {time.perf_counter() - began:.0f}s")

    rng = random.Random(args.seed)
    plan = [KINDS[i % len(KINDS)] for i in range(args.faults)]
    rng.shuffle(plan)
    command = train_command(faulted, args)
    rows = []
    for i, kind in enumerate(plan, 1):
        logs = os.path.join(base, f"fault{i}")
        rows.append(fault(command, faulted, env, kind, rng.randint(0, 1), rng, logs))
    procs = start(command, os.path.join(base, "final"), env)
    final = [p.wait() for p in procs]

    print(f"\n{'#':>2}  {'fault':<17} {'proc':>4}  {'moment':<24} {'from':>4} {'exits':>9}")
    print(f"{'':>2}  {'s to end':>8} {'saved':>5}  ok  last lines (p0 | p1)")
    for i, row in enumerate(rows, 1):
        exits = "/".join(str(s) for s in row["statuses"])
        print(
            f"{i:>2}  {row['kind']:<17} {row['target']:>4}  {row['moment']:<24} "
            f"{row['from']:>4} {exits:>9} {row['seconds']:>6.1f}s {row['saved']:>5}  "
            f"{'yes' if expected(row) else 'NO'}\n      {row['lines'][0]}\n      {row['lines'][1]}"
        )
    reference, got = final_params(straight), final_params(faulted)
    same_keys = sorted(reference) == sorted(got)
    worst = max(
        float(np.max(np.abs(got[k] - v)) / max(float(np.max(np.abs(v))), 1e-30))
        for k, v in reference.items()
    )
    identical = same_keys and all(np.array_equal(got[k], v) for k, v in reference.items())
    as_expected, final_step = all(map(expected, rows)), saved(faulted)
    print(f"final run: exits {final}, latest checkpoint {final_step}")
    print(f"every fault as expected (nobody hung, statuses): {as_expected}")
    print(
        f"final parameters vs the uninterrupted run: bit-identical {identical}, largest "
        f"difference {worst:.1e} of a tensor's scale ({len(reference)} arrays)"
    )
    print(f"total {time.perf_counter() - began:.0f}s, workdirs under {base}")
    ok = as_expected and final == [0, 0] and same_keys and worst <= 1e-5
    if args.json:
        summary = {
            "faults": rows,
            "every_fault_as_expected": as_expected,
            "final_exits": final,
            "final_step": final_step,
            "bit_identical": identical,
            "largest_relative_difference": worst,
            "seconds": time.perf_counter() - began,
            "train_flags": args.train_flags,
            "floor_seconds": args.floor,
            "processor": f"{processor()} ({cpu_cores()} cores)",
        }
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
