"""``torch.nn`` building blocks -> attnjax: ``nn.MultiheadAttention`` and its masks, and the
``nn.Transformer`` family (-> ``attnjax.models.transformer``) and its masks.

Transformer keys under a layer ``layers.N.`` -> Flax paths under ``layers_N``:

    ==================================  =============================  ========================
    torch                               attnjax                        rule
    ==================================  =============================  ========================
    self_attn.in_proj_weight / _bias    self_attn/{query,key,value}    split in 3, transpose
    self_attn.out_proj                  self_attn/out                  Linear -> Dense
    multihead_attn.* (decoder)          multihead_attn/*               as self_attn
    linear1, linear2                    linear1, linear2               Linear -> Dense
    norm1, norm2, norm3 (decoder)       norm1, norm2, norm3            LayerNorm
    ==================================  =============================  ========================

A ``TransformerEncoder``/``TransformerDecoder`` puts its layers under ``layers.N`` and its final
norm under ``norm``; ``nn.Transformer`` nests those under ``encoder.`` and ``decoder.``.
"""

from __future__ import annotations

import numpy as np

from attnjax.convert.common import StateDict, linear, load_state_dict, take, to_numpy


def attention(state: StateDict, prefix: str) -> dict:
    """``nn.MultiheadAttention`` at ``prefix`` -> ``MultiHeadAttention`` params.

    The packed ``in_proj_weight`` [3E, E] splits into query/key/value; a module with
    ``kdim``/``vdim != embed_dim`` has separate ``q/k/v_proj_weight`` instead. Biases optional.
    """
    names = ("query", "key", "value")
    packed = take(state, prefix, "in_proj_weight", required=False)
    if packed is not None:
        weights = np.split(packed, 3)
    else:
        weights = [take(state, prefix, f"{name}_proj_weight") for name in ("q", "k", "v")]
    params = {name: {"kernel": w.T} for name, w in zip(names, weights)}
    packed_bias = take(state, prefix, "in_proj_bias", required=False)
    if packed_bias is not None:
        for name, bias in zip(names, np.split(packed_bias, 3)):
            params[name]["bias"] = bias
    params["out"] = linear(state, f"{prefix}.out_proj" if prefix else "out_proj")
    return params


def mha_from_torch(module):
    """``torch.nn.MultiheadAttention`` -> ``(MultiHeadAttention, variables)``, the module from
    ``attnjax.models.multihead``.

    Handles the packed ``in_proj_weight`` [3E, E] (split into query/key/value) and the separate
    ``q/k/v_proj_weight`` a module with ``kdim``/``vdim != embed_dim`` has, with or without bias.
    ``module.dropout`` becomes ``dropout_rate``. Our module is always batch-first: inputs of a
    ``batch_first=False`` module (``[L, batch, E]``) must be transposed by the caller. Masks
    translate with ``mha_mask_from_torch`` (PyTorch's boolean masks mean the opposite of ours).
    """
    from attnjax.models.multihead import MultiHeadAttention

    if getattr(module, "bias_k", None) is not None or getattr(module, "add_zero_attn", False):
        raise NotImplementedError(
            "mha_from_torch: add_bias_kv=True / add_zero_attn=True append extra key/value "
            "positions that attnjax.models.multihead.MultiHeadAttention does not model"
        )
    state = load_state_dict(module)
    params = attention(state, "")
    flax_module = MultiHeadAttention(
        num_heads=module.num_heads,
        use_bias="in_proj_bias" in state,
        dropout_rate=float(module.dropout),
    )
    return flax_module, {"params": params}


def mha_mask_from_torch(attn_mask=None, key_padding_mask=None, *, num_heads: int):
    """PyTorch ``MultiheadAttention`` masks -> one attnjax mask, broadcastable to
    ``[batch, heads, L, S]``.

    PyTorch: ``attn_mask`` ``[L, S]`` or ``[batch * heads, L, S]``, ``key_padding_mask``
    ``[batch, S]``; boolean True means "masked out", float masks are added. attnjax: boolean True
    means "may attend". Float and boolean masks together give an additive (float) mask, as in
    PyTorch. Returns None when both are None.
    """
    from attnjax.ops.masks import combine_masks

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
                "mha_mask_from_torch: attn_mask must be [L, S] or [batch * heads, L, S], "
                f"got {attn_mask.shape}"
            )
        masks.append(~attn_mask if attn_mask.dtype == bool else attn_mask)
    if key_padding_mask is not None:
        key_padding_mask = to_numpy(key_padding_mask)
        if key_padding_mask.ndim != 2:
            raise ValueError(
                "mha_mask_from_torch: key_padding_mask must be [batch, S], "
                f"got {key_padding_mask.shape}"
            )
        padding = key_padding_mask[:, None, None, :]
        masks.append(~padding if padding.dtype == bool else padding)
    return combine_masks(*masks)


