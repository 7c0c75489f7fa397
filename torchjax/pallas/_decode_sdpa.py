"""Decode attention on tpu tensors: the torch ops, and when SDPA takes the kernel.

``torch.ops.torchjax.decode_attention`` and ``torch.ops.torchjax.paged_decode_attention``
are the kernels of torchjax/pallas/_decode.py as PyTorch ops (forward only: decoding is
inference). :func:`decode_applies` is the shape rule by which
``F.scaled_dot_product_attention`` sends a call with at most 16 queries to the decode
kernel (Note [SDPA dispatch rule], torchjax/pallas/_sdpa.py).
"""

from __future__ import annotations

import torch

from torchjax.pallas._decode import _DTYPES as _JAX_DTYPES
from torchjax.pallas._decode import MAX_QUERY, dtype_error
from torchjax.pallas._decode import decode_attention as _decode_attention
from torchjax.pallas._decode import paged_decode_attention as _paged_decode_attention
from torchjax.pallas._op import op

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A cache longer than this must be a multiple of 128 (the TPU key block's lane step), so
# a block never has to span an unaligned cache whole.
_ALIGN_PAST = 2048


def kernel_length(n: int) -> int:
    """The shortest key length at least ``n`` that both attention kernels take (the
    decode kernel's and the flash kernel's length rules): a multiple of 16, of 128
    past ``_ALIGN_PAST``. A static cache of this length lets SDPA over it reach them."""
    step = 128 if n > _ALIGN_PAST else 16
    return -(-n // step) * step


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in tensors if isinstance(t, torch.Tensor)
    )


def decode_applies(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False):
    """Whether SDPA's call fits the decode kernel (Note [SDPA dispatch rule], decode):
    shapes, dtypes, flags and whether a gradient is needed, never data nor the switch."""
    if dropout_p != 0.0 or is_causal or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _DTYPES):
        return False
    (b, hq, sq, d), (_, hkv, sk, _) = q.shape, k.shape
    if k.shape[0] != b or k.shape[-1] != d or tuple(v.shape) != tuple(k.shape):
        return False
    if d & (d - 1) or not 16 <= d <= 256 or not 1 <= sq <= MAX_QUERY:
        return False
    if sk % 16 or (sk > _ALIGN_PAST and sk % 128):
        return False
    if hq != hkv and not (enable_gqa and hq % hkv == 0):
        return False
    if _needs_grad(q, k, v, attn_mask):
        return False
    if attn_mask is not None:
        if not 2 <= attn_mask.dim() <= 4 or attn_mask.shape[-1] != sk:
            return False
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in _DTYPES:
            return False
        shape = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
        if shape[0] not in (1, b) or shape[1] not in (1, hq) or shape[2] not in (1, sq):
            return False
    return True


@op(
    "torchjax::decode_attention",
    schema="(Tensor q, Tensor k, Tensor v, Tensor? lengths=None, Tensor? mask=None, "
    "bool causal=True, float? scale=None) -> Tensor",
    differentiable=False,
    x64=True,  # integer lengths and tables; the kernel traces in 32-bit mode itself
)
def _decode_op(q, k, v, lengths=None, mask=None, causal=True, scale=None):
    _float_qkv("decode_attention", q, k, v)
    return _decode_attention(q, k, v, lengths, mask, causal=causal, scale=scale)


@op(
    "torchjax::paged_decode_attention",
    schema="(Tensor q, Tensor k_pages, Tensor v_pages, Tensor page_table, Tensor lengths, "
    "bool causal=True, float? scale=None) -> Tensor",
    differentiable=False,
    x64=True,  # integer lengths and tables; the kernel traces in 32-bit mode itself
)
def _paged_op(q, k_pages, v_pages, page_table, lengths, causal=True, scale=None):
    _float_qkv("paged_decode_attention", q, k_pages, v_pages)
    return _paged_decode_attention(
        q, k_pages, v_pages, page_table, lengths, causal=causal, scale=scale
    )


def _float_qkv(name, *arrays):
    # As torch's SDPA refuses integer or mixed-dtype q, k, v with a RuntimeError, the ops
    # do (the jax functions raise ValueError, their module's rule); float64 would run in
    # float32.
    q, k, v = arrays
    if not (q.dtype == k.dtype == v.dtype):
        raise RuntimeError(
            f"torchjax.pallas.{name}: expected query, key, and value to have the same "
            f"dtype, but got query.dtype: {q.dtype}, key.dtype: {k.dtype} and value.dtype: "
            f"{v.dtype}; convert them to one dtype (.to(q.dtype))"
        )
    bad = next((a.dtype for a in arrays if a.dtype not in _JAX_DTYPES), None)
    if bad is not None:
        raise RuntimeError(f"torchjax.pallas.{name}: {dtype_error(bad)}")


def _no_grad(name, *tensors):
    if _needs_grad(*tensors):
        raise RuntimeError(
            f"torchjax.pallas.{name}: the decode kernel has no backward, and an input "
            "requires grad; call it under torch.no_grad() or torch.inference_mode(), or "
            "use F.scaled_dot_product_attention"
        )


def decode_attention(q, k, v, lengths=None, attn_mask=None, *, causal=True, scale=None):
    """Attention of 1-16 new tokens over a static KV cache on tpu tensors
    (``torch.ops.torchjax.decode_attention``; Note [Decode attention]).

    Args:
        q: (B, Hq, Sq, D), ``Sq <= 16``; k, v: (B, Hkv, S_max, D), Hq a multiple of Hkv.
        lengths: (B,) integer filled positions per batch row; None: all S_max.
        attn_mask: None, or bool (True = attend) / float (added) mask broadcastable to
            (B, Hq, Sq, S_max), its head dim 1 or Hq and query dim 1 or Sq.
        causal: query ``i`` sees keys before ``lengths[b] - Sq + 1 + i``.
        scale: score scale; default ``1 / sqrt(D)``.

    Returns:
        (B, Hq, Sq, D) in q's dtype. No gradient (RuntimeError if an input requires one).
    """
    _no_grad("decode_attention", q, k, v, attn_mask)
    return _decode_op(q, k, v, lengths, attn_mask, causal, scale)


def paged_decode_attention(q, k_pages, v_pages, page_table, lengths, *, causal=True, scale=None):
    """Attention of 1-16 new tokens over a paged KV cache on tpu tensors
    (``torch.ops.torchjax.paged_decode_attention``): pages (num_pages, Hkv, page_size, D),
    ``page_table`` (B, pages_per_seq) integer, ``lengths`` (B,) integer; see
    :func:`torchjax.pallas.kernels.paged_decode_attention`. No gradient."""
    _no_grad("paged_decode_attention", q, k_pages, v_pages)
    return _paged_op(q, k_pages, v_pages, page_table, lengths, causal, scale)


def decode_sdpa(query, key, value, attn_mask=None, scale=None):
    """SDPA's call (``decode_applies`` held) on the decode kernel: no lengths, the mask
    alone says what is visible, and its last attended key per row bounds the key blocks
    read (Note [Decode attention])."""
    return _decode_op(query, key, value, None, attn_mask, False, scale)
