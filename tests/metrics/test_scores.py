"""Inception Score, precision/recall and KID against torch-fidelity's own functions on the same
logits and features."""

import numpy as np
import pytest
import torch
from torch_fidelity import metric_isc, metric_kid, metric_prc

from attnjax.metrics import scores


@pytest.mark.parametrize("n, splits", [(100, 10), (37, 4)])
def test_inception_score_equals_torch_fidelitys(np_rng, n, splits):
    logits = (3 * np_rng.standard_normal((n, 1008))).astype(np.float32)
    theirs = metric_isc.isc_features_to_metric(torch.from_numpy(logits), splits=splits)
    mean, std = scores.inception_score(logits, splits=splits)
    assert mean == pytest.approx(theirs[metric_isc.KEY_METRIC_ISC_MEAN], rel=1e-10)
    assert std == pytest.approx(theirs[metric_isc.KEY_METRIC_ISC_STD], rel=1e-8)


def test_precision_and_recall_equal_torch_fidelitys(np_rng):
    generated = np_rng.standard_normal((70, 16)).astype(np.float32)
    real = (1.2 * np_rng.standard_normal((90, 16)) + 0.4).astype(np.float32)
    expected = metric_prc.calculate_precision_recall_full(
        torch.from_numpy(generated), torch.from_numpy(real), neighborhood=3
    )
    assert scores.precision_recall(generated, real, block=32) == pytest.approx(expected, rel=1e-6)
    assert scores.precision_recall(real, real) == (1.0, 1.0)


def test_kernel_inception_distance_equals_torch_fidelitys(np_rng):
    generated = np_rng.standard_normal((60, 32)).astype(np.float32)
    real = (np_rng.standard_normal((50, 32)) + 0.3).astype(np.float32)
    theirs = metric_kid.kid_features_to_metric(
        torch.from_numpy(generated),
        torch.from_numpy(real),
        kid_subsets=7,
        kid_subset_size=20,
        verbose=False,
    )
    mean, std = scores.kernel_inception_distance(generated, real, subsets=7, subset_size=20)
    assert mean == pytest.approx(theirs[metric_kid.KEY_METRIC_KID_MEAN], rel=1e-4)
    assert std == pytest.approx(theirs[metric_kid.KEY_METRIC_KID_STD], rel=1e-3)


def test_too_few_points_are_refused():
    with pytest.raises(ValueError, match="n >= splits"):
        scores.inception_score(np.zeros((3, 10)))
    with pytest.raises(ValueError, match="more than k=3"):
        scores.precision_recall(np.zeros((3, 2)), np.zeros((9, 2)))
    with pytest.raises(ValueError, match="subset_size=1000"):
        scores.kernel_inception_distance(np.zeros((50, 2)), np.zeros((50, 2)))
