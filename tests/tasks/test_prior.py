"""attnjax/tasks/prior.py: the training and eval steps and guided sampling on a learnable
sequence task, code caching keyed by the VQGAN, and sampling images through a VQGAN without
recompiling per evaluation."""

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from helpers import assert_close, count_compilations, tiny_prior_config

from attnjax import data
from attnjax.models import gpt, sampling, vqgan
from attnjax.tasks import prior, vqgan_codes
from attnjax.train import executables, loop, steps


def _models():
    prior_model = gpt.GPT(
        vocab_size=gpt.vocab_size(8, 2), block_size=4, n_layer=1, n_head=2, n_embd=16
    )
    gpt_params = jax.jit(prior_model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))[
        "params"
    ]
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
    return prior_model, gpt_params, autoencoder, variables


def test_sample_images_decodes_the_sampled_codes_and_compiles_once(tmp_path):
    prior_model, gpt_params, autoencoder, variables = _models()
    labels = np.array([0, 1, 1], np.int32)

    def draw(seed, path=None):
        return prior.sample_images(
            prior_model,
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


def _task_config(num_classes=4, **overrides):
    config = ml_collections.ConfigDict(
        dict(
            task="prior",
            seed=0,
            num_classes=num_classes,
            model=dict(
                n_layer=2, n_head=2, n_embd=32, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0
            ),
            optimizer="adamw",
            learning_rate=3e-3,
            warmup_steps=10,
            num_train_steps=150,
            weight_decay=0.0,
            grad_clip_norm=1.0,
        )
    )
    config.update(overrides)
    return config


def _pattern_codes(labels, num_tokens=8, num_codes=16):
    """Codes fully determined by the class: a sequence a model can learn to zero loss."""
    positions = np.arange(num_tokens)
    return ((labels[:, None] * 5 + positions[None, :] * (labels[:, None] + 1)) % num_codes).astype(
        np.int32
    )


def test_prior_task_learns_class_conditional_sequences():
    config = _task_config(class_dropout=0.2)  # a null class too, for guided sampling
    model = gpt.GPT(
        vocab_size=gpt.vocab_size(16, 4, null_class=True), block_size=8, **config.model.to_dict()
    )
    labels = np.arange(64, dtype=np.int32) % 4
    batch = {"codes": _pattern_codes(labels), "label": labels}
    state = prior.create_train_state(jax.random.key(0), config, model, batch)
    step = jax.jit(lambda s, b, r: prior.train_step(s, b, r, config=config, model=model))
    first = None
    for i in range(config.num_train_steps):
        state, metrics = step(state, batch, jax.random.key(i))
        first = first if first is not None else float(metrics["loss"])
    # Floor: a null-prefixed row cannot know its first code (ln 4 / 8 tokens x 20% = 0.035).
    assert first > 2.0 and float(metrics["loss"]) < 0.1, (first, float(metrics["loss"]))

    # eval_step: padding rows do not count; the mean equals the plain cross-entropy in bits.
    eval_batch = {**batch, "mask": np.r_[np.ones(60), np.zeros(4)].astype(np.float32)}
    sums = prior.eval_step(state, eval_batch, config=config, model=model)
    logits = gpt.sequence_logits(
        model, state.params, batch["codes"][:60], gpt.prefix_tokens(labels[:60], 16, 4)
    )
    expected = gpt.bits_per_token(gpt.cross_entropy(logits, batch["codes"][:60]))
    assert float(sums["count"]) == 60
    assert_close(
        float(sums["bits_per_token"]) / 60, float(expected), rtol=1e-4, what="eval bits/token"
    )

    # Greedy sampling from each class prefix reproduces that class's sequence, also guided.
    classes = np.arange(4, dtype=np.int32)
    prefix = gpt.prefix_tokens(classes, 16, 4)
    tokens = sampling.sample(
        model, state.params, prefix, jax.random.key(0), 8, temperature=0.0, num_codes=16
    )
    np.testing.assert_array_equal(np.asarray(tokens), _pattern_codes(classes))
    guided = sampling.sample(
        model,
        state.params,
        prefix,
        jax.random.key(0),
        8,
        temperature=0.0,
        num_codes=16,
        guidance=2.0,
        null_prefix=gpt.null_tokens(16, 4, 4),
    )
    np.testing.assert_array_equal(np.asarray(guided), _pattern_codes(classes))


@pytest.fixture(scope="module")
def tiny_vqgan(tmp_path_factory):
    """A randomly initialised 16x16 -> 4x4 VQGAN with the digits data settings."""
    model = vqgan.VQGAN(
        ch=32,
        ch_mult=(1, 1, 1),
        num_res_blocks=1,
        attn_resolutions=(),
        in_channels=1,
        out_ch=1,
        resolution=16,
        z_channels=8,
        n_embed=32,
        embed_dim=8,
    )
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 16, 16, 1)))
    data_config = ml_collections.ConfigDict(
        dict(
            name="digits",
            data_dir="",
            train_split="train",
            eval_split="test",
            image_key="image",
            label_key="label",
            image_size=16,
            mean=(0.5,),
            std=(0.5,),
        )
    )
    workdir = str(tmp_path_factory.mktemp("vqgan"))
    return prior.TrainedVQGAN(
        workdir, ml_collections.ConfigDict({"data": data_config}), model, variables, 7, (4, 4)
    )


