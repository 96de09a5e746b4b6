"""Scores of generated images beyond FID, on features ``[n, d]`` or logits ``[n, classes]``.

- ``inception_score``: ``exp(E_x KL(p(y|x) || p(y)))`` per split, its mean and standard
  deviation over ``splits`` consecutive chunks of the shuffled images, as torch-fidelity does
  (its ``RandomState(2020)`` permutation, chunk ``i`` = rows ``[i n / s, (i + 1) n / s)``),
  in float64. Give it the unbiased logits (``"logits_unbiased"``), torch-fidelity's default.
- ``precision_recall``: the improved precision and recall of Kynkaanniemi et al. (2019): each
  set's manifold is the union of balls around its points reaching their k-th nearest neighbour
  (k = 3, the point itself not counted); precision is the share of generated points inside the
  real manifold, recall the share of real points inside the generated one.
- ``kernel_inception_distance``: the unbiased MMD^2 with the cubic polynomial kernel
  ``(x . y / d + 1)^3`` over random subsets, torch-fidelity's draws and defaults.

Argument order is torch-fidelity's: generated first, real second. numpy only, float64.
"""

from __future__ import annotations

import numpy as np
from scipy import special


def inception_score(
    logits, splits: int = 10, shuffle: bool = True, seed: int = 2020
) -> tuple[float, float]:
    """``logits [n, classes]`` -> (mean, standard deviation) of the Inception Score over
    ``splits`` chunks."""
    logits = np.asarray(logits, np.float64)
    if logits.ndim != 2 or len(logits) < splits:
        raise ValueError(
            f"inception_score: logits must be [n, classes] with n >= splits={splits}, "
            f"got {logits.shape}"
        )
    n = len(logits)
    if shuffle:
        logits = logits[np.random.RandomState(seed).permutation(n)]
    log_p = special.log_softmax(logits, axis=1)
    p = np.exp(log_p)
    scores = []
    for i in range(splits):
        rows = slice(i * n // splits, (i + 1) * n // splits)
        log_marginal = np.log(p[rows].mean(axis=0, keepdims=True))
        kl = (p[rows] * (log_p[rows] - log_marginal)).sum(axis=1)
        scores.append(np.exp(kl.mean()))
    return float(np.mean(scores)), float(np.std(scores))


def _distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Euclidean distances ``[len(a), len(b)]``."""
    squared = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * (a @ b.T)
    return np.sqrt(np.maximum(squared, 0.0))


def _radii(points: np.ndarray, k: int, block: int) -> np.ndarray:
    """The distance of each point to its k-th nearest other point (the k+1-th nearest, itself
    included at distance 0, as torch-fidelity counts)."""
    radii = [
        np.partition(_distances(points[start : start + block], points), k, axis=1)[:, k]
        for start in range(0, len(points), block)
    ]
    return np.concatenate(radii)


def _inside(queries: np.ndarray, points: np.ndarray, radii: np.ndarray, block: int) -> float:
    """The share of ``queries`` within ``radii`` of some point of ``points``."""
    hits = [
        (_distances(queries[start : start + block], points) <= radii[None, :]).any(axis=1)
        for start in range(0, len(queries), block)
    ]
    return float(np.concatenate(hits).mean())


def precision_recall(generated, real, k: int = 3, block: int = 1024) -> tuple[float, float]:
    """Features ``generated [n, d]`` and ``real [m, d]`` -> (precision, recall).

    ``block`` rows of distances are held at a time (``[block, n]`` float64), so memory grows
    with the number of images, not its square.
    """
    generated, real = np.asarray(generated, np.float64), np.asarray(real, np.float64)
    if generated.ndim != 2 or real.ndim != 2 or generated.shape[1] != real.shape[1]:
        raise ValueError(
            f"precision_recall: features must be [n, d] and [m, d], got {generated.shape} and "
            f"{real.shape}"
        )
    if min(len(generated), len(real)) <= k:
        raise ValueError(f"precision_recall: each set needs more than k={k} points")
    precision = _inside(generated, real, _radii(real, k, block), block)
    recall = _inside(real, generated, _radii(generated, k, block), block)
    return precision, recall


def _polynomial_kernel(x: np.ndarray, y: np.ndarray, degree: int, gamma, coef0: float):
    gamma = 1.0 / x.shape[1] if gamma is None else gamma
    return (x @ y.T * gamma + coef0) ** degree


def _unbiased_mmd2(k_xx: np.ndarray, k_xy: np.ndarray, k_yy: np.ndarray) -> float:
    m = len(k_xx)
    within = (k_xx.sum() - np.trace(k_xx) + k_yy.sum() - np.trace(k_yy)) / (m * (m - 1))
    return float(within - 2 * k_xy.sum() / (m * m))


def kernel_inception_distance(
    generated,
    real,
    subsets: int = 100,
    subset_size: int = 1000,
    degree: int = 3,
    gamma: float | None = None,
    coef0: float = 1.0,
    seed: int = 2020,
) -> tuple[float, float]:
    """Features ``generated [n, d]`` and ``real [m, d]`` -> (mean, standard deviation) of the
    unbiased MMD^2 over ``subsets`` draws of ``subset_size`` rows of each, without replacement."""
    generated, real = np.asarray(generated, np.float64), np.asarray(real, np.float64)
    if generated.ndim != 2 or real.ndim != 2 or generated.shape[1] != real.shape[1]:
        raise ValueError(
            f"kernel_inception_distance: features must be [n, d] and [m, d], got "
            f"{generated.shape} and {real.shape}"
        )
    if min(len(generated), len(real)) < subset_size:
        raise ValueError(
            f"kernel_inception_distance: subset_size={subset_size} is more than the "
            f"{len(generated)} generated or {len(real)} real feature vectors"
        )
    rng = np.random.RandomState(seed)
    mmds = []
    for _ in range(subsets):
        x = generated[rng.choice(len(generated), subset_size, replace=False)]
        y = real[rng.choice(len(real), subset_size, replace=False)]
        kernel = lambda a, b: _polynomial_kernel(a, b, degree, gamma, coef0)
        mmds.append(_unbiased_mmd2(kernel(x, x), kernel(x, y), kernel(y, y)))
    return float(np.mean(mmds)), float(np.std(mmds))
