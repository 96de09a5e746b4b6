"""attnjax/gpt.py against taming's minGPT and net2net objective, and the prior task."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_close
from taming.modules.transformer import mingpt

from attnjax.convert.taming import gpt_from_taming
from attnjax.models import gpt, sampling


def _taming_gpt(seed=0, vocab_size=37, block_size=24, n_layer=2, n_head=4, n_embd=32):
    torch.manual_seed(seed)
    model = mingpt.GPT(vocab_size, block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd).eval()
    with torch.no_grad():
        # minGPT initialises pos_emb to zeros, LayerNorms to (1, 0) and biases to 0: randomise
        # them all so every converted tensor matters.
        for name, tensor in model.named_parameters():
            if (
                name == "pos_emb"
                or name.endswith("bias")
                or ".ln" in name
                or name.startswith("ln_f")
            ):
                tensor.add_(0.1 * torch.randn_like(tensor))
    return model


@pytest.fixture(scope="module")
def converted():
    torch_model = _taming_gpt()
    model, variables = gpt_from_taming(torch_model.state_dict(), n_head=4)
    return torch_model, model, variables


def test_gpt_matches_taming_mingpt(converted):
    torch_model, model, variables = converted
    indices = np.random.default_rng(0).integers(0, 37, size=(3, 24))
    with torch.no_grad():
        expected, _ = torch_model(torch.from_numpy(indices))
    apply = jax.jit(model.apply)
    actual = apply(variables, jnp.asarray(indices))
    assert_close(actual, expected.numpy(), what="GPT logits vs taming minGPT")
    # Shorter sequences use the first positions of pos_emb, as taming slices pos_emb[:, :t].
    with torch.no_grad():
        expected_short, _ = torch_model(torch.from_numpy(indices[:, :5]))
    assert_close(
        apply(variables, jnp.asarray(indices[:, :5])),
        expected_short.numpy(),
        what="GPT logits on a 5-token prefix",
    )


def test_gpt_from_taming_reads_the_architecture(converted):
    _, model, variables = converted
    assert (model.vocab_size, model.block_size, model.n_layer, model.n_embd) == (37, 24, 2, 32)
    own = gpt.GPT(vocab_size=37, block_size=24, n_layer=2, n_head=4, n_embd=32)
    own_shapes = jax.eval_shape(own.init, jax.random.key(0), jnp.zeros((1, 24), jnp.int32))
    chex.assert_trees_all_equal_shapes(variables, own_shapes)


def test_training_objective_matches_net2net(converted):
    """Class prefix + codes: our loss equals taming's Net2NetTransformer.forward + cross-entropy."""
    torch_model, model, variables = converted
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 32, size=(4, 24))
    prefix = np.array(gpt.prefix_tokens(np.array([0, 1, 2, 4]), 32, 5))
    logits = gpt.sequence_logits(model, variables["params"], jnp.asarray(codes), prefix)
    nll = gpt.cross_entropy(logits, jnp.asarray(codes))
    with torch.no_grad():  # Net2NetTransformer.forward with pkeep=1, spelled out
        cz = torch.cat([torch.from_numpy(prefix).long(), torch.from_numpy(codes)], dim=1)
        torch_logits, _ = torch_model(cz[:, :-1])
        torch_logits = torch_logits[:, prefix.shape[1] - 1 :]
        torch_nll = torch.nn.functional.cross_entropy(
            torch_logits.reshape(-1, 37), torch.from_numpy(codes).reshape(-1)
        )
    assert_close(logits, torch_logits.numpy(), what="sequence logits")
    assert_close(nll, torch_nll.item(), what="cross-entropy")


def test_prefix_and_vocabulary_conventions():
    np.testing.assert_array_equal(
        np.asarray(gpt.prefix_tokens(np.array([0, 9]), 128, 10)), [[128], [137]]
    )
    np.testing.assert_array_equal(
        np.asarray(gpt.prefix_tokens(None, 128, 0, batch=2)), [[128], [128]]
    )
    np.testing.assert_array_equal(np.asarray(gpt.null_tokens(128, 10, 1)), [[138]])
    assert gpt.vocab_size(128, 10) == 138 and gpt.vocab_size(128, 10, null_class=True) == 139
    assert gpt.vocab_size(128, 0) == 129
    with pytest.raises(ValueError, match="needs labels"):
        gpt.prefix_tokens(None, 128, 10)


