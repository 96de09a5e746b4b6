"""``torch.nn`` building blocks -> attnjax: ``nn.MultiheadAttention`` and its masks."""
from __future__ import annotations

import numpy as np

from attnjax.convert.common import linear, to_numpy


def mha_from_torch(module):
    """``torch.nn.MultiheadAttention`` -> ``(attnjax.attention.MultiHeadAttention, variables)``.

    Handles the packed ``in_proj_weight`` [3E, E] (split into query/key/value) and the separate
    ``q/k/v_proj_weight`` a module with ``kdim``/``vdim != embed_dim`` has, with or without bias.
    ``module.dropout`` becomes ``dropout_rate``. Our module is always batch-first: inputs of a
    ``batch_first=False`` module (``[L, batch, E]``) must be transposed by the caller. Masks
    translate with ``mha_mask_from_torch`` (PyTorch's boolean masks mean the opposite of ours).
    """
    from attnjax.attention import MultiHeadAttention

    if getattr(module, "bias_k", None) is not None or getattr(module, "add_zero_attn", False):
        raise NotImplementedError(
            "mha_from_torch: add_bias_kv=True / add_zero_attn=True append extra key/value positions "
            "that attnjax.attention.MultiHeadAttention does not model"
        )
    state = {name: to_numpy(value) for name, value in module.state_dict().items()}
    if "in_proj_weight" in state:
        weights = np.split(state["in_proj_weight"], 3)
    else:
        weights = [state[f"{name}_proj_weight"] for name in ("q", "k", "v")]
    params = {name: {"kernel": w.T} for name, w in zip(("query", "key", "value"), weights)}
    if "in_proj_bias" in state:
        for name, bias in zip(("query", "key", "value"), np.split(state["in_proj_bias"], 3)):
            params[name]["bias"] = bias
    params["out"] = linear(state, "out_proj")
    flax_module = MultiHeadAttention(
        num_heads=module.num_heads,
        use_bias="in_proj_bias" in state,
        dropout_rate=float(module.dropout),
    )
    return flax_module, {"params": params}


def mha_mask_from_torch(attn_mask=None, key_padding_mask=None, *, num_heads: int):
    """PyTorch ``MultiheadAttention`` masks -> one attnjax mask, broadcastable to ``[batch, heads, L, S]``.

    PyTorch: ``attn_mask`` ``[L, S]`` or ``[batch * heads, L, S]``, ``key_padding_mask``
    ``[batch, S]``; boolean True means "masked out", float masks are added. attnjax: boolean True
    means "may attend". Float and boolean masks together give an additive (float) mask, as in
    PyTorch. Returns None when both are None.
    """
    from attnjax.attention import combine_masks

    masks = []
    if attn_mask is not None:
        attn_mask = to_numpy(attn_mask)
        if attn_mask.ndim == 3:
            if attn_mask.shape[0] % num_heads:
                raise ValueError(
                    f"mha_mask_from_torch: attn_mask of shape {attn_mask.shape} must be [L, S] or "
                    f"[batch * num_heads, L, S] with num_heads={num_heads}"
                )
            attn_mask = attn_mask.reshape(-1, num_heads, *attn_mask.shape[1:])
        elif attn_mask.ndim != 2:
            raise ValueError(
                f"mha_mask_from_torch: attn_mask must be [L, S] or [batch * heads, L, S], got {attn_mask.shape}"
            )
        masks.append(~attn_mask if attn_mask.dtype == bool else attn_mask)
    if key_padding_mask is not None:
        key_padding_mask = to_numpy(key_padding_mask)
        if key_padding_mask.ndim != 2:
            raise ValueError(
                f"mha_mask_from_torch: key_padding_mask must be [batch, S], got {key_padding_mask.shape}"
            )
        padding = key_padding_mask[:, None, None, :]
        masks.append(~padding if padding.dtype == bool else padding)
    return combine_masks(*masks)
