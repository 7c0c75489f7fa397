"""PyTorch's fused inference kernels for ``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer`` ("BetterTransformer" fast path).

In ``eval()`` under ``torch.no_grad()`` (or with no parameter requiring grad) those
modules skip their Python composition and call one ATen op, for any PrivateUse1 device:
``_native_multi_head_attention`` (self-attention, ``batch_first=True``, an even number of
heads, bool or no masks) and ``_transformer_encoder_layer_fwd``. Both receive the masks
already merged by ``MultiheadAttention.merge_masks`` with a ``mask_type``: 0 = ``(L, L)``
attention mask, 1 = ``(B, L)`` key padding mask, 2 = ``(B, H, L, L)`` merged mask. The
masks arrive as float (0 / -inf, from ``F._canonical_mask``); ATen turns any non-bool mask
into bool with ``mask != 0`` (True = masked out), and so do we.

``nn.TransformerEncoder`` with ``enable_nested_tensor=True`` and a left-aligned
``src_key_padding_mask`` packs the batch into a nested tensor first and calls
``_transformer_encoder_layer_fwd`` on it: Note [TransformerEncoder's nested path on tpu]
in torchjax/ops/transformer_nested.py.

Reference: aten/src/ATen/native/transformers/{attention.cpp,transformer.cpp},
aten/src/ATen/native/SoftMax.cpp (``masked_softmax_cpu``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.ops.matmul import accumulating_dot
from torchjax.ops.norm import _layer_norm, _opmath
from torchjax.ops.registry import lowering

aten = torch.ops.aten

HIGHEST = lax.Precision.HIGHEST


def _linear(x, weight, bias=None):
    """``x @ weight.T + bias`` at HIGHEST precision, accumulated in opmath, rounded to
    x's dtype (ATen rounds each GEMM output of a half-precision layer)."""
    y = accumulating_dot(x, weight, (((x.ndim - 1,), (1,)), ((), ())), HIGHEST)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y.astype(x.dtype)


def _bmm(a, b, contract_a, contract_b):
    """Batched product over the two leading (B, H) dims."""
    y = accumulating_dot(a, b, (((contract_a,), (contract_b,)), ((0, 1), (0, 1))), HIGHEST)
    return y.astype(a.dtype)


# ---------------------------------------------------------------------------------------
# masked softmax


def _bool_mask(mask):
    return mask if mask.dtype == jnp.bool_ else mask != jnp.zeros((), mask.dtype)


def _expand_mask(op, mask, shape, mask_type):
    """The bool mask broadcast to the scores' ``shape`` as ``mask_type`` says."""
    if tuple(mask.shape) == tuple(shape):
        return mask
    if mask_type is None:
        raise RuntimeError(
            f"aten::{op}: Mask Type should be defined (mask {list(mask.shape)} does not match "
            f"input {list(shape)}; pass mask_type 0, 1 or 2)"
        )
    if mask_type not in (0, 1, 2):
        raise RuntimeError(
            f"aten::{op}: Mask Type should be 0 (src_mask), 1 (src_key_padding_mask), or 2 "
            f"(default_mask), got {mask_type}"
        )
    if mask_type == 1 and mask.ndim == 2 and len(shape) >= 2:
        # (B, L) key padding: masks keys (last dim) per batch row
        mask = mask.reshape((mask.shape[0],) + (1,) * (len(shape) - 2) + (mask.shape[1],))
    try:
        return jnp.broadcast_to(mask, shape)
    except ValueError:
        raise RuntimeError(
            f"aten::{op}: Mask shape should match input. mask: {list(mask.shape)} input: "
            f"{list(shape)} (mask_type={mask_type})"
        ) from None


def _softmax_where(x, masked, dim):
    """Softmax of x over ``dim`` with masked entries excluded, in opmath. A row with every
    entry masked is NaN (0/0), as ATen's CPU kernel gives."""
    s = jnp.where(masked, jnp.asarray(-jnp.inf, x.dtype), x.astype(_opmath(x.dtype)))
    e = jnp.exp(s - jnp.max(s, axis=dim, keepdims=True))
    return (e / jnp.sum(e, axis=dim, keepdims=True)).astype(x.dtype)


