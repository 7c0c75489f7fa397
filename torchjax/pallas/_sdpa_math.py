"""SDPA's math fallback as one differentiable op, chosen by platform.

``torch.ops.torchjax.exact_attention`` computes ``softmax(q k^T * scale + mask) v``
(no dropout) in the formulation XLA:TPU lays out well; :data:`MATH_BY_PLATFORM` says
on which platform SDPA's math fallback takes it instead of torch's decomposition
(Note [SDPA math by platform]).

Note [SDPA math by platform]
Where neither the flash nor the decode kernel takes an SDPA call (the switch is off, or
shapes, masks or dropout they refuse), torchjax used to run torch's math decomposition
(``_scaled_dot_product_attention_math`` op by op: q and k each scaled by sqrt(scale),
``repeat_interleave`` of k and v for GQA, the mask added, ``_safe_softmax``, a second
``matmul``), or in eager without grad the fused math of torchjax/ops/attention.py (Note
[Fused SDPA in eager]), which is the same computation in one program. On the chip that
formulation is slow: XLA:TPU keeps the float32 scores (B, H, L, S) in a {1,2,0} layout
and reduces the softmax over a major dimension. Measured on a TPU v5e for the
formulations alone (bench/attention_math.py; bf16 q, k, v, causal, forward, jitted), ms:

    formulation                                   (1,16/2,8192,128) GQA  (4,16/16,2048,128)
    torch_math (the decomposition, jitted)                465                  9.4
    f32 upcast, products at HIGHEST (sdpa_math)           465                 11.0
    exact_qk (below)                                      20.4                 5.4
    bf16_probs (exact_qk, probs rounded to bf16)          452                  4.2
    jax.nn.dot_product_attention (XLA)                    19.4                 4.0

exact_qk's output was within 0.25-0.5 bf16 eps of the float32-HIGHEST result (the math
path's numbers on CPU). exact_qk's backward is in Note [The value product stays
float32]; not yet recorded from the chip: this op as SDPA routes to it (bench row
``torch_math_tpu``).

exact_qk, generalised, is :func:`exact_attention`: the score product on the inputs
themselves, grouped heads by a reshape of q (no repeat of k and v), the scale applied to
the scores, a causal mask from iota, the softmax in float32 with fully masked rows 0 (as
``_safe_softmax``), the value product in float32 at HIGHEST (Note [The value product
stays float32]). For bfloat16/float16 the score product takes the half inputs with
float32 results (a product of two half values is exact in float32, so DEFAULT precision
loses nothing) and the output is cast back once; for float32/float64 both products run
at HIGHEST on the inputs. Its gradients are ``jax.vjp`` of that function
(torchjax.pallas.op, Note [Kernel op backward]); the transposed score products then run
at the forward's precision, DEFAULT for half inputs (the float32 score cotangent rounded
to the half type per pass, as a flash kernel's backward rounds it).

Numbers differ from torch's decomposition by rounding only (scale applied after the
product rather than sqrt(scale) to each side; half inputs kept in float32 until the
output), so on CPU, where tests compare compiled programs with eager bit for bit, the
decomposition stays. The choice is a table by jax's default backend, read when SDPA is
called (traced), overridable for tests by :class:`use_math_attention` or
``$TORCHJAX_SDPA_MATH`` ("exact" or "decompose"). Where the entry is "exact", the op
takes every call the kernels leave with dropout 0 that :func:`exact_applies` accepts:
eager (with or without grad, ahead of the fused eager math), ``torchjax.jit`` and
``torch.compile``. A mask that requires grad, mixed dtypes, shapes the math path would
broadcast or refuse, empty sequences, and dropout keep the decomposition (and its errors).

Note [The value product stays float32]
At (4, 16/16, 2048, 128) exact_qk takes 1.36x XLA's time (5.43 ms against 4.00, below),
against a 1.2x target. For bfloat16 inputs v is exact in bfloat16, so p @ v to float32
rounding can be had as the sum of p's 3 bfloat16 pieces times v ("split3"; 2 pieces,
"split2", leave p off by 2**-16 of itself), each a product of bfloat16 operands
accumulated in float32 (with its own VJP), instead of one float32 product at HIGHEST
(six bfloat16 passes). On CPU split3 gave HIGHEST's bf16 outputs and gradients on every
test input. The chip decided against it (TPU v5e, jax 0.10.2, bench/attention_math.py;
bf16, causal; ms, forward / forward and backward):

    formulation                       (4,16/16,2048,128)   (1,16/2,8192,128) GQA
    exact_qk (p @ v at HIGHEST)         5.43 / 14.77           20.32 / 60.91
    exact_qk_high (at HIGH, 3 passes)   5.43
    split2                              6.81 / 16.32           27.07 / 69.67
    split3                              8.70 / 18.16           34.05 / 76.46
    bf16_probs (p rounded to bf16)      4.18
    xla (jax.nn.dot_product_attention)  4.00                   19.29

The pieces were 1.25-1.6x slower forward and 1.1-1.2x forward and backward, and HIGH is
no faster than HIGHEST: matmul passes are not what bounds this formulation. The likely
bound is HBM traffic of the float32 probabilities: at (4, 16, 2048, 2048) p is 1.07 GB,
about 2.6 ms to write and read at the v5e's 819 GB/s against about 1.3 ms for XLA's
bfloat16 probabilities. bf16_probs closes that gap, but 2 bf16 eps off the float32
result (CPU's values): exactness with CPU torch's bf16 math needs float32 probabilities.
So the fallback keeps p @ v in float32 at HIGHEST, and the pieces were removed; closing
the rest of the gap means not materialising p at all, which is the flash kernel's job.
"""