def test_encode_split_caches_codes_keyed_by_the_vqgan(tiny_vqgan, tmp_path):
    vq = tiny_vqgan
    codes, labels = prior.encode_split(vq, "test", cache_dir=str(tmp_path))
    assert codes.shape == (360, 16) and labels.shape == (360,)
    assert codes.dtype == np.int32 and 0 <= codes.min() and codes.max() < 32
    images, _ = prior.load_images(vq.config.data, "test", 0)
    direct = vq.model.apply(vq.variables, jnp.asarray(images[:5]), method=type(vq.model).encode)[1]
    np.testing.assert_array_equal(codes[:5], np.asarray(direct).reshape(5, 16))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 1 and files[0].startswith("test-shift0-")

    again, _ = prior.encode_split(vq, "test", cache_dir=str(tmp_path))
    np.testing.assert_array_equal(again, codes)
    assert sorted(p.name for p in tmp_path.iterdir()) == files, "a second call must read the cache"

    retrained = vq._replace(variables=jax.tree.map(lambda x: x * 1.5, vq.variables))
    prior.encode_split(retrained, "test", cache_dir=str(tmp_path))
    assert len(list(tmp_path.iterdir())) == 2, "new VQGAN params must not reuse the old codes"


def test_shift_moves_pixels_with_zero_fill():
    image = np.arange(16, dtype=np.uint8).reshape(4, 4, 1) + 1
    moved = vqgan_codes._shift(image, 1, -1)
    np.testing.assert_array_equal(moved[1:, :-1], image[:-1, 1:])
    assert not moved[0].any() and not moved[:, -1].any()


def test_shifted_images_come_image_by_image_each_with_its_shifts_in_order(tiny_vqgan):
    config = tiny_vqgan.config.data
    raw, raw_labels = data.eval_images(config, "test")
    shifted, labels = prior.load_images(config, "test", 1)
    offsets = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
    assert shifted.shape == (9 * len(raw), *np.asarray(raw).shape[1:])
    np.testing.assert_array_equal(labels, np.repeat(raw_labels, 9))
    for index in (0, 1, len(raw) - 1):
        for offset, (dy, dx) in enumerate(offsets):
            expected = data.normalize(vqgan_codes._shift(np.asarray(raw[index]), dy, dx), config)
            np.testing.assert_array_equal(shifted[9 * index + offset], expected)


@pytest.mark.xdist_group("trained_runs")  # with the other readers of the trained runs
def test_finalize_reports_the_fid_of_samples_on_a_classifiers_pre_logits(trained_runs):
    """``config.fid.classifier``: the domain FID of N samples (classes in turn, the key folded
    with each step's first index) against the first N eval images, equal to pytorch-fid's
    distance of ``np.mean``/``np.cov`` of the ViT's own pre-logits."""
    from pytorch_fid.fid_score import calculate_frechet_distance

    from attnjax.tasks import classification
    from attnjax.train import checkpoint

    config, params = checkpoint.load(trained_runs["prior"])
    config.fid.update(classifier=trained_runs["vit"], num_images=12, batch_size=8)
    model = prior.create_model(config)
    state = prior.TrainState(step=0, params=params, opt_state=None, ema_params=None)
    result = prior.finalize(state, {}, config=config, model=model, workdir="unused")
    assert result["eval/fid_n"] == 12 and result["eval/fid_real_n"] == 12

    vqgan = prior.load_vqgan(config.vqgan_workdir)
    samples = []
    for start in (0, 8):
        labels = np.arange(start, start + 8) % 10
        _, images = prior.sample_images(
            model,
            params,
            vqgan.model,
            vqgan.variables,
            labels.astype(np.int32),
            jax.random.fold_in(jax.random.key(config.seed + 4), start),
            grid_shape=vqgan.grid_shape,
            codebook_size=vqgan.model.n_embed,
            num_classes=10,
            temperature=config.sampling.temperature,
            top_k=config.sampling.top_k,
            guidance=prior.sampling_guidance(config),
            mean=0.5,
            std=0.5,
        )
        samples.append(images)
    samples = np.concatenate(samples)[:12]
    real, _ = prior.load_images(vqgan.config.data, "test[:12]", 0)

    vit_config, variables = checkpoint.load(trained_runs["vit"], variables=())
    vit = classification.create_model(vit_config)

    def statistics(pixels):
        inputs = data.normalize(np.clip(pixels, 0, 1), vit_config.data)
        features = np.asarray(vit.apply(variables, inputs, return_aux=True)[1]["pre_logits"])
        return features.mean(0), np.cov(features, rowvar=False)

    expected = calculate_frechet_distance(
        *statistics(samples), *statistics(data.denormalize(real, vqgan.config.data))
    )
    assert_close(result["eval/fid"], expected, rtol=1e-3, what="eval/fid against pytorch-fid")


@pytest.mark.xdist_group("trained_runs")
def test_the_abstract_batch_is_the_codes_batch(trained_runs):
    """``abstract_batch``, which the compile command compiles the train step for, is the batch
    of the codes train.py reads: the same program."""
    config = tiny_prior_config(trained_runs["vqgan"])
    dp = loop.make_data_parallel(config, prior)
    example = next(data.make_iterator(loop._make_datasets(config, prior).train, config.get("data")))
    announced = steps.placed_batch(prior.abstract_batch(config, config.batch_size), dp)
    assert announced == steps.placed_batch(example, dp)
    assert executables._signature(announced) == executables._signature(dp.shard_batch(example))
