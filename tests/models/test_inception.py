"""The FID Inception against pytorch-fid's ``InceptionV3`` with the same random weights: every
feature depth and both logits from one forward of a few images."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_relative, nchw, pytorch_fid_weights, random_fid_inception

from attnjax.convert.inception import inception_from_torch
from attnjax.models import inception


@pytest.fixture(scope="module")
def both():
    """(pytorch-fid's outputs, ours) on 2 images of 32 x 32, resized to 299 inside both."""
    from pytorch_fid.inception import InceptionV3

    net = random_fid_inception()
    images = np.random.default_rng(0).random((2, 32, 32, 3), dtype=np.float32)
    with pytorch_fid_weights(net.state_dict()):
        reference = InceptionV3(output_blocks=[0, 1, 2, 3]).eval()
    with torch.no_grad():
        blocks = reference(nchw(images))
        pool = blocks[-1].flatten(1)
        theirs = {d: b.mean(dim=(2, 3)).numpy() for d, b in zip(inception.DEPTHS, blocks)}
        theirs["logits"] = net.fc(pool).numpy()
        theirs["logits_unbiased"] = (pool @ net.fc.weight.T).numpy()
    model = inception.InceptionV3(outputs=inception.OUTPUTS)
    ours = jax.jit(model.apply)(inception_from_torch(net), images)
    return theirs, {name: np.asarray(value) for name, value in ours.items()}


@pytest.mark.parametrize("name", inception.OUTPUTS)
def test_every_output_equals_pytorch_fid(both, name):
    theirs, ours = both
    assert ours[name].shape == theirs[name].shape
    assert_relative(ours[name], theirs[name], tol=1e-4, what=name)


@pytest.mark.parametrize("size", [(32, 32), (17, 40), (500, 299), (299, 299)])
def test_resize_is_torch_bilinear_without_align_corners(size):
    images = np.random.default_rng(1).random((2, *size, 3), dtype=np.float32)
    theirs = F.interpolate(nchw(images), size=(299, 299), mode="bilinear", align_corners=False)
    ours = inception.resize_bilinear(jnp.asarray(images), (299, 299))
    assert_relative(ours, theirs.numpy().transpose(0, 2, 3, 1), tol=1e-5, what=f"{size}")


def test_only_the_blocks_up_to_the_last_output_are_built():
    shapes = jax.eval_shape(
        inception.InceptionV3(outputs=("192", "64")).init,
        jax.random.key(0),
        jnp.zeros((1, 64, 64, 3)),
    )
    assert sorted(shapes["params"]) == [
        "Conv2d_1a_3x3",
        "Conv2d_2a_3x3",
        "Conv2d_2b_3x3",
        "Conv2d_3b_1x1",
        "Conv2d_4a_3x3",
    ]


def test_unknown_outputs_and_bad_images_are_refused():
    with pytest.raises(ValueError, match="outputs must be among"):
        inception.InceptionV3(outputs=("1000",)).init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))
    with pytest.raises(ValueError, match=r"\[b, H, W, 3\]"):
        inception.InceptionV3().init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))


def test_saved_variables_load_back_and_a_bad_file_is_one_line(tmp_path):
    variables = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), _shapes())
    path = inception.save_variables(variables, tmp_path / "inception.npz")
    loaded = inception.load_variables(path)
    assert jax.tree.structure(loaded) == jax.tree.structure(variables)
    np.savez(tmp_path / "partial.npz", **{"params/fc/kernel": np.zeros((2048, 1008))})
    with pytest.raises(ValueError, match="partial.npz.*missing") as error:
        inception.load_variables(tmp_path / "partial.npz")
    assert "\n" not in str(error.value)
    (tmp_path / "junk.npz").write_text("not an npz")
    with pytest.raises(ValueError, match="junk.npz.*not a readable .npz"):
        inception.load_variables(tmp_path / "junk.npz")


def _shapes():
    return jax.eval_shape(
        inception.InceptionV3(outputs=inception.OUTPUTS).init,
        jax.random.key(0),
        jnp.zeros((1, 299, 299, 3)),
    )
