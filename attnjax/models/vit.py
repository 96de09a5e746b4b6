"""Vision Transformer (Dosovitskiy et al., 2021) as Linen modules, with a variant table.

Data flow, for channels-last images ``[batch, H, W, C]`` and patch size ``(ph, pw)``::

    patchify            [batch, gh * gw, ph * pw * C]     gh = H / ph, gw = W / pw
    patch_embed (Dense) [batch, gh * gw, width]           (= a stride-P convolution)
    cls_token, pos      [batch, 1 + gh * gw, width]       class token first, then row-major patches
    blocks x depth      pre-LN: x + attn(LN(x)); x + mlp(LN(x))
                        or parallel (ViT-22B): x + attn(LN(x)) + mlp(LN(x))
    norm, pool, head    [batch, num_classes]

Parameter names follow timm's vocabulary (``patch_embed``, ``cls_token``, ``pos_embed``,
``blocks_N/{norm1, attn, norm2, mlp/fc1, mlp/fc2}``, ``norm``, ``fc_norm``, ``head``), so the
converters in ``attnjax.convert`` are key tables. ``attn`` is
``attnjax.models.multihead.MultiHeadAttention`` (``query``/``key``/``value``/``out`` Dense layers,
``q_norm``/``k_norm`` with ``qk_norm``); the blocks live in ``attnjax.models.vit_blocks``.
With ``scan_layers=True`` the blocks are one ``nn.scan``-ed module ``blocks`` whose parameters
carry a leading ``[depth]`` axis; ``stack_block_params``/``unstack_block_params`` convert.

Patch pixels are flattened in ``(row, column, channel)`` order, so ``patch_embed.kernel`` is a
``[ph, pw, C, width]`` convolution kernel reshaped to ``[ph * pw * C, width]``.
``patchify`` lives in ``attnjax.models.patches``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attnjax.models.multihead import PARAM_AXES as ATTENTION_AXES
from attnjax.models.multihead import feed_forward_axes
from attnjax.models.patches import pair, patchify
from attnjax.models.position_embedding import LearnedPositionEmbedding
from attnjax.models.vit_blocks import EncoderBlock, layer_norm
from attnjax.ops.dense import rows_dot_general
from attnjax.ops.positional import sincos_2d_encoding

Array = jax.Array

# Logical axis names of the parameters, by path (``attnjax.parallel.sharding`` lays them out on a
# mesh): the attention's, and the MLP's hidden units; the rest has none.
PARAM_AXES = ATTENTION_AXES + feed_forward_axes("mlp/fc1", "mlp/fc2")

# Standard sizes (Dosovitskiy et al. 2021; Ti from DeiT): width, depth, MLP size, heads.
_SIZES = {
    "Ti": dict(width=192, depth=12, mlp_dim=768, num_heads=3),
    "S": dict(width=384, depth=12, mlp_dim=1536, num_heads=6),
    "B": dict(width=768, depth=12, mlp_dim=3072, num_heads=12),
    "L": dict(width=1024, depth=24, mlp_dim=4096, num_heads=16),
    "H": dict(width=1280, depth=32, mlp_dim=5120, num_heads=16),
    # Dehghani et al. 2023 changed the block too: without these it is a plain ViT of that size.
    "22B": dict(
        width=6144,
        depth=48,
        mlp_dim=24576,
        num_heads=48,
        parallel_block=True,
        qk_norm=True,
        qkv_bias=False,
        layer_norm_bias=False,
    ),
}
# Named models that are not "size/patch" strings. "cifar" is a small ViT for 32x32 CIFAR-10
# images (4x4 patches, 6 blocks of width 256) in the layout of a plain PyTorch ViT whose
# converter is ``attnjax.convert.timm``: torch LayerNorms (eps 1e-5) and dropout on the attention
# weights. Its evaluation matches that PyTorch model exactly; in training, dropout sits where timm
# and big_vision put it (after the GELU, after fc2, after the attention projection), where that
# model drops before the GELU and not after attention.
_NAMED = {
    "cifar": dict(
        image_size=32,
        patch_size=4,
        width=256,
        depth=6,
        mlp_dim=512,
        num_heads=8,
        num_classes=10,
        dropout_rate=0.2,
        attention_dropout_rate=0.2,
        layer_norm_eps=1e-5,
    ),
}
_VARIANT_PATTERN = re.compile(r"^(?P<size>[A-Za-z0-9]+)/(?P<patch>\d+)$")


class ViT(nn.Module):
    """Vision Transformer classifier on channels-last images.

    ``__call__(images [batch, H, W, C], *, train=False, return_aux=False)`` returns logits
    ``[batch, num_classes]`` (float32), or ``(logits, aux)`` with ``aux["attention_weights"]``, a
    tuple with one ``[batch, heads, tokens, tokens]`` array per layer, and ``aux["pre_logits"]``
    ``[batch, width]`` (the pooled, normalised features the head reads). ``train=True`` enables
    dropout and stochastic depth (rng collection ``"dropout"``).

    Attributes:
      num_classes: head size; 0 for no head (the pre-logits are returned as logits).
      patch_size: ``P`` or ``(ph, pw)``.
      width, depth, num_heads: token size, number of blocks, attention heads.
      mlp_dim: MLP hidden size; default ``int(width * mlp_ratio)``.
      mlp_ratio: used when ``mlp_dim`` is None.
      in_channels: expected image channels (checked).
      image_size: expected ``H`` (or ``(H, W)``), checked when set; None accepts any size
        divisible by the patch (a learned position table takes its size from ``init``).
      pool: "cls" (head on the class token) or "gap" (mean of the patch tokens).
      class_token: prepend a learned class token (needed by ``pool="cls"``).
      posemb: "learn" (parameter ``pos_embed/pos_embedding``), "sincos2d" (fixed, on the patch
        tokens only) or "none".
      no_embed_class: learned position table covers only the patch tokens (timm's
        ``no_embed_class``, big_vision); by default it covers the class token too (original ViT).
      fc_norm: final LayerNorm after pooling (``fc_norm``) instead of before (``norm``);
        None: after for "gap", before for "cls" (timm's rule).
      representation_size: optional ``Dense + tanh`` ``pre_logits`` layer before the head (the
        original ImageNet-21k checkpoints).
      dropout_rate: dropout on the embeddings, after attention and in the MLP.
      attention_dropout_rate: dropout on the attention weights.
      drop_path_rate: stochastic depth, rising linearly from 0 (first block) to this value (last).
      parallel_block: attention and MLP side by side from one LayerNorm,
        ``x + attn(LN(x)) + mlp(LN(x))`` (ViT-22B; timm's ``ParallelScalingBlock``).
      qk_norm: LayerNorm on each head's queries and keys before the dot product (ViT-22B).
      qkv_bias: biases on the query/key/value projections (ViT-22B has none).
      layer_norm_eps: 1e-6 (timm, big_vision); torch's default (the "cifar" variant) is 1e-5.
      layer_norm_bias: a bias in every LayerNorm (ViT-22B has none).
      dtype: computation dtype (e.g. ``jnp.bfloat16``); parameters stay ``param_dtype``.
      scan_layers: apply one block with ``nn.scan`` (compile time independent of depth).
      remat: recompute each block's activations in the backward pass (saves memory).
    """

    num_classes: int = 1000
    patch_size: Any = 16
    width: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int | None = None
    mlp_ratio: float = 4.0
    in_channels: int = 3
    image_size: Any = None
    pool: str = "cls"
    class_token: bool = True
    posemb: str = "learn"
    no_embed_class: bool = False
    fc_norm: bool | None = None
    representation_size: int | None = None
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    drop_path_rate: float = 0.0
    parallel_block: bool = False
    qk_norm: bool = False
    qkv_bias: bool = True
    layer_norm_eps: float = 1e-6
    layer_norm_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    scan_layers: bool = False
    remat: bool = False

    def _check_config(self):
        if self.pool not in ("cls", "gap"):
            raise ValueError(f"ViT: pool must be 'cls' or 'gap', got {self.pool!r}")
        if self.pool == "cls" and not self.class_token:
            raise ValueError("ViT: pool='cls' needs class_token=True")
        if self.posemb not in ("learn", "sincos2d", "none"):
            raise ValueError(
                f"ViT: posemb must be 'learn', 'sincos2d' or 'none', got {self.posemb!r}"
            )
        if self.width % self.num_heads:
            raise ValueError(f"ViT: num_heads={self.num_heads} does not divide width={self.width}")
        for name in ("dropout_rate", "attention_dropout_rate", "drop_path_rate"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"ViT: {name} must be in [0, 1), got {getattr(self, name)}")

    def _check_images(self, images):
        if jnp.ndim(images) != 4:
            raise ValueError(
                f"ViT: images must be channels-last [batch, H, W, C], got shape {jnp.shape(images)}"
            )
        _, height, width, channels = images.shape
        if channels != self.in_channels:
            raise ValueError(
                f"ViT: images have {channels} channels (shape {images.shape}), expected "
                f"in_channels={self.in_channels} in the last axis (channels-last [batch, H, W, C])"
            )
        if self.image_size is not None and (height, width) != pair(
            self.image_size, "image_size", "ViT"
        ):
            raise ValueError(
                f"ViT: images are {height}x{width} (shape {images.shape}), expected image_size "
                f"{self.image_size!r}"
            )

    def _embed(self, images, train: bool):
        self._check_images(images)
        x = patchify(images.astype(self.dtype or images.dtype), self.patch_size)
        ph, pw = pair(self.patch_size, "patch_size", "ViT")
        grid_h, grid_w = images.shape[1] // ph, images.shape[2] // pw
        x = nn.Dense(
            self.width,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            dot_general=rows_dot_general,
            name="patch_embed",
        )(x)
        if self.posemb == "sincos2d":
            x = x + sincos_2d_encoding(grid_h, grid_w, self.width).astype(x.dtype)[None]
        learned = functools.partial(
            LearnedPositionEmbedding, param_dtype=self.param_dtype, name="pos_embed"
        )
        if self.posemb == "learn" and (self.no_embed_class or not self.class_token):
            x = learned()(x)
        if self.class_token:
            cls = self.param(
                "cls_token", nn.initializers.zeros, (1, 1, self.width), self.param_dtype
            )
            cls = jnp.broadcast_to(cls.astype(x.dtype), (x.shape[0], 1, self.width))
            x = jnp.concatenate([cls, x], axis=1)
            if self.posemb == "learn" and not self.no_embed_class:
                x = learned()(x)
        return nn.Dropout(self.dropout_rate)(x, deterministic=not train)

    def _encode(self, x, train: bool, return_weights: bool):
        """``[batch, tokens, width]`` through the blocks -> (tokens, per-layer weights or ())."""
        block_kwargs = dict(
            num_heads=self.num_heads,
            mlp_dim=self.mlp_dim or int(self.width * self.mlp_ratio),
            dropout_rate=self.dropout_rate,
            attention_dropout_rate=self.attention_dropout_rate,
            stochastic_depth=self.drop_path_rate > 0.0,
            parallel=self.parallel_block,
            qk_norm=self.qk_norm,
            qkv_bias=self.qkv_bias,
            layer_norm_eps=self.layer_norm_eps,
            layer_norm_bias=self.layer_norm_bias,
            deterministic=not train,
            return_weights=return_weights,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        block = EncoderBlock
        if self.remat:
            # Under scan, CSE across iterations is impossible anyway; prevent_cse only costs there.
            block = nn.remat(EncoderBlock, prevent_cse=not self.scan_layers)
        rates = np.linspace(0.0, self.drop_path_rate, self.depth, dtype=np.float32)
        if self.scan_layers:
            scanned = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=0,
                length=self.depth,
            )
            x, weights = scanned(**block_kwargs, name="blocks")(x, jnp.asarray(rates))
            return x, (tuple(weights) if return_weights else ())
        weights = []
        for layer in range(self.depth):
            x, layer_weights = block(**block_kwargs, name=f"blocks_{layer}")(x, float(rates[layer]))
            weights.append(layer_weights)
        return x, (tuple(weights) if return_weights else ())

    @nn.compact
    def __call__(self, images, *, train: bool = False, return_aux: bool = False):
        self._check_config()
        x = self._embed(images, train)
        x, attention_weights = self._encode(x, train, return_aux)
        use_fc_norm = self.pool == "gap" if self.fc_norm is None else self.fc_norm
        if not use_fc_norm:
            x = layer_norm(self, "norm")(x)
        num_prefix = 1 if self.class_token else 0
        x = x[:, 0] if self.pool == "cls" else jnp.mean(x[:, num_prefix:], axis=1)
        if use_fc_norm:
            x = layer_norm(self, "fc_norm")(x)
        if self.representation_size is not None:
            x = nn.Dense(
                self.representation_size,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name="pre_logits",
            )(x)
            x = jnp.tanh(x)
        pre_logits = x
        if self.num_classes:
            x = nn.Dense(
                self.num_classes,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                kernel_init=nn.initializers.zeros,
                name="head",
            )(x)
        logits = x.astype(jnp.float32)
        if return_aux:
            return logits, {"attention_weights": attention_weights, "pre_logits": pre_logits}
        return logits


def variant_config(variant: str) -> dict:
    """ViT kwargs of a named variant ("cifar") or of ``"<size>/<patch>"`` (Ti, S, B, L, H, 22B)."""
    if not isinstance(variant, str):
        raise ValueError(f"create_vit: variant must be a string such as 'S/16', got {variant!r}")
    if variant in _NAMED:
        return dict(_NAMED[variant])
    match = _VARIANT_PATTERN.match(variant)
    if match is None or match["size"] not in _SIZES or int(match["patch"]) < 1:
        raise ValueError(
            f"create_vit: unknown variant {variant!r}; expected one of {sorted(_NAMED)} or "
            f"'<size>/<patch>' with size in {list(_SIZES)} (e.g. 'S/16', 'B/32', 'Ti/8')"
        )
    return dict(_SIZES[match["size"]], patch_size=int(match["patch"]))


def create_vit(variant: str | None = None, **overrides) -> ViT:
    """A ``ViT`` from a variant (``"cifar"``, ``"Ti/16"``, ``"S/16"``, ``"B/32"``...) and/or fields.

    ``overrides`` are ``ViT`` fields and win over the variant's values, e.g.
    ``create_vit("S/16", num_classes=10, image_size=32, patch_size=4)``.
    """
    config = variant_config(variant) if variant is not None else {}
    fields = {f.name for f in dataclasses.fields(ViT)} - {"parent", "name"}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"create_vit: unknown ViT field(s) {unknown}; valid fields are {sorted(fields)}"
        )
    config.update(overrides)
    return ViT(**config)


# --------------------------------------------------------------------------------------------
# Scanned <-> per-layer parameter layouts
# --------------------------------------------------------------------------------------------


def stack_block_params(params: dict) -> dict:
    """Per-layer ``blocks_0 .. blocks_{n-1}`` -> one ``blocks`` subtree with a leading ``[n]`` axis
    (the ``scan_layers=True`` layout). Other entries are kept."""
    names = sorted((k for k in params if re.fullmatch(r"blocks_\d+", k)), key=lambda k: int(k[7:]))
    if not names:
        raise ValueError(f"stack_block_params: no 'blocks_N' entries among {sorted(params)}")
    if [int(k[7:]) for k in names] != list(range(len(names))):
        raise ValueError(f"stack_block_params: block indices are not 0..n-1: {names}")
    out = {k: v for k, v in params.items() if k not in names}
    out["blocks"] = jax.tree.map(lambda *leaves: np.stack(leaves), *(params[k] for k in names))
    return out


def unstack_block_params(params: dict) -> dict:
    """Inverse of ``stack_block_params``: ``blocks`` with a leading ``[n]`` axis -> ``blocks_N``."""
    if "blocks" not in params:
        raise ValueError(f"unstack_block_params: no 'blocks' entry among {sorted(params)}")
    out = {k: v for k, v in params.items() if k != "blocks"}
    depth = jax.tree.leaves(params["blocks"])[0].shape[0]
    for layer in range(depth):
        out[f"blocks_{layer}"] = jax.tree.map(lambda leaf: leaf[layer], params["blocks"])
    return out


def layer_depths(params) -> Any:
    """Each parameter's depth, for layer-wise learning-rate decay (``optim``'s ``layer_decay``).

    timm's ``group_matcher`` for its ViT, with ``L`` blocks: ``patch_embed``, ``cls_token`` and
    ``pos_embed`` are depth 0, ``blocks_k`` is ``k + 1``, the final ``norm`` shares the last
    block's depth ``L``, and the rest (``fc_norm``, ``pre_logits``, ``head``) is ``L + 1``.
    Returns a tree like ``params`` of int arrays that broadcast against its leaves: scalars, and
    ``[L, 1, ...]`` in the scanned layout's ``blocks``.
    """
    stacked = jax.tree.leaves(params.get("blocks", {}))
    num_blocks = stacked[0].shape[0] if stacked else sum(k.startswith("blocks_") for k in params)

    def depth(path, leaf):
        top = path[0].key
        if top in ("patch_embed", "cls_token", "pos_embed"):
            return np.array(0)
        if top == "blocks":
            return np.arange(1, num_blocks + 1).reshape((-1,) + (1,) * (leaf.ndim - 1))
        if top.startswith("blocks_"):
            return np.array(int(top[len("blocks_") :]) + 1)
        return np.array(num_blocks if top == "norm" else num_blocks + 1)

    return jax.tree_util.tree_map_with_path(depth, params)


# --------------------------------------------------------------------------------------------
# Attention rollout
# --------------------------------------------------------------------------------------------


def attention_rollout(
    attention_weights, grid_shape, *, num_prefix_tokens: int = 1, residual_weight: float = 0.5
) -> Array:
    """Attention rollout (Abnar & Zuidema, 2020): how much each patch flows into the output token.

    Per layer ``l`` the heads are averaged, the residual connection is modelled by mixing in the
    identity, and rows are renormalised: ``A_l = normalize((1 - r) * mean_h(W_l) + r * I)``.
    The rollout is the product ``A_L @ ... @ A_1``; its row for the class token (or, without a
    prefix token, the mean of all rows), restricted to the patch tokens, is the heat map.

    Args:
      attention_weights: a sequence of per-layer weights ``[batch, heads, tokens, tokens]`` (as in
        ``ViT(...)(..., return_aux=True)[1]["attention_weights"]``) or one array
        ``[layers, batch, heads, tokens, tokens]``.
      grid_shape: ``(grid_h, grid_w)`` of the patch grid, ``tokens = num_prefix_tokens + gh * gw``.
      num_prefix_tokens: class token(s) in front of the patch tokens (0 for a GAP model).
      residual_weight: ``r``, the identity's share (0.5 in the paper).

    Returns:
      ``[batch, grid_h, grid_w]`` non-negative weights.
    """
    if not hasattr(attention_weights, "ndim"):
        attention_weights = jnp.stack(list(attention_weights))
    weights = jnp.asarray(attention_weights, jnp.float32)
    grid_h, grid_w = pair(grid_shape, "grid_shape", "attention_rollout")
    if weights.ndim != 5 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(
            "attention_rollout: attention_weights must be per-layer [batch, heads, tokens, "
            f"tokens], got stacked shape {weights.shape}"
        )
    tokens = weights.shape[-1]
    if tokens != num_prefix_tokens + grid_h * grid_w:
        raise ValueError(
            f"attention_rollout: {tokens} tokens do not match "
            f"num_prefix_tokens={num_prefix_tokens} + grid {grid_h}x{grid_w}"
        )
    identity = jnp.eye(tokens, dtype=jnp.float32)
    mixed = (1.0 - residual_weight) * weights.mean(axis=2) + residual_weight * identity
    mixed = mixed / mixed.sum(axis=-1, keepdims=True)  # [layers, batch, tokens, tokens]
    rollout = functools.reduce(lambda acc, layer: layer @ acc, mixed)
    source = rollout[:, 0] if num_prefix_tokens else rollout.mean(axis=1)  # [batch, tokens]
    return source[:, num_prefix_tokens:].reshape(-1, grid_h, grid_w)
