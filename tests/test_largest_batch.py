"""benchmarks/largest_batch.py's search, on memory curves of the shapes compiled programs show:
affine, refused by the compiler above a batch, and falling near the limit (XLA's
rematerialisation). The compiles are replaced by the curve: the search is what is tested."""

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import largest_batch  # noqa: E402

GIB = 1 << 30
MEMORY = 80 * GIB


def affine(batch):
    return 2 * GIB + batch * 0.1 * GIB


def refused_above_500(batch):
    return None if batch > 500 else 10 * GIB + batch * 0.01 * GIB


def falls_near_the_limit(batch):
    # Less memory at 680 than at 616 (the 1.4B prior with remat), falling until 900, then rising.
    if batch <= 616:
        return 20 * GIB + batch * (50 / 616) * GIB
    if batch <= 900:
        return 70 * GIB - (batch - 616) * 0.005 * GIB
    return 68.58 * GIB + (batch - 900) * 0.1 * GIB


def brute_force(curve, multiple=8):
    fits = [b for b in range(multiple, 4096, multiple) if (curve(b) or MEMORY + 1) <= MEMORY]
    return max(fits)


def search(curve, probes, monkeypatch):
    """``largest``'s result on ``curve``, and the per-device batches it compiled, in order."""
    compiled = []

    def train_bytes(config, task, target, per_device):
        compiled.append(per_device)
        return curve(per_device), 1.0

    monkeypatch.setattr(largest_batch, "train_bytes", train_bytes)
    target = types.SimpleNamespace(memory_per_device=MEMORY)
    return largest_batch.largest(None, None, target, 8, probes), compiled


@pytest.mark.parametrize("curve", [affine, refused_above_500, falls_near_the_limit])
@pytest.mark.parametrize("probes", [(8, 32), (616, 680)])
def test_search_finds_the_largest_fitting_multiple(curve, probes, monkeypatch):
    found, compiled = search(curve, probes, monkeypatch)
    expected = brute_force(curve)
    assert found["largest"] == expected, (compiled, expected)
    assert found["next_multiple"] == expected + 8
    assert len(compiled) <= 16, compiled


def test_two_failing_probes_close_to_the_limit_take_one_more_compile(monkeypatch):
    """Both probes just past the limit (the 1.4B prior with remat at 736 and 744): the line
    between them points one multiple below them, not halfway down."""

    def steep(batch):
        return 20 * GIB + batch * 0.07 * GIB + max(0, batch - 720) * 0.9 * GIB

    found, compiled = search(steep, (736, 744), monkeypatch)
    assert found["largest"] == brute_force(steep) == 728
    assert compiled == [736, 744, 728], compiled
