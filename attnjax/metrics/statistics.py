"""The Gaussian statistics of FID: a streaming mean and covariance, the Frechet distance, and
pytorch-fid's statistics file.

``GaussianStatistics`` takes feature batches ``[n, d]`` one at a time and keeps only the count,
the mean ``[d]`` and the centred sum of outer products ``[d, d]``, all float64, merged batch by
batch (the pairwise update of Chan, Golub and LeVeque), so any number of images fits in memory
and the result equals ``np.mean`` / ``np.cov`` of all the features at once to float64
rounding. ``frechet_distance`` is pytorch-fid's ``calculate_frechet_distance``::

    d^2 = |mu1 - mu2|^2 + Tr(sigma1 + sigma2 - 2 sqrtm(sigma1 sigma2))

with its fallbacks: where the square root of the product is not finite (a singular product),
``eps`` is added to both diagonals and the root taken again; an imaginary part of the root's
diagonal above 1e-3 is an error, a smaller one is rounding and dropped. numpy and scipy only.
"""

from __future__ import annotations

import os
import zipfile

import numpy as np
from absl import logging


class GaussianStatistics:
    """Mean and covariance of feature vectors ``[n, d]`` added in batches, in float64."""

    def __init__(self):
        self.count = 0
        self._mean: np.ndarray | None = None
        self._scatter: np.ndarray | None = None  # sum of (x - mean)(x - mean)^T

    def update(self, features) -> None:
        """Adds a batch ``[n, d]`` (any float dtype; taken as float64)."""
        batch = np.asarray(features, np.float64)
        if batch.ndim != 2 or (self._mean is not None and batch.shape[1] != self._mean.shape[0]):
            expected = "[n, d]" if self._mean is None else f"[n, {self._mean.shape[0]}]"
            raise ValueError(f"GaussianStatistics: features must be {expected}, got {batch.shape}")
        if not len(batch):
            return
        mean = batch.mean(axis=0)
        centred = batch - mean
        scatter = centred.T @ centred
        if self._mean is None:
            self.count, self._mean, self._scatter = len(batch), mean, scatter
            return
        total = self.count + len(batch)
        delta = mean - self._mean
        self._mean = self._mean + delta * (len(batch) / total)
        self._scatter += scatter + np.outer(delta, delta) * (self.count * len(batch) / total)
        self.count = total

    @property
    def mean(self) -> np.ndarray:
        """``[d]`` float64, as ``np.mean(features, axis=0)``."""
        self._check(1)
        return self._mean.copy()

    @property
    def covariance(self) -> np.ndarray:
        """``[d, d]`` float64, as ``np.cov(features, rowvar=False)`` (divided by ``n - 1``)."""
        self._check(2)
        return self._scatter / (self.count - 1)

    def _check(self, needed: int) -> None:
        if self.count < needed:
            raise ValueError(
                f"GaussianStatistics: {self.count} feature vector(s); at least {needed} needed"
            )


def frechet_distance(mu1, sigma1, mu2, sigma2, eps: float = 1e-6) -> float:
    """The Frechet distance between N(mu1, sigma1) and N(mu2, sigma2), as pytorch-fid's
    ``calculate_frechet_distance`` (same arithmetic, same fallbacks)."""
    mu1, mu2 = np.atleast_1d(mu1), np.atleast_1d(mu2)
    sigma1, sigma2 = np.atleast_2d(sigma1), np.atleast_2d(sigma2)
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise ValueError(
            f"frechet_distance: the two Gaussians differ in size: mu {mu1.shape} vs {mu2.shape}, "
            f"sigma {sigma1.shape} vs {sigma2.shape}"
        )
    if sigma1.shape != (mu1.shape[0], mu1.shape[0]):
        raise ValueError(f"frechet_distance: sigma {sigma1.shape} does not match mu {mu1.shape}")
    # Imported here: scipy takes about 0.2 s to import, and every train.py start imports this
    # module (through the tasks' metrics) while only an FID calls it.
    from scipy import linalg

    diff = mu1 - mu2
    covmean = linalg.sqrtm(sigma1.dot(sigma2))
    if not np.isfinite(covmean).all():
        logging.warning(
            "frechet_distance: singular product; adding %g to the diagonal of both covariances",
            eps,
        )
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(
                f"frechet_distance: the square root of sigma1 sigma2 has an imaginary part of up "
                f"to {np.max(np.abs(covmean.imag)):g}"
            )
        covmean = covmean.real
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def save_statistics(path, mu, sigma) -> str:
    """Writes ``mu`` and ``sigma`` as pytorch-fid's ``--save-stats`` does (a compressed ``.npz``
    of float64 ``mu`` and ``sigma``); an existing ``path`` is never overwritten."""
    path = os.fspath(path)
    if not path.endswith(".npz"):
        raise ValueError(
            f"statistics file {path!r} must end in .npz (pytorch-fid reads only those)"
        )
    try:
        with open(path, "xb") as file:  # "x": fails instead of replacing an existing file
            np.savez_compressed(
                file, mu=np.asarray(mu, np.float64), sigma=np.asarray(sigma, np.float64)
            )
    except FileExistsError:
        raise ValueError(f"statistics file {path!r} exists; not overwriting it") from None
    return path


def load_statistics(path) -> tuple[np.ndarray, np.ndarray]:
    """``(mu [d], sigma [d, d])`` from a pytorch-fid statistics ``.npz``; a file that is not one
    raises a ValueError in one line naming it."""
    path = os.fspath(path)
    try:
        arrays = np.load(path, allow_pickle=False)
        if not isinstance(arrays, np.lib.npyio.NpzFile):
            raise ValueError("is one array, not an .npz of 'mu' and 'sigma'")
        with arrays:
            if "mu" not in arrays.files or "sigma" not in arrays.files:
                raise ValueError(f"holds {sorted(arrays.files)[:6]}, not 'mu' and 'sigma'")
            mu, sigma = arrays["mu"], arrays["sigma"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        reason = " ".join(str(error).split())
        raise ValueError(f"statistics file {path!r}: {reason}") from None
    if mu.ndim != 1 or sigma.shape != (mu.shape[0], mu.shape[0]):
        raise ValueError(
            f"statistics file {path!r}: mu {mu.shape} and sigma {sigma.shape} are not [d] and "
            f"[d, d]"
        )
    return mu.astype(np.float64), sigma.astype(np.float64)