@lowering(aten._masked_softmax)
def _masked_softmax(self, mask, dim=None, mask_type=None):
    """aten::_masked_softmax - softmax over ``dim`` (default: last) ignoring entries where
    ``mask`` is True.

    Shapes: mask equals self's shape, or is ``(L, L)`` with mask_type 0, ``(B, L)`` with
    mask_type 1 (masks keys per batch row), or broadcastable with mask_type 2. Dtypes:
    float in and out, computed in opmath; mask must be bool. Fully masked rows are NaN,
    as in ATen's CPU kernel. Reference: aten/src/ATen/native/SoftMax.cpp."""
    if mask.dtype != jnp.bool_:
        raise RuntimeError(
            f"aten::_masked_softmax: Mask should be a boolean tensor, got {mask.dtype}"
        )
    dim = self.ndim - 1 if dim is None else dim % max(self.ndim, 1)
    masked = _expand_mask("_masked_softmax", mask, self.shape, mask_type)
    return _softmax_where(self, masked, dim)


# ---------------------------------------------------------------------------------------
# multi-head attention


def _split_heads(x, num_heads):
    """(B, T, D) -> (B, num_heads, T, D // num_heads)."""
    b, t, d = x.shape
    return x.reshape(b, t, num_heads, d // num_heads).transpose(0, 2, 1, 3)


@lowering(aten._transform_bias_rescale_qkv)
def _transform_bias_rescale_qkv(qkv, qkv_bias, num_heads):
    """aten::_transform_bias_rescale_qkv - split the packed projection ``qkv`` (B, T, 3D)
    into q, k, v of shape (B, num_heads, T, D / num_heads), adding ``qkv_bias`` and
    scaling q by ``1 / sqrt(D / num_heads)`` (computed in qkv's dtype, as ATen does)."""
    three_d = qkv.shape[2]
    if three_d % 3 or (three_d // 3) % num_heads:
        raise RuntimeError(
            f"aten::_transform_bias_rescale_qkv: expected qkv's last dim ({three_d}) to be "
            f"3 * D with D divisible by num_heads ({num_heads})"
        )
    d = three_d // 3
    qkv = qkv + qkv_bias.astype(qkv.dtype)
    q, k, v = (_split_heads(qkv[..., i * d : (i + 1) * d], num_heads) for i in range(3))
    inv_sqrt = np.asarray(1.0 / np.sqrt(np.asarray(d // num_heads, qkv.dtype)), qkv.dtype)
    return q * inv_sqrt, k, v


def _check_mha(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias):
    def check(cond, msg):
        if not cond:
            raise RuntimeError(f"aten::_native_multi_head_attention: {msg}")

    check(query.ndim == 3, f"expected 3-D `query`, got {query.ndim}-D tensor")
    check(
        query.shape[2] == embed_dim,
        f"passed-in embed_dim {embed_dim} didn't match last dim of query {query.shape[2]}",
    )
    check(key.ndim == 3, f"expected 3-D `key`, got {key.ndim}-D tensor")
    check(value.ndim == 3, f"expected 3-D `value`, got {value.ndim}-D tensor")
    check(
        query.shape == key.shape == value.shape,
        f"expected `query`/`key`/`value` shapes to match, got {list(query.shape)}, "
        f"{list(key.shape)}, {list(value.shape)}",
    )
    check(qkv_weight.ndim == 2, f"expected 2-D `qkv_weight`, got {qkv_weight.ndim}-D tensor")
    check(
        qkv_weight.shape == (3 * embed_dim, embed_dim),
        f"expected `qkv_weight` of shape {[3 * embed_dim, embed_dim]}, got {qkv_weight.shape}",
    )
    check(
        qkv_bias.shape == (3 * embed_dim,),
        f"expected `qkv_bias` of shape [{3 * embed_dim}], got {list(qkv_bias.shape)}",
    )
    check(
        embed_dim % num_head == 0,
        f"`embed_dim` ({embed_dim}) must divide evenly by `num_heads` ({num_head})",
    )


def _mha(query, key, value, num_head, params, mask, mask_type):
    """(output (B, T, D), attention probabilities (B, H, T, T)); ``params`` is
    (qkv_weight, qkv_bias, proj_weight, proj_bias)."""
    qkv_weight, qkv_bias, proj_weight, proj_bias = params
    d = query.shape[2]
    qkv = jnp.concatenate(
        [_linear(x, qkv_weight[i * d : (i + 1) * d]) for i, x in enumerate((query, key, value))],
        axis=2,
    )
    q, k, v = _transform_bias_rescale_qkv(qkv, qkv_bias, num_head)
    scores = _bmm(q, k, 3, 3)  # (B, H, T, T)
    if mask is None:
        masked = jnp.zeros((), jnp.bool_)
    else:
        masked = _expand_mask(
            "_native_multi_head_attention", _bool_mask(mask), scores.shape, mask_type
        )
    probs = _softmax_where(scores, masked, 3)
    ctx = _bmm(probs, v, 3, 2)  # (B, H, T, dh)
    b, h, t, dh = ctx.shape
    out = _linear(ctx.transpose(0, 2, 1, 3).reshape(b, t, h * dh), proj_weight, proj_bias)
    return out, probs


@lowering(aten._native_multi_head_attention)
def _native_multi_head_attention(
    query,
    key,
    value,
    embed_dim,
    num_head,
    qkv_weight,
    qkv_bias,
    proj_weight,
    proj_bias,
    mask=None,
    need_weights=True,
    average_attn_weights=True,
    mask_type=None,
):
    """aten::_native_multi_head_attention - ``nn.MultiheadAttention``'s fused inference
    path: packed in-projection, scaled dot-product attention, out-projection.

    Shapes: query/key/value (B, T, D) (batch first, equal shapes); qkv_weight (3D, D),
    qkv_bias (3D,); mask per ``mask_type`` (module docstring), non-bool masks count as
    True where nonzero. Returns (out (B, T, D), weights): weights (B, T, T) averaged over
    heads, (B, H, T, T) with ``average_attn_weights=False``, or None (undefined) when
    ``need_weights=False``. Dtypes: float; products at HIGHEST precision in opmath. Fully
    masked rows are NaN, as on CPU. Reference: attention.cpp native_multi_head_attention_cpu.
    """
    _check_mha(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias)
    if query.size == 0:
        return jnp.zeros(query.shape, query.dtype), None
    params = (qkv_weight, qkv_bias, proj_weight, proj_bias)
    out, probs = _mha(query, key, value, num_head, params, mask, mask_type)
    if not need_weights:
        return out, None
    if average_attn_weights:
        weights = jnp.sum(probs.astype(_opmath(probs.dtype)), axis=1) / num_head
        return out, weights.astype(probs.dtype)
    return out, probs


# ---------------------------------------------------------------------------------------
# encoder layer


@lowering(aten._transformer_encoder_layer_fwd)
def _transformer_encoder_layer_fwd(
    src,
    embed_dim,
    num_heads,
    qkv_weight,
    qkv_bias,
    proj_weight,
    proj_bias,
    use_gelu,
    norm_first,
    eps,
    norm_weight_1,
    norm_bias_1,
    norm_weight_2,
    norm_bias_2,
    ffn_weight_1,
    ffn_bias_1,
    ffn_weight_2,
    ffn_bias_2,
    mask=None,
    mask_type=None,
):
    """aten::_transformer_encoder_layer_fwd - ``nn.TransformerEncoderLayer``'s fused
    inference path: self-attention block and feed-forward block, each with a residual and
    LayerNorm (before the block with ``norm_first``, after it otherwise).

    Shapes: src (B, T, D) batch first; mask as for _native_multi_head_attention. FFN:
    ``linear2(act(linear1(x)))`` with act = exact GELU if ``use_gelu`` else ReLU (ATen's
    ``_addmm_activation``); no dropout (inference). Dtypes: src's; norms and products in
    opmath. Empty src returns a copy. Reference: transformer.cpp
    transformer_encoder_layer_forward."""
    if src.size == 0:
        return jnp.array(src, copy=True)

    def norm(x, w, b):
        return _layer_norm(x, (embed_dim,), w, b, eps)[0]

    def attn(x):
        _check_mha(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias)
        params = (qkv_weight, qkv_bias, proj_weight, proj_bias)
        return _mha(x, x, x, num_heads, params, mask, mask_type)[0]

    def ffn(x):
        h = _linear(x, ffn_weight_1, ffn_bias_1).astype(_opmath(x.dtype))
        h = jax.nn.gelu(h, approximate=False) if use_gelu else jnp.maximum(h, 0)
        return _linear(h.astype(x.dtype), ffn_weight_2, ffn_bias_2)

    x = src
    if norm_first:
        x = x + attn(norm(x, norm_weight_1, norm_bias_1))
        return x + ffn(norm(x, norm_weight_2, norm_bias_2))
    x = norm(x + attn(x), norm_weight_1, norm_bias_1)
    return norm(x + ffn(x), norm_weight_2, norm_bias_2)
