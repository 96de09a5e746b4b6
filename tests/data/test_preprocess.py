"""attnjax/data/preprocess.py and the crops of transforms.py against their references: taming's
``SmallestMaxSize`` (albumentations' sizes; pixels against torchvision's antialiased bilinear
resize of tensors, another implementation than PIL's), ``RandomCrop`` (every window, each offset
reachable), ``CenterCrop`` (torchvision's), the evaluation transform (torchvision's ``Resize`` +
``CenterCrop``) and the Inception crop (torchvision's ``RandomResizedCrop`` draws, written with
numpy's generator, and its ``resized_crop``)."""

import math

import numpy as np
import pytest
import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as F

from attnjax.data import preprocess
from attnjax.data.transforms import center_crop, inception_crop, random_crop, resize_shorter
from configs import common


def _smooth(height, width, seed=0):
    """A photo-like uint8 image: gradients and a little noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    base = np.stack([200 * x, 150 * y + 50, 100 * (x + y)], -1)
    return np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)


def _torch_resize(image, height, width):
    tensor = torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))
    out = F.resize(tensor, [height, width], InterpolationMode.BILINEAR, antialias=True)
    return out.numpy().transpose(1, 2, 0)


def _smallest_max_size(height, width, side):
    """albumentations' ``SmallestMaxSize``: both sides times side / shorter, rounded."""
    scale = side / min(height, width)
    return round(height * scale), round(width * scale)


@pytest.mark.parametrize("shape, side", [((50, 80), 16), ((37, 23), 10), ((6, 9), 12)])
def test_resize_shorter_is_smallest_max_size(shape, side):
    image = _smooth(*shape)
    got = resize_shorter(image, side)
    size = _smallest_max_size(*shape, side)
    assert got.shape == (*size, 3)
    np.testing.assert_allclose(got, _torch_resize(image, *size), atol=1)


def test_random_crop_cuts_each_window_and_reaches_every_offset():
    image = np.random.default_rng(0).integers(0, 256, (7, 6, 3), dtype=np.uint8)
    offsets = set()
    for seed in range(200):
        crop = random_crop(image, np.random.default_rng(seed), 4)
        found = [
            (top, left)
            for top in range(4)
            for left in range(3)
            if np.array_equal(crop, image[top : top + 4, left : left + 4])
        ]
        assert len(found) == 1, seed
        offsets.add(found[0])
    assert offsets == {(top, left) for top in range(4) for left in range(3)}


@pytest.mark.parametrize("shape", [(8, 12), (10, 6), (7, 7)])
def test_center_crop_is_torchvisions_where_the_surplus_is_even(shape):
    image = _smooth(*shape)
    tensor = torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))
    want = F.center_crop(tensor, [6, 6]).numpy().transpose(1, 2, 0)
    np.testing.assert_array_equal(center_crop(image, 6), want)


def test_center_crop_takes_the_upper_left_window_where_the_surplus_is_odd():
    """albumentations' ``CenterCrop`` (taming's): the offset rounds down."""
    image = _smooth(9, 12)
    np.testing.assert_array_equal(center_crop(image, 6), image[1:7, 3:9])


def test_the_evaluation_transform_is_resize_then_center_crop():
    data = common.image_data("folder:", mean=(0.5,) * 3, std=(0.5,) * 3)
    data.update(image_size=16, eval_crop="center", crop_fraction=0.8)  # the shorter side at 20
    image = _smooth(40, 60)
    got = preprocess.eval_fn(data)(image)
    resized = _torch_resize(image, *_smallest_max_size(40, 60, 20))  # 20 x 30
    np.testing.assert_allclose(got, resized[2:18, 7:23], atol=1)


def _random_resized_crop_box(rng, height, width, area, aspect):
    """torchvision's ``RandomResizedCrop.get_params`` with numpy's generator drawing."""
    for _ in range(10):
        target = height * width * rng.uniform(*area)
        ratio = math.exp(rng.uniform(math.log(aspect[0]), math.log(aspect[1])))
        w = round(math.sqrt(target * ratio))
        h = round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            return rng.integers(0, height - h + 1), rng.integers(0, width - w + 1), h, w
    raise AssertionError("no window in 10 draws: pick another seed")


def test_inception_crop_is_random_resized_crop():
    image = _smooth(48, 64)
    tensor = torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))
    for seed in range(8):
        top, left, h, w = _random_resized_crop_box(
            np.random.default_rng(seed), 48, 64, (0.05, 1.0), (3 / 4, 4 / 3)
        )
        want = F.resized_crop(
            tensor, top, left, h, w, [16, 16], InterpolationMode.BILINEAR, antialias=True
        )
        got = inception_crop(image, np.random.default_rng(seed), 16)
        assert got.shape == (16, 16, 3)
        # PIL's box resize reads past the window's edge where torchvision clamps at it.
        diff = np.abs(got.astype(int) - want.numpy().transpose(1, 2, 0))
        assert diff[2:-2, 2:-2].max() <= 1 and diff.mean() < 0.5, (seed, diff.max())
