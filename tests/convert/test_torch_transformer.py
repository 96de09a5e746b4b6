"""attnjax.models.transformer equals torch's nn.Transformer family (outputs and gradients) to
1e-5."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_close

from attnjax.convert.torch_nn import transformer_from_torch, transformer_masks_from_torch

# One row per case: kind, norm_first, activation, bias, batch_first, final norm, padding mask,
# causal mask as torch's boolean or float mask (with the is_causal hint) or attnjax's is_causal
# flag.
CASES = [
    ("TransformerEncoderLayer", False, "relu", True, True, False, True, None),
    ("TransformerEncoderLayer", True, "gelu", False, False, False, False, "bool"),
    ("TransformerEncoder", False, "gelu", True, True, True, True, "flag"),
    ("TransformerEncoder", True, "relu", True, False, False, True, "float"),
    ("TransformerDecoderLayer", False, "relu", True, True, False, True, "bool"),
    ("TransformerDecoder", True, "gelu", False, True, True, False, "flag"),
    ("Transformer", False, "relu", True, True, True, True, "float"),
    ("Transformer", True, "gelu", False, False, True, True, "flag"),
]
ENCODER_KINDS = ("TransformerEncoderLayer", "TransformerEncoder")


def _build_torch(kind, layer_kwargs, final_norm, rng):
    heads = int(rng.choice([1, 2, 4]))
    d_model = heads * int(rng.choice([3, 4]))
    kwargs = dict(
        d_model=d_model,
        nhead=heads,
        dim_feedforward=int(rng.integers(8, 24)),
        dropout=0.0,
        layer_norm_eps=float(rng.choice([1e-5, 1e-6])),
        **layer_kwargs,
    )
    torch.manual_seed(int(rng.integers(1 << 30)))
    if kind == "Transformer":
        return torch.nn.Transformer(num_encoder_layers=1, num_decoder_layers=2, **kwargs)
    layer_class = (
        torch.nn.TransformerEncoderLayer if "Encoder" in kind else torch.nn.TransformerDecoderLayer
    )
    layer = layer_class(**kwargs)
    if kind.endswith("Layer"):
        return layer
    norm = (
        torch.nn.LayerNorm(d_model, eps=kwargs["layer_norm_eps"], bias=kwargs["bias"])
        if final_norm
        else None
    )
    stack_class = (
        torch.nn.TransformerEncoder if kind == "TransformerEncoder" else torch.nn.TransformerDecoder
    )
    return stack_class(layer, num_layers=2, norm=norm)


def _torch_causal(length, how):
    if how == "float":
        return torch.nn.Transformer.generate_square_subsequent_mask(length)
    return torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)


def _inputs(module, kind, masks, rng):
    """numpy inputs (batch-first), torch call kwargs, attnjax call kwargs, valid output rows."""
    d_model = (
        module.layers[0].linear2.out_features
        if hasattr(module, "layers")
        else (
            module.encoder.layers[0].linear2.out_features
            if kind == "Transformer"
            else module.linear2.out_features
        )
    )
    batch, source_length, target_length = 3, int(rng.integers(3, 7)), int(rng.integers(2, 6))
    src = rng.standard_normal((batch, source_length, d_model)).astype(np.float32)
    tgt = rng.standard_normal((batch, target_length, d_model)).astype(np.float32)
    lengths = np.array([source_length, source_length - 1, 1])
    padding = (
        torch.from_numpy(np.arange(source_length)[None, :] >= lengths[:, None])
        if masks["padding"]
        else None
    )
    causal = masks["causal"]
    self_length = source_length if kind in ENCODER_KINDS else target_length
    torch_causal = _torch_causal(self_length, causal) if causal else None
    self_mask = transformer_masks_from_torch(
        None if causal == "flag" else torch_causal, padding if kind in ENCODER_KINDS else None
    )
    memory_mask = transformer_masks_from_torch(None, padding)
    flag = causal == "flag"
    if kind in ENCODER_KINDS:
        arrays = {"src": src}
        torch_kwargs = dict(src_key_padding_mask=padding, is_causal=bool(causal))
        torch_kwargs["src_mask" if kind.endswith("Layer") else "mask"] = torch_causal
        ours = dict(mask=self_mask, is_causal=flag)
        valid = np.arange(source_length)[None, :] < lengths[:, None] if masks["padding"] else None
    elif kind == "Transformer":
        arrays = {"src": src, "tgt": tgt}
        torch_kwargs = dict(
            tgt_mask=torch_causal,
            tgt_is_causal=bool(causal),
            src_key_padding_mask=padding,
            memory_key_padding_mask=padding,
        )
        ours = dict(
            src_mask=memory_mask, tgt_mask=self_mask, memory_mask=memory_mask, tgt_is_causal=flag
        )
        valid = None
    else:
        arrays = {"tgt": tgt, "memory": src}
        torch_kwargs = dict(
            tgt_mask=torch_causal, tgt_is_causal=bool(causal), memory_key_padding_mask=padding
        )
        ours = dict(tgt_mask=self_mask, memory_mask=memory_mask, tgt_is_causal=flag)
        valid = None
    return arrays, torch_kwargs, ours, valid


def _layout(array, batch_first):
    return array if batch_first else np.swapaxes(array, 0, 1)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_outputs_and_gradients_equal_torch(case):
    kind, norm_first, activation, bias, batch_first, final_norm, padding, causal = CASES[case]
    layer_kwargs = dict(
        norm_first=norm_first, activation=activation, bias=bias, batch_first=batch_first
    )
    masks = dict(padding=padding, causal=causal)
    rng = np.random.default_rng(case)
    module = _build_torch(kind, layer_kwargs, final_norm, rng)
    flax_module, variables = transformer_from_torch(module)
    assert type(flax_module).__name__ == kind and flax_module.batch_first == batch_first
    arrays, torch_kwargs, ours, valid = _inputs(module, kind, masks, rng)
    arrays = {name: _layout(a, batch_first) for name, a in arrays.items()}

    # eval mode: torch may take its fused fast path (and nested tensors, which zero padded rows)
    module.eval()
    with torch.no_grad():
        expected = module(*(torch.from_numpy(a) for a in arrays.values()), **torch_kwargs).numpy()
    got = np.asarray(
        jax.jit(lambda v, *x: flax_module.apply(v, *x, **ours))(variables, *arrays.values())
    )
    rows = valid if valid is not None else np.ones(_layout(got, batch_first).shape[:2], bool)
    assert_close(
        _layout(got, batch_first)[rows],
        _layout(expected, batch_first)[rows],
        what=f"{kind} eval output",
    )

    # training-mode math (dropout 0): outputs and gradients w.r.t. inputs and parameters
    module.train()
    torch_inputs = [torch.from_numpy(a).requires_grad_(True) for a in arrays.values()]
    expected = module(*torch_inputs, **torch_kwargs)
    cotangent = rng.standard_normal(expected.shape).astype(np.float32)
    (expected * torch.from_numpy(cotangent)).sum().backward()
    gradient_module = copy.deepcopy(module)
    for parameter, holder in zip(module.parameters(), gradient_module.parameters()):
        holder.data = parameter.grad
    expected_param_grads = transformer_from_torch(gradient_module)[1]["params"]

    def loss(params, *inputs):
        out = flax_module.apply({"params": params}, *inputs, **ours, deterministic=False)
        return jnp.sum(out * cotangent), out

    grads, got = jax.jit(jax.grad(loss, argnums=tuple(range(len(arrays) + 1)), has_aux=True))(
        variables["params"], *arrays.values()
    )
    assert_close(got, expected.detach().numpy(), what=f"{kind} train output")
    for name, grad, tensor in zip(arrays, grads[1:], torch_inputs):
        assert_close(grad, tensor.grad.numpy(), atol=1e-5, what=f"{kind} d/d{name}")
    flat_expected = dict(jax.tree_util.tree_leaves_with_path(expected_param_grads))
    for path, grad in jax.tree_util.tree_leaves_with_path(grads[0]):
        assert_close(
            grad, flat_expected[path], atol=1e-5, what=f"{kind} d/d{jax.tree_util.keystr(path)}"
        )


def test_hyper_parameters_are_read_from_the_module():
    module = torch.nn.TransformerEncoderLayer(
        12, 3, 20, dropout=0.25, activation="gelu", layer_norm_eps=1e-6, norm_first=True, bias=False
    )
    flax_module, variables = transformer_from_torch(module)
    assert (flax_module.d_model, flax_module.nhead, flax_module.dim_feedforward) == (12, 3, 20)
    assert (flax_module.dropout, flax_module.activation, flax_module.layer_norm_eps) == (
        0.25,
        "gelu",
        1e-6,
    )
    assert flax_module.norm_first and not flax_module.bias and not flax_module.batch_first
    assert (
        "bias" not in variables["params"]["norm1"] and "bias" not in variables["params"]["linear1"]
    )


def test_masks_translate_torch_conventions():
    boolean = torch.tensor([[False, True], [False, False]])  # torch: True = masked out
    padding = torch.tensor([[False, False], [False, True]])
    mask = np.asarray(transformer_masks_from_torch(boolean, padding))
    expected = ~boolean.numpy()[None, None] & ~padding.numpy()[:, None, None, :]
    np.testing.assert_array_equal(mask, expected)
    causal = np.asarray(transformer_masks_from_torch(key_padding_mask=padding, is_causal=True))
    np.testing.assert_array_equal(causal[1, 0], [[True, False], [True, False]])
    additive = torch.nn.Transformer.generate_square_subsequent_mask(2)
    np.testing.assert_array_equal(
        np.asarray(transformer_masks_from_torch(additive)), additive.numpy()
    )


def test_unsupported_modules_and_masks_raise_clearly():
    with pytest.raises(ValueError, match="expected one of"):
        transformer_from_torch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="activation"):
        transformer_from_torch(
            torch.nn.TransformerEncoderLayer(4, 2, 8, activation=torch.nn.SiLU())
        )
    with pytest.raises(ValueError, match="num_heads"):
        transformer_masks_from_torch(torch.zeros(4, 2, 2, dtype=torch.bool))