from __future__ import annotations

import contextvars
import os

import jax
import jax.numpy as jnp
import torch

from torchjax.ops.attention import shapes_fit
from torchjax.ops.attention_checks import math_scale
from torchjax.pallas._op import op

ENV_VAR = "TORCHJAX_SDPA_MATH"
#: SDPA's math fallback by jax's default backend (Note [SDPA math by platform]):
#: "exact" is torch.ops.torchjax.exact_attention, "decompose" torch's decomposition.
MATH_BY_PLATFORM = {
    "tpu": "exact",
    "cpu": "decompose",  # compiled programs equal eager bit for bit
    "gpu": "decompose",  # not measured there
    "cuda": "decompose",
    "rocm": "decompose",
}
_CHOICES = ("exact", "decompose")
_SWITCH: contextvars.ContextVar = contextvars.ContextVar("torchjax_sdpa_math", default=None)
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HALF = (jnp.bfloat16, jnp.float16)
_HIGHEST = jax.lax.Precision.HIGHEST


class ContextSwitch:
    """A setting of the current thread/context held in the class's ``var``: set when
    made, and as a context manager the previous setting comes back on exit."""

    var: contextvars.ContextVar

    def __init__(self, value):
        self._token = self.var.set(value)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.var.reset(self._token)


class use_math_attention(ContextSwitch):
    """Choose SDPA's math fallback: ``"exact"`` (``torch.ops.torchjax.exact_attention``),
    ``"decompose"`` (torch's decomposition), or ``None`` (the environment variable, then
    :data:`MATH_BY_PLATFORM`); Note [SDPA math by platform]. Takes effect at once for the
    current context; as a context manager the previous choice comes back on exit."""

    var = _SWITCH

    def __init__(self, choice: str | None = "exact"):
        if choice is not None and choice not in _CHOICES:
            raise ValueError(
                f"use_math_attention: expected one of {_CHOICES} or None, got {choice!r}"
            )
        super().__init__(choice)


def math_choice() -> str:
    """The math fallback in force: context, then ``$TORCHJAX_SDPA_MATH``, then the table."""
    value = _SWITCH.get()
    if value is not None:
        return value
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env in _CHOICES:
        return env
    return MATH_BY_PLATFORM.get(jax.default_backend(), "decompose")


def exact_applies(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False):
    """Whether :func:`exact_attention` takes this SDPA call (Note [SDPA math by platform]):
    shapes, dtypes and flags only, not the platform choice."""
    if dropout_p != 0.0 or (is_causal and attn_mask is not None):
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _DTYPES):
        return False
    if min(q.dim(), k.dim(), v.dim()) < 2 or k.shape[-2] == 0 or q.shape[-1] == 0:
        return False
    if not shapes_fit(q, k, v, attn_mask, enable_gqa):
        return False
    if attn_mask is not None:
        if attn_mask.requires_grad or attn_mask.dtype not in (torch.bool, q.dtype):
            return False
    return True