def _layer_norm(state: StateDict, prefix: str) -> dict:
    """``nn.LayerNorm`` with or without bias (torch's ``bias=False``) -> Flax
    ``scale``[, ``bias``]."""
    params = {"scale": take(state, prefix, "weight")}
    bias = take(state, prefix, "bias", required=False)
    if bias is not None:
        params["bias"] = bias
    return params


ENCODER_LAYER_TABLE = (
    ("self_attn", "self_attn", attention),
    ("linear1", "linear1", linear),
    ("linear2", "linear2", linear),
    ("norm1", "norm1", _layer_norm),
    ("norm2", "norm2", _layer_norm),
)
DECODER_LAYER_TABLE = ENCODER_LAYER_TABLE + (
    ("multihead_attn", "multihead_attn", attention),
    ("norm3", "norm3", _layer_norm),
)
TRANSFORMER_KINDS = (
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerDecoder",
    "Transformer",
)


def _layer_params(state: StateDict, prefix: str, table) -> dict:
    return {
        flax_name: convert(state, f"{prefix}{torch_name}")
        for torch_name, flax_name, convert in table
    }


def _stack_params(state: StateDict, prefix: str, num_layers: int, table, final_norm: bool) -> dict:
    params = {
        f"layers_{i}": _layer_params(state, f"{prefix}layers.{i}.", table)
        for i in range(num_layers)
    }
    if final_norm:
        params["norm"] = _layer_norm(state, f"{prefix}norm")
    return params


def _layer_settings(layer) -> dict:
    """The hyper-parameters of a torch encoder/decoder layer, in torch's (= attnjax's) names."""
    # F.relu / F.gelu are functions, nn.ReLU() / nn.GELU() modules; only exact GELU matches ours
    function = layer.activation
    name = getattr(function, "__name__", type(function).__name__).lower()
    activation = name if name in ("relu", "gelu") else None
    if activation is None or getattr(function, "approximate", "none") != "none":
        raise ValueError(
            f"transformer_from_torch: activation {layer.activation} unsupported; expected "
            "'relu' or 'gelu' (F.relu / F.gelu)"
        )
    return dict(
        d_model=layer.self_attn.embed_dim,
        nhead=layer.self_attn.num_heads,
        dim_feedforward=layer.linear1.out_features,
        dropout=float(layer.dropout.p),
        activation=activation,
        layer_norm_eps=float(layer.norm1.eps),
        norm_first=bool(layer.norm_first),
        bias=layer.linear1.bias is not None,
    )


def _stack_settings(stack, where: str) -> tuple[dict, int, bool]:
    """(layer settings, number of layers, has a final norm) of a TransformerEncoder/Decoder."""
    settings = [_layer_settings(layer) for layer in stack.layers]
    if any(s != settings[0] for s in settings[1:]):
        raise ValueError(
            f"transformer_from_torch: the layers of {where} differ in hyper-parameters"
        )
    norm = stack.norm
    if norm is not None and (
        float(norm.eps) != settings[0]["layer_norm_eps"]
        or (norm.bias is not None) != settings[0]["bias"]
    ):
        raise ValueError(
            f"transformer_from_torch: {where}.norm (eps={norm.eps}, bias={norm.bias is not None}) "
            f"differs from its layers' LayerNorms (eps={settings[0]['layer_norm_eps']}, "
            f"bias={settings[0]['bias']})"
        )
    return settings[0], len(settings), norm is not None


