"""attnjax/train/collector.py: the collector's thresholds for tracing, raised and never lowered."""

import gc

import pytest

from attnjax.train import collector


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def test_defaults_are_raised_to_the_tracing_thresholds(thresholds):
    gc.set_threshold(700, 10, 10)  # Python's defaults
    collector.raise_thresholds()
    assert gc.get_threshold() == (50_000, 20, 20)


def test_higher_thresholds_a_process_set_stay(thresholds):
    gc.set_threshold(100_000, 5, 50)
    collector.raise_thresholds()
    assert gc.get_threshold() == (100_000, 20, 50)


def test_a_disabled_collector_stays_disabled(thresholds):
    gc.disable()
    try:
        collector.raise_thresholds()
        assert not gc.isenabled()
    finally:
        gc.enable()