def exact_attention(q, k, v, mask=None, causal=False, scale=None):
    """softmax(q k^T * scale + mask) v without dropout (Note [SDPA math by platform]).

    Args:
        q: (..., Hq, L, E); k: (..., Hkv, S, E); v: (..., Hkv, S, Ev), one float dtype,
            the same leading dims; Hq a multiple of Hkv (grouped query heads). 2-D inputs
            (L, E) have no heads.
        mask: None, or bool (True attends) / additive float of q's dtype, broadcasting to
            (..., Hq, L, S).
        causal: attend to key j from query i where j <= i (top-left aligned, as torch).
        scale: the scores' factor; default 1 / sqrt(E).

    Returns:
        (..., Hq, L, Ev) in q's dtype; 0 on rows where every key is masked.
    """
    if q.ndim == 2:
        out = exact_attention(q[None], k[None], v[None], mask, causal, scale)
        return out[0]
    scale = math_scale(scale, q.shape[-1])
    acc = jnp.float32 if q.dtype in _HALF else q.dtype
    qk_precision = None if q.dtype in _HALF else _HIGHEST  # half products are exact
    *batch, heads, length, dim = q.shape
    kv_heads, source = k.shape[-3], k.shape[-2]
    group = heads // kv_heads
    grouped = q.reshape(*batch, kv_heads, group, length, dim)
    s = jnp.einsum(
        "...hgle,...hse->...hgls", grouped, k,
        precision=qk_precision, preferred_element_type=acc,
    )  # fmt: skip
    s = s * jnp.asarray(scale, acc)
    if causal:
        rows = jax.lax.broadcasted_iota(jnp.int32, (length, source), 0)
        cols = jax.lax.broadcasted_iota(jnp.int32, (length, source), 1)
        s = jnp.where(cols <= rows, s, -jnp.inf)
    if mask is not None:
        m = _grouped(mask, q.ndim, kv_heads, group)
        s = jnp.where(m, s, -jnp.inf) if m.dtype == jnp.bool_ else s + m.astype(acc)
    p = _softmax_or_zero(s)
    out = jnp.einsum("...hgls,...hse->...hgle", p, v.astype(acc), precision=_HIGHEST)
    return out.reshape(*batch, heads, length, v.shape[-1]).astype(q.dtype)


def _grouped(mask, rank: int, kv_heads: int, group: int):
    """``mask`` at rank ``rank`` (..., H or 1, L or 1, S or 1) with its heads split as
    q's: (..., Hkv, G, L, S), or (..., 1, 1, L, S) for a mask shared by the heads."""
    mask = mask.reshape((1,) * (rank - mask.ndim) + mask.shape)
    *batch, heads, length, source = mask.shape
    split = (1, 1) if heads == 1 else (kv_heads, group)
    return mask.reshape(*batch, *split, length, source)


def _softmax_or_zero(s):
    """Softmax over the last axis, 0 on a row that is all -inf (``_safe_softmax``), with
    finite gradients there (a select after ``jax.nn.softmax`` would pull NaN back)."""
    top = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    dead = top == -jnp.inf
    e = jnp.exp(s - jnp.where(dead, jnp.zeros((), s.dtype), top))
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(dead, jnp.ones((), s.dtype), total)


@op(
    "torchjax::exact_attention",
    schema="(Tensor q, Tensor k, Tensor v, Tensor? mask=None, bool causal=False, "
    "float? scale=None) -> Tensor",
    x64=True,  # float64 inputs stay float64, as the math path computes them
)
def _exact_op(q, k, v, mask=None, causal=False, scale=None):
    return exact_attention(q, k, v, mask, causal, scale)


def exact_sdpa(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """:func:`exact_attention` on tpu tensors, as ``torch.ops.torchjax.exact_attention``
    (differentiable in q, k, v); the caller checked :func:`exact_applies`."""
    return _exact_op(query, key, value, attn_mask, is_causal, scale)
