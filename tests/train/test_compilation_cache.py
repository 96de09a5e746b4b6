"""attnjax.train.compilation_cache: a second run reads its compiled programs from disk and says so;
the user's own cache and the switch are respected."""

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
from helpers import tiny_vit_flags

from attnjax.train import compilation_cache, executables, report

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIRST_STEP = re.compile(
    r"first step done ([\d.]+) s after the process started \(tracing ([\d.]+) s, lowering "
    r"([\d.]+) s, compiling ([\d.]+) s\): (\d+) compiled programs loaded in [\d.]+ s \((\d+) "
    r"read ahead\), (\d+) kept, (\d+) outputs read; (\d+) programs from the compilation cache "
    r"at (\S+) "
    r"\((-?[\d.]+) s of compiling saved\), (\d+) compiled and written to it"
)


def _run_with_own_cache(argv, cache, timeout, **env):
    """``python ARGV`` with ``cache`` as attnjax's compilation cache: not the suite's (conftest.py
    names that one in the environment), this test's own."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")},
        compilation_cache.ENV_DIR: str(cache),
        executables.ENV_DIR: "",  # in the cache's directory, as by default
        **env,
    }
    run = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run


def _train(workdir, digits_dir, cache):
    run = _run_with_own_cache(
        [
            *("train.py", "--config", "configs/vit_digits.py"),
            *("--workdir", str(workdir), f"--config.data.data_dir={digits_dir}"),
            *tiny_vit_flags(),
            *("--config.num_train_steps=2", "--config.eval_every=2", "--config.log_every=2"),
        ],
        cache,
        timeout=300,
    )
    (match,) = FIRST_STEP.findall(run.stdout + run.stderr)
    (seconds, tracing, lowering, compiling, loaded, ahead, kept, read, hits, directory, saved,
     written) = match  # fmt: skip
    assert directory == str(cache)
    # The stages are parts of the time to the first step, spent on at most two threads at once
    # (a cold start compiles its train step beside the initial state's programs).
    stages = [float(tracing), float(lowering), float(compiling)]
    assert all(s >= 0 for s in stages) and sum(stages) < 2 * float(seconds), match
    records = [r for r in report.read_metrics(str(workdir)) if "train/loss" in r]
    assert all("train/mfu" in r for r in records)  # the step's FLOPs still counted
    losses = [r["train/loss"] for r in records]
    return dict(
        stages=stages,
        loaded=int(loaded), ahead=int(ahead), kept=int(kept), read=int(read), hits=int(hits),
        saved=float(saved), written=int(written), losses=losses,
    )  # fmt: skip


def test_a_second_run_reads_its_programs_from_the_cache(digits_dir, tmp_path):
    cache = tmp_path / "cache"
    first = _train(tmp_path / "first", digits_dir, cache)
    # Kept whole: the run's keys, the init, the optimiser's init, the step keys and the train
    # step (the eval step comes after the first), each compiled past JAX's cache, which holds
    # none of them (XLA:CPU could not serialise them again from there). The train step once:
    # compiled ahead from the state's shapes, then called with the values.
    assert first["hits"] == 0 and first["saved"] == 0.0
    assert first["loaded"] == 0 and first["kept"] == 5 and first["read"] == 0
    assert first["ahead"] == 0  # no run before it listed programs
    assert min(first["stages"]) > 0
    kept = cache / executables.SUBDIRECTORY
    assert len(list(kept.glob(f"*{executables.SUFFIX}"))) >= 5  # each program written once

    second = _train(tmp_path / "second", digits_dir, cache)
    assert second["written"] == 0, "the second run compiled a program the first had written"
    # The programs loaded as compiled, without tracing; the init's outputs read, not computed.
    assert second["loaded"] == 4 and second["kept"] == 0 and second["read"] == 1
    # Each of them loaded on the thread the run started before its data: the first run listed
    # every program it used but the init, whose outputs the second reads instead.
    assert second["ahead"] == 4
    assert second["stages"] == [0.0, 0.0, 0.0]  # nothing traced, lowered or compiled
    assert second["losses"] == first["losses"]  # the same program: the same values, bit for bit


HOLD_LOCK = """
import sys, time, filelock
with filelock.FileLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_the_users_cache_and_the_switch_are_respected(tmp_path, monkeypatch, caplog):
    suites = jax.config.jax_compilation_cache_dir  # conftest.py's, as a user's own would be
    assert suites and compilation_cache.enable() == suites
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv(compilation_cache.ENV_DIR, "off")
        assert compilation_cache.enable() is None
        assert compilation_cache.summary() == "no persistent compilation cache"
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        monkeypatch.delenv(compilation_cache.ENV_DIR)
        assert compilation_cache.enable() == str(tmp_path / "attnjax" / "jax")
        assert jax.config.jax_compilation_cache_max_size == 4 * 2**30
        # Another process holding JAX's lock on the directory past the wait: the command starts,
        # the entries unchecked.
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setattr(compilation_cache, "LOCK_WAIT_SECONDS", 0.2)
        directory = tmp_path / "attnjax" / "jax"
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD_LOCK, str(directory / ".lockfile")],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout.readline().strip() == "held"
            with caplog.at_level("WARNING"):
                assert compilation_cache.enable() == str(directory)
            assert f"compilation cache {directory}: entries not checked" in caplog.text
        finally:
            holder.kill()
            holder.wait()
    finally:
        jax.config.update("jax_compilation_cache_dir", suites)
        jax.config.update("jax_compilation_cache_max_size", -1)


