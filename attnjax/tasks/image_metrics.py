"""FID of a generative task's images at the end of training, with the network a config names.

``config.fid`` (``configs/common.py``)::

    inception    converted Inception weights (``python -m attnjax.convert.inception``): the FID
                 papers report, on the ``dims`` features (64, 192, 768 or 2048)
    classifier   or a classification run's workdir: its pre-logits give a domain FID
    num_images   N, the images on each side; FID depends on N, so it is reported next to it
    batch_size   images per feature-network step

Neither network named: no FID. The VQGAN task reports ``eval/rfid`` (the reconstructions of the
first N eval images against those images) and ``eval/rfid_n``; the prior ``eval/fid`` (N samples,
classes in turn, against the first N images of the VQGAN's eval split), ``eval/fid_n`` and
``eval/fid_real_n`` (the split may hold fewer than N). They come from the task's ``finalize``,
once per run: N images through the Inception cost minutes on a CPU, too much for every
evaluation. ``check_config`` runs when the model is built, so a bad field fails before training.
"""

from __future__ import annotations

import os

import numpy as np
from absl import logging

from attnjax import data
from attnjax.metrics import sources
from attnjax.metrics.features import (
    FeatureExtractor,
    frechet_distance_between,
    inception_extractor,
)
from attnjax.tasks import classification

INCEPTION_DIMS = (64, 192, 768, 2048)


def enabled(config) -> bool:
    fid = config.get("fid") or {}
    return bool(fid.get("inception") or fid.get("classifier"))


def check_config(config) -> None:
    """A one-line ValueError naming the ``config.fid`` field that cannot work."""
    if not enabled(config):
        return
    fid = config.fid
    if fid.get("inception") and fid.get("classifier"):
        raise ValueError(
            f"config.fid.inception={fid.inception!r} and config.fid.classifier="
            f"{fid.classifier!r}: name one feature network, not both"
        )
    for field in ("inception", "classifier"):
        path = fid.get(field)
        if path and not os.path.exists(path):
            raise ValueError(f"config.fid.{field}={path!r} does not exist")
    if fid.get("inception") and fid.get("dims", 2048) not in INCEPTION_DIMS:
        raise ValueError(f"config.fid.dims={fid.dims!r} must be one of {INCEPTION_DIMS}")
    for field, least in (("num_images", 2), ("batch_size", 1)):
        value = fid.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"config.fid.{field}={value!r} must be an integer >= {least}")


def feature_network(config) -> tuple[FeatureExtractor, str]:
    """``(extractor, feature name)`` of the network ``config.fid`` names."""
    fid = config.fid
    if fid.get("inception"):
        dims = fid.get("dims", 2048)
        return inception_extractor(fid.inception, dims, fid.batch_size), str(dims)
    extractor = classification.feature_extractor(fid.classifier, fid.batch_size)
    return extractor, classification.PRE_LOGITS


def first_images(data_config, split: str, limit: int) -> np.ndarray:
    """The first ``limit`` images of a split, cropped and normalised as the eval pipeline reads
    them: ``[n, H, W, C]`` on the model's scale."""
    return data.normalize(data.eval_images(data_config, split, limit)[0], data_config)


def in_batches(fn, inputs: np.ndarray, batch_size: int) -> np.ndarray:
    """``fn`` over ``inputs`` in batches of exactly ``batch_size`` (the last padded by repeating
    its first row, the padding dropped): one compiled shape, whatever the count."""
    outputs = []
    for start in range(0, len(inputs), batch_size):
        chunk = inputs[start : start + batch_size]
        padding = np.repeat(chunk[:1], batch_size - len(chunk), axis=0)
        outputs.append(np.asarray(fn(np.concatenate([chunk, padding])))[: len(chunk)])
    return np.concatenate(outputs)


def fid(config, generated: np.ndarray, real: np.ndarray, name: str) -> float:
    """The FID of ``generated`` against ``real`` (pixels ``[n, H, W, C]`` in [0, 1]) on the
    network ``config.fid`` names."""
    extractor, feature = feature_network(config)
    value = frechet_distance_between(
        sources.ArrayImages(np.clip(generated, 0.0, 1.0), f"{name}: generated"),
        sources.ArrayImages(np.clip(real, 0.0, 1.0), f"{name}: real"),
        extractor,
        feature,
        progress=False,
    )
    logging.info(
        "%s = %.4f (%d generated vs %d real images, feature %s)",
        name,
        value,
        len(generated),
        len(real),
        feature,
    )
    return value
