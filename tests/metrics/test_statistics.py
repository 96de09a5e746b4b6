"""The streaming statistics against numpy over all features at once, the Frechet distance against
pytorch-fid's, and the statistics file against pytorch-fid's reader."""

import numpy as np
import pytest
from pytorch_fid import fid_score
from scipy import linalg

from attnjax.metrics import statistics


def _features(rng, n, d, scale=1.0):
    # An offset mean and correlated columns: a one-pass sum of squares would lose digits here.
    return 100.0 + scale * rng.standard_normal((n, d)) @ rng.standard_normal((d, d))


def test_batches_of_any_size_give_numpys_mean_and_covariance(np_rng):
    features = _features(np_rng, 203, 16).astype(np.float32)
    accumulated = statistics.GaussianStatistics()
    for start, stop in [(0, 1), (1, 50), (50, 50), (50, 173), (173, 203)]:
        accumulated.update(features[start:stop])
    assert accumulated.count == 203
    np.testing.assert_allclose(accumulated.mean, np.mean(features.astype(np.float64), axis=0))
    np.testing.assert_allclose(
        accumulated.covariance, np.cov(features.astype(np.float64), rowvar=False), rtol=1e-10
    )


def test_too_few_or_misshapen_features_are_refused():
    accumulated = statistics.GaussianStatistics()
    accumulated.update(np.ones((1, 4)))
    with pytest.raises(ValueError, match="at least 2"):
        print(accumulated.covariance)
    with pytest.raises(ValueError, match=r"\[n, 4\]"):
        accumulated.update(np.ones((3, 5)))


@pytest.mark.parametrize(
    "n, d",
    [(300, 8), (5, 64)],  # full-rank covariances; rank 4 of 64 (the eps path)
)
def test_frechet_distance_equals_pytorch_fids(np_rng, n, d):
    a, b = _features(np_rng, n, d), _features(np_rng, n, d, scale=1.3) + 0.5
    stats = [(x.mean(axis=0), np.cov(x, rowvar=False)) for x in (a, b)]
    expected = fid_score.calculate_frechet_distance(*stats[0], *stats[1])
    assert statistics.frechet_distance(*stats[0], *stats[1]) == pytest.approx(expected, rel=1e-9)
    scale = np.trace(stats[0][1])
    assert statistics.frechet_distance(*stats[0], *stats[0]) == pytest.approx(0, abs=1e-6 * scale)


def test_where_the_root_of_the_product_is_not_finite_both_add_eps(np_rng, monkeypatch, caplog):
    # scipy's sqrtm no longer fails on the singular products of few images; a root that is not
    # finite (older scipy, other matrices) sends both implementations down the eps path.
    a, b = _features(np_rng, 5, 32), _features(np_rng, 5, 32, scale=1.3)
    stats = [(x.mean(axis=0), np.cov(x, rowvar=False)) for x in (a, b)]
    singular = stats[0][1].dot(stats[1][1])
    sqrtm = linalg.sqrtm

    def failing_on_the_product(matrix, *args, **kwargs):
        root = sqrtm(matrix)
        if np.array_equal(matrix, singular):
            root = np.full_like(root, np.inf)
        return (root, 0.0) if args or kwargs else root

    monkeypatch.setattr(linalg, "sqrtm", failing_on_the_product)
    expected = fid_score.calculate_frechet_distance(*stats[0], *stats[1])
    assert statistics.frechet_distance(*stats[0], *stats[1]) == pytest.approx(expected, rel=1e-9)
    assert "singular product; adding 1e-06" in caplog.text


def test_gaussians_of_different_sizes_are_refused():
    with pytest.raises(ValueError, match="differ in size"):
        statistics.frechet_distance(np.zeros(2), np.eye(2), np.zeros(3), np.eye(3))


def test_saved_statistics_are_read_by_pytorch_fid_and_never_overwritten(tmp_path, np_rng):
    mu, sigma = np_rng.standard_normal(6), np.cov(np_rng.standard_normal((20, 6)), rowvar=False)
    path = statistics.save_statistics(tmp_path / "stats.npz", mu, sigma)
    theirs = fid_score.compute_statistics_of_path(path, None, 50, 6, "cpu")
    np.testing.assert_array_equal(theirs[0], mu)
    np.testing.assert_array_equal(theirs[1], sigma)
    before = (tmp_path / "stats.npz").read_bytes()
    with pytest.raises(ValueError, match="exists"):
        statistics.save_statistics(path, mu + 1, sigma)
    assert (tmp_path / "stats.npz").read_bytes() == before
    loaded = statistics.load_statistics(path)
    np.testing.assert_array_equal(loaded[0], mu)
    np.testing.assert_array_equal(loaded[1], sigma)


def test_a_bad_statistics_file_is_one_line_naming_it(tmp_path):
    np.savez(tmp_path / "other.npz", mean=np.zeros(3))
    np.save(tmp_path / "array.npz.npy", np.zeros(3))
    (tmp_path / "array.npz.npy").rename(tmp_path / "array.npz")
    np.savez(tmp_path / "shapes.npz", mu=np.zeros(3), sigma=np.zeros((2, 2)))
    (tmp_path / "text.npz").write_text("mu sigma")
    for name, expected in [
        ("other.npz", "not 'mu' and 'sigma'"),
        ("array.npz", "one array"),
        ("shapes.npz", "are not [d] and [d, d]"),
        ("text.npz", "text.npz"),
        ("missing.npz", "missing.npz"),
    ]:
        with pytest.raises(ValueError) as error:
            statistics.load_statistics(tmp_path / name)
        message = str(error.value)
        assert name in message and expected in message and "\n" not in message, message