PROGRAMS = """
import json, warnings
import jax, jax.numpy as jnp
from attnjax.train import compilation_cache, executables, report
compilation_cache.enable()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for n in (8, 16):
        jax.jit(lambda x: jnp.sin(x) @ jnp.cos(x).T)(jnp.ones((n, n))).block_until_ready()
warned = [str(w.message) for w in caught]
print(json.dumps({"counts": compilation_cache.counts(), "warnings": warned}))
"""


def _compile_two_programs(cache):
    run = _run_with_own_cache(
        ["-c", PROGRAMS], cache, timeout=120, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"
    )
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def test_an_entry_a_killed_process_left_unfinished_is_removed_and_the_cache_writes_again(tmp_path):
    """JAX writes an entry, then its last-use file; killed in between (or inside the entry), the
    directory holds an entry without one, and every later write fails on it ("Error writing
    persistent compilation cache entry ... -atime"). Here: a real entry cut to half its bytes and
    its last-use file gone, as a kill -9 inside the write leaves them."""
    cache = tmp_path / "cache"
    first, _ = _compile_two_programs(cache)
    assert first["warnings"] == [] and first["counts"]["hits"] == 0
    entries = sorted(cache.glob("jit__lambda-*-cache"))
    assert len(entries) == 2
    cut = entries[0]
    cut_use = cut.with_name(cut.name.removesuffix("-cache") + "-atime")
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    cut_use.unlink()

    second, log = _compile_two_programs(cache)
    assert second["warnings"] == []
    assert f"removed 1 entry a killed process left unfinished: {cut.name}" in log
    # The intact program is read; the cut one compiled again and written whole, with its use file.
    assert second["counts"]["hits"] >= 1 and second["counts"]["misses"] >= 1
    assert sorted(cache.glob("jit__lambda-*-cache")) == entries
    assert cut.stat().st_size > 0 and cut_use.exists()
    third, _ = _compile_two_programs(cache)
    assert third["warnings"] == [] and third["counts"]["misses"] == 0


def test_bypassed_blocks_on_two_threads_restore_the_setting_when_the_last_leaves():
    """A train step compiles past the cache on a thread while the initial state's program does
    on the caller's: the cache stays off until both are done, then is as it was."""
    import threading

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", True)
    entered, leave = threading.Event(), threading.Event()

    def other():
        with compilation_cache.bypassed():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    try:
        with compilation_cache.bypassed():
            thread.start()
            assert entered.wait(10)
        assert jax.config.jax_enable_compilation_cache is False  # the thread is still inside
        leave.set()
        thread.join(10)
        assert jax.config.jax_enable_compilation_cache is True
    finally:  # the worker's process goes on with its own setting whatever happened here
        leave.set()
        jax.config.update("jax_enable_compilation_cache", before)
