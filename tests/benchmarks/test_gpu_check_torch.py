"""benchmarks/gpu/torch_sampler.py's KV-cached sampler against taming's own GPT: the cache's
logits at every position equal the full forward's over the same tokens, and its picks keep to
the top k of the guided logits."""

import pathlib
import sys

import pytest
import torch
from taming.modules.transformer.mingpt import GPT

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))
import measure_torch  # noqa: E402
import torch_sampler  # noqa: E402

SIZES = dict(measure_torch.SAMPLING["dry-run"], grid=3)
CLASSES = measure_torch.SAMPLING_RECIPE["num_classes"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    gpt = torch_sampler.sampling_model(SIZES, CLASSES).eval()
    assert isinstance(gpt, GPT)
    with torch.no_grad():  # taming starts its position table at zero: make positions matter
        gpt.pos_emb.normal_(std=0.5)
    return gpt


def sampler(model, top_k=SIZES["top_k"], guidance=1.5):
    prefix = torch_sampler.prefixes(SIZES, CLASSES, "cpu")
    tokens = SIZES["grid"] ** 2
    return torch_sampler.CachedSampler(
        model, prefix.shape[0], tokens, top_k, 1.0, guidance, SIZES["codes"]
    ), prefix


def test_cached_logits_equal_the_full_forward_at_every_position(model):
    cached, prefix = sampler(model)
    length = SIZES["grid"] ** 2
    sequence = torch.randint(
        0, SIZES["codes"], (prefix.shape[0], length), generator=torch.Generator().manual_seed(1)
    )
    sequence[:, 0] = prefix
    with torch.no_grad():
        full = model(sequence)[0]
    for position in range(length):
        step = cached.logits(sequence[:, position], torch.tensor(position))
        torch.testing.assert_close(step, full[:, position], rtol=1e-5, atol=1e-6)


def test_picks_are_codes_in_the_top_k_of_the_guided_logits(model):
    cached, prefix = sampler(model, top_k=3, guidance=2.0)
    torch.manual_seed(2)
    logits = torch.randn(prefix.shape[0], model.head.out_features)
    picks = cached.pick(logits)
    conditional, unconditional = logits[:, : SIZES["codes"]].chunk(2)
    guided = unconditional + 2.0 * (conditional - unconditional)
    top = torch.topk(guided, 3, dim=-1).indices
    half = prefix.shape[0] // 2
    assert torch.equal(picks[:half], picks[half:])  # both halves continue with the same code
    assert all(int(p) in top[row].tolist() for row, p in enumerate(picks[:half]))


def test_sampling_writes_one_code_per_position(model):
    cached, prefix = sampler(model)
    codes = torch_sampler.sample_eager(cached, prefix, SIZES["grid"] ** 2)
    assert codes.shape == (prefix.shape[0] // 2, SIZES["grid"] ** 2)
    assert 0 <= int(codes.min()) and int(codes.max()) < SIZES["codes"]
