"""Interrupts one training run again and again, then checks it lost nothing.

    python benchmarks/faults.py [--kills 10] [--sigterms 3] [--steps 300] [--seed 0] \
        [-- --config.model.width=16 ...]   # extra train.py flags, e.g. a smaller model

``configs/vit_digits.py`` shortened to ``--steps`` steps with a checkpoint every 25: first an
uninterrupted run, then the same command started again and again in a second workdir, each
time stopped by ``kill -9`` (at a random step 5 to 30 past the last one logged, or while Orbax is
writing a checkpoint: its ``<step>.orbax-checkpoint-tmp`` directory is on disk) or by SIGTERM
(expected: a checkpoint at the current step and exit status 75), then one last run to the
end. Prints one table row per interruption and compares the final parameters of the two
workdirs bit for bit, and checks that metrics.jsonl holds each step once.
"""

from __future__ import annotations

import argparse
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

from attnjax.train import checkpoint, preemption  # noqa: E402

TMP_MARK = ".orbax-checkpoint-tmp"


def train_command(workdir: str, steps: int, data_dir: str, extra: list[str]) -> list[str]:
    command = [
        sys.executable,
        "train.py",
        "--config",
        "configs/vit_digits.py",
        "--workdir",
        workdir,
        f"--config.num_train_steps={steps}",
        "--config.checkpoint_every=25",
        "--config.log_every=5",
        "--config.eval_every=100",
    ]
    if data_dir:
        command.append(f"--config.data.data_dir={data_dir}")
    return command + extra


def saved_steps(workdir: str) -> list[int]:
    directory = os.path.join(workdir, "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(int(n) for n in names if n.isdigit())


def logged_steps(workdir: str) -> list[int]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    steps = []
    with open(path) as f:
        for line in f:
            try:
                steps.append(json.loads(line)["step"])
            except ValueError:
                pass  # a line cut short by the kill
    return steps


def temporary_dirs(workdir: str) -> set:
    """(name, inode) of Orbax's temporary directories: a killed write leaves one behind, and a
    new write of the same step replaces it, so a write in progress is a pair not seen before."""
    directory = os.path.join(workdir, "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    found = set()
    for name in names:
        if TMP_MARK in name:
            try:
                found.add((name, os.stat(os.path.join(directory, name)).st_ino))
            except FileNotFoundError:
                pass  # renamed to its final name meanwhile
    return found


def interrupt(command, workdir, env, how: str, rng: random.Random) -> dict:
    """Starts ``command``, waits for the moment ``how`` asks for, sends the signal."""
    before = max(saved_steps(workdir), default=0)
    # Records past the restored step are rewritten by the new run: wait for one beyond them.
    logged_before = max(logged_steps(workdir), default=0)
    old_temporary = temporary_dirs(workdir)
    # A random moment within the next 30 steps (logs come every 5; one step takes ~10 ms).
    target = logged_before + 5 * rng.randint(1, 6)
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    moment, new_temporary = "", set()
    while proc.poll() is None:
        new_temporary = temporary_dirs(workdir) - old_temporary
        if how == "kill -9 during write" and new_temporary:
            moment = f"writing {sorted(new_temporary)[0][0].split('.')[0]}"
            break
        if how != "kill -9 during write" and max(logged_steps(workdir), default=0) >= target:
            delay = rng.uniform(0.0, 0.1)
            time.sleep(delay)
            moment = f"{delay:.2f}s after logging step {target}"
            break
        time.sleep(0.001)
    started_write = bool(new_temporary or temporary_dirs(workdir) - old_temporary)
    proc.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGKILL)
    _, stderr = proc.communicate()
    return {
        "how": how,
        "moment": moment or "(ended first)",
        "from": before,
        "status": proc.returncode,
        "tmp_dir_seen": started_write,
        "saved": max(saved_steps(workdir), default=0),
        "message": stderr.strip().splitlines()[-1] if stderr.strip() else "",
    }


def final_params(workdir: str) -> dict:
    _, params = checkpoint.load(workdir)
    return flax.traverse_util.flatten_dict(params, sep="/")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--sigterms", type=int, default=3)
    parser.add_argument("--kills_during_write", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data_dir", default="", help="TFDS data dir (default: TFDS's)")
    parser.add_argument("--workdir", default="", help="parent of both runs (default: a tmp dir)")
    parser.add_argument("train_flags", nargs="*", help="more train.py flags (after --)")
    args = parser.parse_args()
    base = args.workdir or tempfile.mkdtemp(prefix="attnjax_faults_")
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": os.path.join(base, "jax_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    straight, faulted = os.path.join(base, "straight"), os.path.join(base, "faulted")

    start = time.perf_counter()
    subprocess.run(
        train_command(straight, args.steps, args.data_dir, args.train_flags),
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    print(f"uninterrupted run: {time.perf_counter() - start:.0f}s")

    rng = random.Random(args.seed)
    plan = (
        ["kill -9 during write"] * args.kills_during_write
        + ["kill -9"] * (args.kills - args.kills_during_write)
        + ["SIGTERM"] * args.sigterms
    )
    rng.shuffle(plan)
    command = train_command(faulted, args.steps, args.data_dir, args.train_flags)
    rows = [interrupt(command, faulted, env, how, rng) for how in plan]
    resumed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)

    print(
        f"\n{'#':>2}  {'signal':<21} {'moment':<30} {'from':>5} {'exit':>5} {'saved':>5}  "
        f"{'write in progress'}"
    )
    for i, row in enumerate(rows, 1):
        print(
            f"{i:>2}  {row['how']:<21} {row['moment']:<30} {row['from']:>5} "
            f"{row['status']:>5} {row['saved']:>5}  {row['tmp_dir_seen']}"
        )
    print(f"final run: exit {resumed.returncode}, checkpoints {saved_steps(faulted)}")

    sigterm_ok = all(
        r["status"] == preemption.REQUEUE_EXIT_CODE
        and f"stopped by SIGTERM after step {r['saved']};" in r["message"]
        for r in rows
        if r["how"] == "SIGTERM"
    )
    kills_ok = all(r["status"] == -signal.SIGKILL for r in rows if r["how"] != "SIGTERM")
    during_write = sum(r["how"] != "SIGTERM" and r["tmp_dir_seen"] for r in rows)
    expected, got = final_params(straight), final_params(faulted)
    identical = sorted(expected) == sorted(got) and all(
        np.array_equal(expected[k], got[k]) for k in expected
    )
    train_steps = [
        json.loads(line)["step"]
        for line in open(os.path.join(faulted, "metrics.jsonl"))
        if "train/loss" in line
    ]
    once = train_steps == list(range(5, args.steps + 1, 5))
    print(
        f"kills with status -9: {kills_ok}; killed during a checkpoint write: {during_write}; "
        f"SIGTERM saved the current step and exited {preemption.REQUEUE_EXIT_CODE}: "
        f"{sigterm_ok}"
    )
    print(f"metrics.jsonl: each train step once: {once}")
    print(
        f"final parameters bit-identical to the uninterrupted run: {identical} "
        f"({len(expected)} arrays, {sum(v.size for v in expected.values())} values)"
    )
    print(f"total {time.perf_counter() - start:.0f}s, workdirs under {base}")
    return 0 if identical and once and kills_ok and sigterm_ok and resumed.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