def transformer_from_torch(module):
    """Any of torch's ``TransformerEncoderLayer``, ``TransformerDecoderLayer``,
    ``TransformerEncoder``, ``TransformerDecoder``, ``Transformer`` ->
    ``(attnjax.models.transformer module, {"params": ...})``.

    The Flax module's ``batch_first`` records the torch module's: with ``batch_first=False`` it
    takes and returns torch's ``[length, batch, d_model]`` arrays. Masks translate with
    ``transformer_masks_from_torch``. torch's ``enable_nested_tensor`` fast path zeroes the outputs
    at padded positions in eval mode; attnjax computes them like torch's training-mode math.
    """
    from attnjax.models import transformer

    kind = type(module).__name__
    if kind not in TRANSFORMER_KINDS:
        raise ValueError(f"transformer_from_torch: expected one of {TRANSFORMER_KINDS}, got {kind}")
    state = load_state_dict(module)
    if kind in ("TransformerEncoderLayer", "TransformerDecoderLayer"):
        settings = _layer_settings(module)
        table = ENCODER_LAYER_TABLE if kind == "TransformerEncoderLayer" else DECODER_LAYER_TABLE
        params = _layer_params(state, "", table)
        batch_first = module.self_attn.batch_first
    elif kind in ("TransformerEncoder", "TransformerDecoder"):
        settings, num_layers, final_norm = _stack_settings(module, kind)
        table = ENCODER_LAYER_TABLE if kind == "TransformerEncoder" else DECODER_LAYER_TABLE
        params = _stack_params(state, "", num_layers, table, final_norm)
        settings.update(num_layers=num_layers, final_norm=final_norm)
        batch_first = module.layers[0].self_attn.batch_first
    else:
        settings, num_encoder_layers, encoder_norm = _stack_settings(module.encoder, "encoder")
        decoder_settings, num_decoder_layers, decoder_norm = _stack_settings(
            module.decoder, "decoder"
        )
        if decoder_settings != settings or not (encoder_norm and decoder_norm):
            raise ValueError(
                "transformer_from_torch: a Transformer with a custom encoder/decoder whose layers "
                "differ, or without final norms, is not an attnjax Transformer; convert "
                "module.encoder and module.decoder separately"
            )
        params = {
            "encoder": _stack_params(
                state, "encoder.", num_encoder_layers, ENCODER_LAYER_TABLE, True
            ),
            "decoder": _stack_params(
                state, "decoder.", num_decoder_layers, DECODER_LAYER_TABLE, True
            ),
        }
        settings.update(
            num_encoder_layers=num_encoder_layers, num_decoder_layers=num_decoder_layers
        )
        batch_first = module.batch_first
    flax_module = getattr(transformer, kind)(**settings, batch_first=bool(batch_first))
    return flax_module, {"params": params}


def transformer_masks_from_torch(
    mask=None,
    key_padding_mask=None,
    *,
    is_causal: bool = False,
    num_heads: int | None = None,
):
    """torch's ``src_mask``/``tgt_mask``/``memory_mask`` plus ``*_key_padding_mask`` -> one
    attnjax mask.

    torch: ``mask`` ``[L, S]`` or ``[batch * heads, L, S]`` (the latter needs ``num_heads``),
    ``key_padding_mask`` ``[batch, S]``; boolean True means "may NOT attend", float masks are
    added. attnjax: boolean True means "may attend", broadcastable to ``[batch, heads, L, S]``.
    ``is_causal`` is torch's hint that ``mask`` is the causal mask; with no ``mask`` it builds
    one (self-attention, ``L = S`` from ``key_padding_mask``). Returns None when there is no mask.
    """
    from attnjax.ops.masks import causal_mask

    if mask is not None and np.ndim(to_numpy(mask)) == 3 and num_heads is None:
        raise ValueError(
            f"transformer_masks_from_torch: a 3-d mask of shape {tuple(np.shape(mask))} is "
            "[batch * heads, L, S]; pass num_heads="
        )
    if is_causal and mask is None:
        if key_padding_mask is None:
            raise ValueError(
                "transformer_masks_from_torch: is_causal=True without a mask needs "
                "key_padding_mask to know the length (or pass is_causal to the attnjax module "
                "instead)"
            )
        mask = ~np.asarray(causal_mask(np.shape(key_padding_mask)[1]))
    return mha_mask_from_torch(mask, key_padding_mask, num_heads=num_heads or 1)
