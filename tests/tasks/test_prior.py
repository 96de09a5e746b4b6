"""attnjax/tasks/prior.py: sampling images through a VQGAN without recompiling per evaluation."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_close, count_compilations

from attnjax.models import vqgan
from attnjax.models.gpt import GPT, vocab_size
from attnjax.tasks import prior


def _models():
    gpt = GPT(vocab_size=vocab_size(8, 2), block_size=4, n_layer=1, n_head=2, n_embd=16)
    gpt_params = jax.jit(gpt.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    autoencoder = vqgan.VQGAN(
        ch=32,
        ch_mult=(1, 1),
        num_res_blocks=1,
        attn_resolutions=(),
        in_channels=1,
        out_ch=1,
        resolution=8,
        z_channels=8,
        n_embed=8,
        embed_dim=8,
    )
    variables = jax.jit(autoencoder.init)(jax.random.key(1), jnp.zeros((1, 8, 8, 1)))
    return gpt, gpt_params, autoencoder, variables


def test_sample_images_decodes_the_sampled_codes_and_compiles_once(tmp_path):
    gpt, gpt_params, autoencoder, variables = _models()
    labels = np.array([0, 1, 1], np.int32)

    def draw(seed, path=None):
        return prior.sample_images(
            gpt,
            gpt_params,
            autoencoder,
            variables,
            labels,
            jax.random.key(seed),
            grid_shape=(2, 2),
            codebook_size=8,
            num_classes=2,
            mean=0.5,
            std=0.5,
            path=path,
        )

    codes, images = draw(0, str(tmp_path / "samples.png"))
    assert codes.shape == (3, 2, 2) and images.shape == (3, 4, 4, 1)  # f=2
    decoded = autoencoder.apply(variables, jnp.asarray(codes), method=vqgan.VQGAN.decode_indices)
    assert_close(images, np.asarray(decoded) * 0.5 + 0.5, what="decoded samples")
    assert os.path.getsize(tmp_path / "samples.png") > 0
    with count_compilations() as compiled:
        draw(1)
    assert compiled == [], f"a second sample_images compiled again: {compiled}"