def test_gpt_rejects_indices_that_are_not_batch_by_length(converted):
    _, model, variables = converted
    with pytest.raises(ValueError, match="indices must be"):
        model.apply(variables, jnp.zeros((24,), jnp.int32))
    with pytest.raises(ValueError, match="exceeds block_size=24"):
        model.apply(variables, jnp.zeros((1, 25), jnp.int32))


# --------------------------------------------------------------------------------------------
# The prior task (attnjax/tasks/prior.py)
# --------------------------------------------------------------------------------------------


def _task_config(num_classes=4, **overrides):
    import ml_collections

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
    from attnjax.tasks import prior as task

    config = _task_config(class_dropout=0.2)  # a null class too, for guided sampling
    model = gpt.GPT(
        vocab_size=gpt.vocab_size(16, 4, null_class=True), block_size=8, **config.model.to_dict()
    )
    labels = np.arange(64, dtype=np.int32) % 4
    batch = {"codes": _pattern_codes(labels), "label": labels}
    state = task.create_train_state(jax.random.key(0), config, model, batch)
    step = jax.jit(lambda s, b, r: task.train_step(s, b, r, config=config, model=model))
    first = None
    for i in range(config.num_train_steps):
        state, metrics = step(state, batch, jax.random.key(i))
        first = first if first is not None else float(metrics["loss"])
    # Floor: a null-prefixed row cannot know its first code (ln 4 / 8 tokens x 20% = 0.035).
    assert first > 2.0 and float(metrics["loss"]) < 0.1, (first, float(metrics["loss"]))

    # eval_step: padding rows do not count; the mean equals the plain cross-entropy in bits.
    eval_batch = {**batch, "mask": np.r_[np.ones(60), np.zeros(4)].astype(np.float32)}
    sums = task.eval_step(state, eval_batch, config=config, model=model)
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
    import ml_collections

    from attnjax.models import vqgan as vqgan_lib
    from attnjax.tasks import prior as task

    model = vqgan_lib.VQGAN(
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
    return task.TrainedVQGAN(
        workdir, ml_collections.ConfigDict({"data": data_config}), model, variables, 7, (4, 4)
    )


def test_encode_split_caches_codes_keyed_by_the_vqgan(tiny_vqgan, tmp_path):
    from attnjax.tasks import prior as task

    vq = tiny_vqgan
    codes, labels = task.encode_split(vq, "test", cache_dir=str(tmp_path))
    assert codes.shape == (360, 16) and labels.shape == (360,)
    assert codes.dtype == np.int32 and 0 <= codes.min() and codes.max() < 32
    images, _ = task.load_images(vq.config.data, "test", 0)
    direct = vq.model.apply(vq.variables, jnp.asarray(images[:5]), method=type(vq.model).encode)[1]
    np.testing.assert_array_equal(codes[:5], np.asarray(direct).reshape(5, 16))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 1 and files[0].startswith("test-shift0-")

    again, _ = task.encode_split(vq, "test", cache_dir=str(tmp_path))
    np.testing.assert_array_equal(again, codes)
    assert sorted(p.name for p in tmp_path.iterdir()) == files, "a second call must read the cache"

    retrained = vq._replace(variables=jax.tree.map(lambda x: x * 1.5, vq.variables))
    task.encode_split(retrained, "test", cache_dir=str(tmp_path))
    assert len(list(tmp_path.iterdir())) == 2, "new VQGAN params must not reuse the old codes"


def test_shift_moves_pixels_with_zero_fill():
    from attnjax.tasks import vqgan_codes as task

    image = np.arange(16, dtype=np.uint8).reshape(4, 4, 1) + 1
    moved = task._shift(image, 1, -1)
    np.testing.assert_array_equal(moved[1:, :-1], image[:-1, 1:])
    assert not moved[0].any() and not moved[:, -1].any()
