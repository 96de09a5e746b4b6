"""attnjax.ops.autotune: the switch, the margin and the on-disk cache, with fake timings."""

import json
import time

import pytest

from attnjax.ops import autotune


@pytest.fixture
def cache(monkeypatch, tmp_path):
    path = tmp_path / "attnjax" / "cpu_rules.json"
    monkeypatch.setenv(autotune.ENV_CACHE, str(path))
    monkeypatch.setattr(autotune, "_enabled", True)
    monkeypatch.setattr(autotune, "_choices", {})
    monkeypatch.setattr(autotune, "_tables", {})
    return path


def _timed(seconds, calls):
    def time_candidates(candidates):
        calls.append(sorted(candidates))
        return dict(seconds)

    return time_candidates


CANDIDATES = {"a": lambda: lambda: None, "b": lambda: lambda: None}


def test_the_fastest_is_chosen_once_and_kept_on_disk(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(autotune, "time_candidates", _timed({"a": 2.0, "b": 1.0}, calls))
    with autotune.timing_window():
        assert autotune.choose("rule", "shape 1", CANDIDATES, default="a") == "b"
    assert autotune.choose("rule", "shape 1", CANDIDATES, default="a") == "b"
    assert calls == [["a", "b"]]
    ((name, entry),) = json.loads(cache.read_text()).items()
    assert name == autotune.cache_key("rule", "shape 1")
    assert autotune.processor() in name and entry["choice"] == "b"

    autotune.forget()  # a new process: read from disk, not timed again
    assert autotune.choose("rule", "shape 1", CANDIDATES, default="a") == "b"
    assert len(calls) == 1
    with autotune.timing_window():
        assert autotune.choose("rule", "shape 2", CANDIDATES, default="a") == "b"
    assert len(calls) == 2 and len(json.loads(cache.read_text())) == 2


def test_outside_a_window_a_new_key_costs_nothing_until_a_window_times_it(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(autotune, "time_candidates", _timed({"a": 2.0, "b": 1.0}, calls))
    assert autotune.choose("rule", "new", CANDIDATES, default="a") == "a"
    assert calls == [] and not cache.exists()
    with autotune.timing_window():
        with autotune.timing_window():
            assert autotune.choose("rule", "new", CANDIDATES, default="a") == "b"
        assert autotune.timing_allowed()  # the outer window is still open
    assert not autotune.timing_allowed()
    assert autotune.choose("rule", "new", CANDIDATES, default="a") == "b"  # read, not timed
    assert len(calls) == 1


def test_the_table_is_parsed_again_only_when_another_process_changed_it(cache, monkeypatch):
    monkeypatch.setattr(autotune, "time_candidates", _timed({"a": 2.0, "b": 1.0}, []))
    with autotune.timing_window():
        autotune.choose("rule", "timed", CANDIDATES, default="a")
    parsed = []
    read = autotune._read
    monkeypatch.setattr(autotune, "_read", lambda path: parsed.append(path) or read(path))
    for _ in range(3):  # never timed, met at every trace: one parse of the unchanged file
        assert autotune.choose("rule", "elsewhere", CANDIDATES, default="a") == "a"
    assert len(parsed) == 1
    table = json.loads(cache.read_text())
    table[autotune.cache_key("rule", "elsewhere")] = {"choice": "b", "seconds": {}}
    cache.write_text(json.dumps(table))  # another process timed it meanwhile
    assert autotune.choose("rule", "elsewhere", CANDIDATES, default="a") == "b"
    assert len(parsed) == 2


def test_always_times_every_new_key_wherever_it_is_met(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(autotune, "time_candidates", _timed({"a": 2.0, "b": 1.0}, calls))
    monkeypatch.setattr(autotune, "_enabled", None)
    monkeypatch.setenv(autotune.ENV_SWITCH, "always")
    assert autotune.enabled() and autotune.timing_allowed()
    assert autotune.choose("rule", "anywhere", CANDIDATES, default="a") == "b"
    assert len(calls) == 1


def test_the_default_stays_unless_beaten_by_the_margin(cache, monkeypatch):
    close = {"a": 1.0, "b": 1.0 - autotune.MARGIN / 2}
    monkeypatch.setattr(autotune, "time_candidates", _timed(close, []))
    with autotune.timing_window():
        assert autotune.choose("rule", "close", CANDIDATES, default="a") == "a"


def test_switched_off_the_default_is_chosen_untimed(cache, monkeypatch):
    monkeypatch.setattr(autotune, "time_candidates", lambda *a: pytest.fail("timed"))
    monkeypatch.setattr(autotune, "_enabled", None)
    monkeypatch.setenv(autotune.ENV_SWITCH, "0")
    assert not autotune.enabled()
    with autotune.timing_window():
        assert autotune.choose("rule", "shape", CANDIDATES, default="b") == "b"
    autotune.set_enabled(False)
    monkeypatch.setenv(autotune.ENV_SWITCH, "1")
    assert autotune.choose("rule", "shape", CANDIDATES, default="a") == "a"
    assert not cache.exists()


def test_real_timings_are_per_candidate():
    seconds = autotune.time_candidates({"noop": lambda: lambda: None}, repeats=3)
    assert list(seconds) == ["noop"] and seconds["noop"] >= 0.0


def test_timings_are_the_median_round(monkeypatch):
    """A first round that favours "a" is outvoted by the two after it, which favour "b"."""
    rounds = iter(
        [{"a": [1.8, 2.5], "b": [2.0]}, {"a": [3.0], "b": [2.5]}, {"a": [4.0], "b": [2.0]}]
    )
    monkeypatch.setattr(autotune, "alternating_times", lambda calls, repeats, **_: next(rounds))
    candidates = {"a": lambda: lambda: None, "b": lambda: lambda: None}
    assert autotune.time_candidates(candidates, rounds=3) == {"a": 3.0, "b": 2.0}


@pytest.mark.parametrize(
    "rounds, seconds, timed",
    [
        # c, 2x behind after the first round, runs no more; a and b, within 1.5x of each other,
        # run all three rounds, and c's one round is its time.
        (
            [{"a": 1.0, "b": 1.4, "c": 2.0}, {"a": 1.2, "b": 1.1}, {"a": 1.3, "b": 1.0}],
            {"a": 1.2, "b": 1.1, "c": 2.0},
            [["a", "b", "c"], ["a", "b"], ["a", "b"]],
        ),
        # b and c both beyond 1.5x after the first round: the timing ends there.
        ([{"a": 1.0, "b": 1.6, "c": 3.0}], {"a": 1.0, "b": 1.6, "c": 3.0}, [["a", "b", "c"]]),
    ],
)
def test_a_candidate_far_behind_leaves_the_later_rounds(monkeypatch, rounds, seconds, timed):
    calls_per_round, rounds = [], iter(rounds)

    def alternating_times(calls, repeats, **_):
        calls_per_round.append(sorted(calls))
        return {name: [t] for name, t in next(rounds).items() if name in calls}

    monkeypatch.setattr(autotune, "alternating_times", alternating_times)
    candidates = {name: (lambda: lambda: None) for name in "abc"}
    assert autotune.time_candidates(candidates, rounds=3) == seconds
    assert calls_per_round == timed


def test_later_rounds_repeat_without_warm_up():
    """Real calls: the first round warms each call up and sizes the repeats; the others make
    exactly as many calls as it sized, and the benchmark's rounds (no drop_ratio) all run."""
    counts = {"fast": 0, "slow": 0}

    def make(name, seconds):
        def call():
            counts[name] += 1
            time.sleep(seconds)

        return call

    calls = {"fast": make("fast", 0.001), "slow": make("slow", 0.01)}
    per_round = autotune.fastest_per_round(calls, repeats=3, rounds=3)
    assert [len(t) for t in per_round.values()] == [3, 3]
    assert counts["fast"] == counts["slow"]
    sized = (counts["fast"] - 2) // 3  # one warm-up and one sizing call, then 3 equal rounds
    assert counts["fast"] == 2 + 3 * sized and sized >= 3
    assert min(per_round["slow"]) > 3 * max(per_round["fast"])


def test_short_calls_are_repeated_until_min_seconds():
    calls = []

    def call():
        calls.append(None)
        time.sleep(0.002)

    times = autotune.alternating_times({"a": call}, repeats=3, min_seconds=0.2)
    # About 0.2 s / 2 ms calls; a loaded machine stretches the sleeps and so sizes fewer.
    assert 10 <= len(times["a"]) <= 101, len(times["a"])
    assert len(calls) == len(times["a"]) + 2  # one warm-up call and one to size the repeats
