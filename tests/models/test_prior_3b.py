"""configs/prior_3b.py: LlamaGen's GPT-3B sizes in minGPT's blocks, sized without a VQGAN."""

import jax
import numpy as np

import configs
from attnjax import tasks
from attnjax.train import loop


def test_3b_parameter_count_from_shapes_alone():
    config = configs.load("prior_3b")
    task = tasks.get_task(config.task)
    model = task.create_model(config)
    batch = task.abstract_batch(config, 2)
    state = loop.abstract_train_state(config, task, model, batch, jax.random.key(0))
    # codes, class tokens and the null class, padded up to a multiple of 128
    width, depth, tokens, vocab = 3200, 24, 16 * 16, 17408
    assert model.vocab_size == 16384 + 1000 + 1 and vocab % 128 == 0 and vocab - 128 < 17385
    attention = 4 * (width * width + width)  # query, key, value, out with biases
    mlp = width * 4 * width + 4 * width + 4 * width * width + width  # fc1, fc2
    norms = 2 * 2 * width  # ln1, ln2: scale and bias
    embeddings = vocab * width + tokens * width  # tok_emb, pos_emb
    final = 2 * width + width * vocab  # ln_f, head (no bias)
    expected = depth * (attention + mlp + norms) + embeddings + final
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(state.params))
    assert count == expected == 3_062_355_200
    assert jax.tree.leaves(state.params)[0].dtype == np.float32  # bf16 compute, f32 parameters
    assert model.dtype == jax.numpy.bfloat16 and config.mesh["model"] == 8
