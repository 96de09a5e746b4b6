"""Choices between equivalent CPU programs, made by timing both on the processor at hand.

A CPU kernel that wins on one processor can lose on another (benchmarks/results/cpu_rules.md),
so where attnjax has two programs for the same result it can time both and remember the winner
on disk, as cuDNN's benchmark mode and XLA's GPU autotuner do::

    path = choose("conv_kernel_gradient", key, {"xla": build_xla, "products": build_products},
                  default="xla")

Each candidate is a thunk that compiles its program and returns a call that blocks until done.
A key names a class of calls (attention buckets its lengths, see ``kernel_choice.cpu_shape_class``),
so one timing serves every shape of the class. Timing costs seconds, so it runs only where asked
for: inside ``timing_window()`` (the training loop opens one around its first step and first
evaluation: the programs it will run thousands of times) and in ``python -m attnjax.ops.warm``,
ahead of time. Anywhere else a choice is read from the cache or, for a class never timed, is its
``default``, untimed: a new shape costs nothing. Choices run at trace time, outside the trace
(``jax.ensure_compile_time_eval``), and are cached per processor, jax version, ``$XLA_FLAGS``
and key in ``$ATTNJAX_CPU_AUTOTUNE_CACHE`` (default ``~/.cache/attnjax/cpu_rules.json``).

``$ATTNJAX_CPU_AUTOTUNE``: ``0`` (or ``set_enabled(False)``) makes every choice its ``default``,
cache or not, so runs and tests that need the same program on every machine get it; ``always``
times every new key wherever it is met. The candidates' outputs agree to float32 rounding.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable

import jax

from attnjax import xla_cpu
from attnjax.ops.platform import processor

ENV_SWITCH = "ATTNJAX_CPU_AUTOTUNE"
ENV_CACHE = "ATTNJAX_CPU_AUTOTUNE_CACHE"
REPEATS = 7
# Short calls are repeated until each candidate has run this long: the fastest of 7 calls of a
# millisecond differs by 5-10% from one measurement to the next, of 100 such calls by 1-2%.
MIN_SECONDS = 0.1
MAX_REPEATS = 1000
# The choice takes the median of this many rounds: one round's fastest, at millisecond calls, has
# favoured the path that every later round found slower (benchmarks/results/cpu_rules.md).
ROUNDS = 3
# Another candidate replaces the default only when at least this much faster: closer timings are
# within the noise of the fastest of REPEATS calls (benchmarks/results/cpu_rules.md), and the
# default is the program every machine runs with the timing off.
MARGIN = 0.02
# After a round, a candidate this much slower than the fastest runs no further rounds: in
# benchmarks/results/cpu_rules.md one round's ratio strays from the median of five by at most
# 0.33 (1.07 against 1.34), so a candidate 1.5x behind in one round has never won the median.
DROP_RATIO = 1.5

_enabled: bool | None = None  # set_enabled's override of $ATTNJAX_CPU_AUTOTUNE
_choices: dict[str, str] = {}  # this process's choices, read from or written to the cache
_windows = 0  # open timing_window()s


def set_enabled(flag: bool | None) -> None:
    """Turns timing on or off for this process; ``None`` defers to ``$ATTNJAX_CPU_AUTOTUNE``."""
    global _enabled
    _enabled = flag


def enabled() -> bool:
    """Whether choices are timed (on unless ``$ATTNJAX_CPU_AUTOTUNE`` is ``0`` or off)."""
    if _enabled is not None:
        return _enabled
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def times_everywhere() -> bool:
    """``$ATTNJAX_CPU_AUTOTUNE=always``: every new key is timed where it is met."""
    return os.environ.get(ENV_SWITCH, "").strip().lower() == "always"


@contextlib.contextmanager
def timing_window():
    """Choices met inside are timed when the cache lacks them (outside: their default)."""
    global _windows
    _windows += 1
    try:
        yield
    finally:
        _windows -= 1


def timing_allowed() -> bool:
    return enabled() and (_windows > 0 or times_everywhere())


def cache_path() -> pathlib.Path:
    if os.environ.get(ENV_CACHE):
        return pathlib.Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "attnjax" / "cpu_rules.json"


def cache_key(rule: str, key: str) -> str:
    # The XLA flags choose XLA's own kernels (attnjax.xla_cpu): a choice timed against one set
    # says nothing of another.
    flags = " ".join(sorted(xla_cpu.in_effect().split())) or "no XLA flags"
    return f"{rule} | {processor()} | jax {jax.__version__} | {flags} | {key}"


def _read(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: time again
        return {}


# path -> ((mtime, size), table) as last read: the size too, as a write within one tick of the
# file system's clock keeps the mtime (an entry added makes the file longer)
_tables: dict[str, tuple[tuple[int, int], dict]] = {}


def _table(path: pathlib.Path) -> dict:
    """``_read(path)``, parsed again only when the file changed: a trace outside a timing window
    asks for keys that were never timed, once per traced attention call."""
    try:
        status = path.stat()
    except OSError:
        return {}
    stamp = (status.st_mtime_ns, status.st_size)
    cached = _tables.get(str(path))
    if cached is None or cached[0] != stamp:
        cached = _tables[str(path)] = (stamp, _read(path))
    return cached[1]


def _write(path: pathlib.Path, name: str, entry: dict) -> None:
    """Adds one entry; another process's entries written meanwhile are kept."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = _read(path)
        table[name] = entry
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
    except OSError:  # a read-only home: the choice still holds for this process
        pass


