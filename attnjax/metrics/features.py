"""Any feature network run over batches of images: jit-compiled once, split over the devices.

``FeatureExtractor(apply_fn, variables, batch_size)`` takes ``apply_fn(variables, images)``
with ``images`` float32 ``[b, H, W, C]`` and returning ``{name: [b, d]}`` (the Inception's
``model.apply``, or a classifier's pre-logits for a domain FID). Every step has the same
shape, so it compiles once per image size: the batch is rounded up to a multiple of the device
count and the last one padded with zeros, whose rows are dropped (a set smaller than a batch,
``total``, is one batch of its own size). The batch is laid out along
the ``data`` axis of a mesh over the devices (data parallelism declared, XLA splits the work);
the variables are replicated once. While the devices compute one batch the host reads the
next, and a progress bar counts images with their rate and the time left.

``measure(source, extractor, feature)`` runs an image source (``attnjax.metrics.sources``)
through an extractor into the mean and covariance of one of its features;
``frechet_distance_between(a, b, extractor, feature)`` is the FID of two sources (or statistics)
with any network; ``inception_extractor`` is pytorch-fid's Inception from converted weights.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from attnjax.metrics import sources
from attnjax.metrics.statistics import GaussianStatistics, frechet_distance

ApplyFn = Callable[..., Mapping[str, jax.Array]]


class FeatureExtractor:
    """``apply_fn`` over batches of at most ``batch_size`` images on ``devices`` (default all
    of this process's devices)."""

    def __init__(self, apply_fn: ApplyFn, variables, batch_size: int = 50, devices=None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"FeatureExtractor: batch_size must be a positive int, got {batch_size!r}"
            )
        devices = list(devices) if devices is not None else jax.local_devices()
        mesh = Mesh(np.asarray(devices), ("data",))
        self._devices = len(devices)
        self.batch_size = self._round_up(batch_size)
        self._replicated = NamedSharding(mesh, P())
        self._split = NamedSharding(mesh, P("data"))
        self._variables = jax.device_put(variables, self._replicated)
        self._apply = jax.jit(apply_fn, in_shardings=(self._replicated, self._split))

    def __call__(
        self,
        batches: Iterable,
        total: int | None = None,
        progress: bool = True,
        description: str = "features",
    ) -> Iterator[dict[str, np.ndarray]]:
        """``batches`` of images ``[n, H, W, C]`` (float in [0, 1], or uint8 read as ``x / 255``)
        -> ``{name: float32 [n, d]}`` per batch, in order. ``total``: images expected, for the
        progress bar's time left."""
        size = self.batch_size if total is None else min(self.batch_size, self._round_up(total))
        pending = None
        with tqdm(total=total, unit="img", desc=description, disable=not progress) as bar:
            for images in batches:
                started = self._start(images, size)
                if pending is not None:
                    yield self._finish(*pending, bar)
                pending = started
            if pending is not None:
                yield self._finish(*pending, bar)

    def _round_up(self, count: int) -> int:
        return -(-count // self._devices) * self._devices

    def _start(self, images, size: int) -> tuple[Mapping[str, jax.Array], int]:
        images = np.asarray(images)
        if images.dtype == np.uint8:
            images = images.astype(np.float32) / 255
        images = images.astype(np.float32, copy=False)
        count = len(images)
        if images.ndim != 4 or not 0 < count <= size:
            raise ValueError(
                f"FeatureExtractor: a batch must be [n, H, W, C] with 0 < n <= {size}, "
                f"got {images.shape}"
            )
        if count < size:
            padding = np.zeros((size - count, *images.shape[1:]), np.float32)
            images = np.concatenate([images, padding])
        # Dispatched without waiting: the host reads the next batch while this one runs.
        return self._apply(self._variables, jax.device_put(images, self._split)), count

    def _finish(self, outputs, count: int, bar) -> dict[str, np.ndarray]:
        features = {name: np.asarray(value)[:count] for name, value in outputs.items()}
        bar.update(count)
        return features


def measure(source, extractor: FeatureExtractor, feature: str, keep=(), progress: bool = True):
    """An image source through ``extractor`` -> (``(mu, sigma)`` of its ``feature``, the
    ``keep`` outputs of every image as ``{name: [n, d]}``)."""
    statistics, kept = GaussianStatistics(), {name: [] for name in keep}
    batches = source.batches(extractor.batch_size)
    for outputs in extractor(batches, len(source), progress, description=source.path):
        if feature not in outputs:
            raise ValueError(f"the feature function gives {sorted(outputs)}, not {feature!r}")
        statistics.update(outputs[feature])
        for name in keep:
            kept[name].append(outputs[name])
    if statistics.count < 2:
        raise ValueError(f"{source.path!r}: {statistics.count} image(s); a covariance needs 2")
    arrays = {name: np.concatenate(parts) for name, parts in kept.items()}
    return (statistics.mean, statistics.covariance), arrays


def frechet_distance_between(
    generated, real, extractor: FeatureExtractor, feature: str, progress: bool = True
) -> float:
    """The FID of two image sources (``sources.ArrayImages``, a folder, a TFDS split) or
    ``sources.Statistics`` on ``extractor``'s ``feature``; ``generated`` first, as pytorch-fid."""
    gaussians = [
        (source.mu, source.sigma)
        if isinstance(source, sources.Statistics)
        else measure(source, extractor, feature, progress=progress)[0]
        for source in (generated, real)
    ]
    return frechet_distance(*gaussians[0], *gaussians[1])


def inception_extractor(
    weights: str, dims: int = 2048, batch_size: int = 50, with_logits: bool = False
) -> FeatureExtractor:
    """pytorch-fid's Inception from converted ``weights`` as a ``FeatureExtractor`` of the
    ``dims`` features (named ``str(dims)``) and, ``with_logits``, the unbiased logits. Gray
    images ``[b, H, W, 1]`` are repeated to three channels, as the image sources read them."""
    from attnjax.models import inception

    outputs = (str(dims), "logits_unbiased") if with_logits else (str(dims),)
    model = inception.InceptionV3(outputs=outputs)

    def apply(variables, images):
        images = jnp.repeat(images, 3, axis=-1) if images.shape[-1] == 1 else images
        return model.apply(variables, images)

    return FeatureExtractor(apply, inception.load_variables(weights), batch_size)
