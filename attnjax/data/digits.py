"""The embedded dataset: scikit-learn's 8x8 handwritten digits as a TFDS builder, prepared without
network or TensorFlow."""

from __future__ import annotations

import numpy as np
import tensorflow_datasets as tfds

DIGITS_TEST_SIZE = 360  # 20% of sklearn's 1797 digits, stratified by class: 1437 train / 360 test.


class Digits(tfds.core.GeneratorBasedBuilder):
    """scikit-learn's 8x8 handwritten digits (UCI optdigits test set) as a TFDS dataset.

    ``image``: uint8 ``[8, 8, 1]`` (sklearn's 0..16 intensities scaled to 0..255), ``label``:
    int64 in ``[0, 10)``. Splits: ``train`` 1437, ``test`` 360, a fixed stratified split
    (``sklearn.model_selection.train_test_split``, ``random_state=0``). Generated from the copy
    shipped inside scikit-learn: no network, and no TensorFlow (``Tensor`` features written as
    ``array_record``).
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "sklearn digits, stratified 1437/360 train/test split."}

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="scikit-learn's 8x8 handwritten digits.",
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }
            ),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
        index = np.arange(len(images))
        train_idx, test_idx = train_test_split(
            index, test_size=DIGITS_TEST_SIZE, stratify=digits.target, random_state=0
        )
        return {
            "train": self._generate_examples(images, digits.target, np.sort(train_idx)),
            "test": self._generate_examples(images, digits.target, np.sort(test_idx)),
        }

    def _generate_examples(self, images, labels, indices):
        for i in indices:
            yield int(i), {"image": images[i], "label": int(labels[i])}


# Builders defined here, prepared on first use without TensorFlow.
EMBEDDED_BUILDERS = (Digits,)