def time_candidates(
    candidates: dict[str, Callable[[], Callable[[], object]]],
    repeats: int = REPEATS,
    rounds: int = ROUNDS,
) -> dict[str, float]:
    """Per candidate, the fastest of ``repeats`` calls in seconds, after one warm-up call each,
    measured in up to ``rounds`` rounds: the median round. The calls alternate (A B A B ...), so
    a load that comes and goes weighs on every candidate alike, and the minimum is the call it
    disturbed least. A candidate ``DROP_RATIO`` behind the fastest after a round runs no more
    rounds (its median so far stands), and the timing ends when one is left: ViT-B/16's
    attention forward, 2-3x slower on two of its three paths, takes one round instead of three."""
    with jax.ensure_compile_time_eval():
        calls = {name: build() for name, build in candidates.items()}
        per_round = fastest_per_round(calls, repeats, rounds, drop_ratio=DROP_RATIO)
    return {name: statistics.median(t) for name, t in per_round.items()}


def fastest_per_round(
    calls: dict[str, Callable[[], object]],
    repeats: int,
    rounds: int,
    drop_ratio: float | None = None,
) -> dict[str, list[float]]:
    """``{name: [seconds of the fastest call of each round]}``: ``rounds`` rounds of
    ``alternating_times``, the warm-up and the sizing of the repeats in the first only. With
    ``drop_ratio``, a candidate whose median round so far is more than ``drop_ratio`` times the
    fastest's leaves the later rounds, and they end when one candidate is left."""
    per_round = {name: [] for name in calls}
    running = dict(calls)
    for index in range(rounds):
        times = alternating_times(running, repeats, warm_up=index == 0)
        for name, t in times.items():
            per_round[name].append(min(t))
        repeats = max(len(t) for t in times.values())  # as sized in the first round
        if drop_ratio is not None:
            medians = {name: statistics.median(per_round[name]) for name in running}
            best = min(medians.values())
            running = {n: c for n, c in running.items() if medians[n] <= drop_ratio * best}
            if len(running) == 1:
                break
    return per_round


def alternating_times(
    calls: dict[str, Callable[[], object]],
    repeats: int,
    min_seconds: float = MIN_SECONDS,
    warm_up: bool = True,
) -> dict[str, list]:
    """Seconds of at least ``repeats`` calls of each blocking call, after one warm-up call each,
    the calls alternating (A B A B ...); more calls where the fastest candidate's would add up
    to less than ``min_seconds``. ``warm_up=False``: calls warmed and sized before, exactly
    ``repeats`` of them."""
    if warm_up:
        for call in calls.values():
            call()
        shortest = float("inf")
        for call in calls.values():
            start = time.perf_counter()
            call()
            shortest = min(shortest, time.perf_counter() - start)
        repeats = max(repeats, min(MAX_REPEATS, math.ceil(min_seconds / max(shortest, 1e-6))))
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def choose(
    rule: str,
    key: str,
    candidates: dict[str, Callable[[], Callable[[], object]]],
    default: str,
) -> str:
    """The fastest candidate's name for ``rule`` at ``key`` on this processor, read from the cache
    or, inside a ``timing_window``, timed once and cached; ``default`` when timing is off, when
    the key was never timed and no window is open, or when no candidate beats it by ``MARGIN``."""
    # The processes of one multi-process run must trace the same program: no per-host timings.
    if not enabled() or jax.process_count() > 1:
        return default
    name = cache_key(rule, key)
    if name not in _choices:
        path = cache_path()
        entry = _table(path).get(name)
        if entry is None or entry.get("choice") not in candidates:
            if not timing_allowed():
                return default  # not remembered: a window opened later still times it
            seconds = time_candidates(candidates)
            fastest = min(seconds, key=seconds.get)
            if seconds[fastest] > (1 - MARGIN) * seconds[default]:
                fastest = default
            entry = {"choice": fastest, "seconds": seconds}
            _write(path, name, entry)
        _choices[name] = entry["choice"]
    return _choices[name]


def forget() -> None:
    """Drops this process's remembered choices (the disk cache is read again)."""
    _choices.clear()
    _tables.clear()
