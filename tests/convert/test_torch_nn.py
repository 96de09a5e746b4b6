"""attnjax.convert.torch_nn: nn.MultiheadAttention weights and masks, against PyTorch itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_close

from attnjax.convert.torch_nn import mha_from_torch, mha_mask_from_torch

E, HEADS, B, L, S = 8, 2, 2, 5, 6


def make_torch_mha(bias=True, kdim=None, vdim=None, batch_first=True, seed=0):
    torch.manual_seed(seed)
    module = torch.nn.MultiheadAttention(
        E, HEADS, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first
    )
    if bias:  # PyTorch initialises the biases to zero; make them count
        with torch.no_grad():
            module.in_proj_bias.normal_()
            module.out_proj.bias.normal_()
    return module.eval()


def torch_masks(kind, rng):
    """(attn_mask, key_padding_mask) in PyTorch's convention; every query keeps >= 1 key."""
    padding = np.zeros((B, S), bool)
    padding[0, 4:] = True  # sequence 0 has 4 real keys
    blocked = rng.random((L, S)) > 0.6
    blocked[:, 0] = False
    if kind == "none":
        return None, None
    if kind == "padding":
        return None, torch.tensor(padding)
    if kind == "bool":
        return torch.tensor(blocked), torch.tensor(padding)
    if kind == "float":
        float_padding = np.where(padding, -np.inf, 0.0).astype(np.float32)
        return torch.tensor(rng.normal(size=(L, S)).astype(np.float32)), torch.tensor(float_padding)
    if kind == "per_head":
        per_head = rng.random((B * HEADS, L, S)) > 0.6
        per_head[..., 0] = False
        return torch.tensor(per_head), None
    raise ValueError(kind)


CASES = [
    # (bias, kdim, vdim, batch_first, cross, mask kind)
    (True, None, None, True, False, "none"),
    (True, None, None, False, False, "bool"),
    (False, None, None, True, True, "padding"),
    (True, 5, 3, True, True, "float"),
    (False, 5, 7, False, True, "per_head"),
    (True, None, None, True, True, "bool"),
]


@pytest.mark.parametrize("bias, kdim, vdim, batch_first, cross, mask_kind", CASES)
def test_mha_from_torch_outputs_weights_and_gradients(
    bias, kdim, vdim, batch_first, cross, mask_kind
):
    rng = np.random.default_rng(3)
    module = make_torch_mha(bias, kdim, vdim, batch_first)
    flax_module, variables = mha_from_torch(module)
    query = rng.normal(size=(B, L, E)).astype(np.float32)
    if cross:
        key = rng.normal(size=(B, S, kdim or E)).astype(np.float32)
        value = rng.normal(size=(B, S, vdim or E)).astype(np.float32)
    else:  # self-attention: one sequence of length S plays all three roles
        query = key = value = rng.normal(size=(B, S, E)).astype(np.float32)
    length = query.shape[1]
    attn_mask, key_padding_mask = torch_masks(mask_kind, rng)
    if attn_mask is not None and attn_mask.shape[-2] != length:
        attn_mask = attn_mask[..., :1, :].expand(*attn_mask.shape[:-2], length, S).contiguous()
    cotangent = rng.normal(size=(B, length, E)).astype(np.float32)

    # PyTorch, in its own layout
    tensors = [torch.tensor(x, requires_grad=True) for x in (query, key, value)]
    inputs = tensors if batch_first else [t.transpose(0, 1) for t in tensors]
    out, weights = module(
        *inputs,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        need_weights=True,
        average_attn_weights=False,
    )
    out = out if batch_first else out.transpose(0, 1)
    (out * torch.tensor(cotangent)).sum().backward()

    # attnjax, batch-first, with the translated mask
    mask = mha_mask_from_torch(attn_mask, key_padding_mask, num_heads=HEADS)
    apply = jax.jit(lambda v, *qkv: flax_module.apply(v, *qkv, mask=mask, return_weights=True))
    ours, our_weights = apply(variables, query, key, value)
    assert_close(ours, out.detach().numpy(), what="MHA output")
    assert_close(our_weights, weights.detach().numpy(), what="per-head weights")

    def loss(params, q, k, v):
        return jnp.sum(flax_module.apply({"params": params}, q, k, v, mask=mask) * cotangent)

    grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    param_grads, *input_grads = grad_fn(variables["params"], query, key, value)
    torch_grads = {name: p.grad.numpy() for name, p in module.named_parameters()}
    if kdim is None and vdim is None:
        expected = dict(zip(("query", "key", "value"), np.split(torch_grads["in_proj_weight"], 3)))
    else:
        expected = {
            n: torch_grads[f"{t}_proj_weight"] for n, t in zip(("query", "key", "value"), "qkv")
        }
    expected["out"] = torch_grads["out_proj.weight"]
    for name, weight_grad in expected.items():
        assert_close(param_grads[name]["kernel"], weight_grad.T, what=f"d loss / d {name}.kernel")
    if bias:
        for name, bias_grad in zip(
            ("query", "key", "value"), np.split(torch_grads["in_proj_bias"], 3)
        ):
            assert_close(param_grads[name]["bias"], bias_grad, what=f"d loss / d {name}.bias")
        assert_close(
            param_grads["out"]["bias"], torch_grads["out_proj.bias"], what="d loss / d out.bias"
        )
    else:
        assert all("bias" not in p for p in param_grads.values())
    for name, ours_g, tensor in zip(("query", "key", "value"), input_grads, tensors):
        assert_close(ours_g, tensor.grad.numpy(), what=f"d loss / d {name} input")


def test_mha_from_torch_carries_dropout_and_rejects_extra_kv():
    module = torch.nn.MultiheadAttention(E, HEADS, dropout=0.1)
    flax_module, _ = mha_from_torch(module)
    assert flax_module.dropout_rate == pytest.approx(0.1) and flax_module.num_heads == HEADS
    for kwargs in ({"add_bias_kv": True}, {"add_zero_attn": True}):
        with pytest.raises(NotImplementedError, match="add_bias_kv=True / add_zero_attn=True"):
            mha_from_torch(torch.nn.MultiheadAttention(E, HEADS, **kwargs))


def test_mha_mask_from_torch_conventions():
    blocked = torch.tensor([[False, True], [False, False]])
    np.testing.assert_array_equal(mha_mask_from_torch(blocked, num_heads=2), [[1, 0], [1, 1]])
    padding = torch.tensor([[False, True]])
    combined = mha_mask_from_torch(blocked, padding, num_heads=2)
    assert combined.shape == (1, 1, 2, 2)
    np.testing.assert_array_equal(combined[0, 0], [[1, 0], [1, 0]])
    additive = mha_mask_from_torch(torch.zeros(2, 2), padding, num_heads=2)
    np.testing.assert_array_equal(additive[0, 0], [[0, -np.inf], [0, -np.inf]])
    assert mha_mask_from_torch(num_heads=2) is None
    with pytest.raises(
        ValueError, match=r"attn_mask of shape \(3, 2, 2\) must be \[L, S\] or \[batch \* num_heads"
    ):
        mha_mask_from_torch(torch.zeros(3, 2, 2), num_heads=2)
    with pytest.raises(ValueError, match=r"key_padding_mask must be \[batch, S\]"):
        mha_mask_from_torch(key_padding_mask=torch.zeros(2), num_heads=2)
