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
path's numbers on CPU). Not yet measured on the chip: this op as SDPA routes to it
(bench row ``torch_math_tpu``) and the backward (rows ``*_fwd_bwd``).

exact_qk, generalised, is :func:`exact_attention`: the score product on the inputs
themselves, grouped heads by a reshape of q (no repeat of k and v), the scale applied to
the scores, a causal mask from iota, the softmax in float32 with fully masked rows 0 (as
``_safe_softmax``), the value product in float32 at HIGHEST. For bfloat16/float16 the
score product takes the half inputs with float32 results (a product of two half values
is exact in float32, so DEFAULT precision loses nothing) and the output is cast back
once; for float32/float64 both products run at HIGHEST on the inputs. Its gradients are
``jax.vjp`` of that function (torchjax.pallas.op, Note [Kernel op backward]); the
transposed score products then run at the forward's precision, DEFAULT for half inputs
(the float32 score cotangent rounded to the half type per pass, as a flash kernel's
backward rounds it).

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

Note [The value product in pieces]
At (4, 16/16, 2048, 128) exact_qk took 1.36x XLA's time (table above) and bf16_probs,
the same with bf16 probabilities for the value product, 1.05x: the cost is the float32
value product at HIGHEST (six bfloat16 passes on the MXU), though not in proportion to
its passes (at HIGH, three passes, 5.34 ms against 5.40: the float32 operand itself may
be what costs). For bfloat16 inputs v is exact in bfloat16, so p @ v at float32
accuracy needs only p in pieces: p1 = bf16(p), p2 = bf16(p - p1), p3 = bf16(p - p1 - p2)
hold p's 24 bits, and sum_i p_i @ v, each product of bfloat16 operands accumulated in
float32 at DEFAULT precision (exact products), is p @ v to float32 rounding in three
passes ("split3"), or with p off by at most 2**-16 of itself in two ("split2").
:data:`BF16_VALUE_PRODUCT` names the one in force (:data:`VALUE_PRODUCTS`); float16 and
float32 inputs keep HIGHEST (a float16 v is not exact in bfloat16).

The split has its own VJP: the output is bfloat16 (the op's dtype), so its cotangent g
is too, and dp = g v^T is one exact product, dv = sum_i p_i^T g in as many as the
forward. JAX's derivative of the pieces would round dp to bfloat16 (the transpose of a
product of bfloat16 operands is cast to their dtype) and differed from HIGHEST's
gradients in 31% of the elements below.

Exactness on CPU (``python bench/attention_split_exactness.py``: 12 seeds of GQA,
causal, bool and float masks, a scale, 1024 keys; 1,786,368 outputs, 9,942,528
gradient elements; bf16 elements that differ):

    value product   vs CPU torch: out   grads      vs float64 out   vs highest: out  grads
    highest                   278,405   4,240,949             319                0      0
    split3                    278,409   4,240,952             300               91    736
    split2                    278,475   4,241,057           1,907            1,839  5,347

The largest differences from CPU torch are the same for the three (0.84 bf16 eps of
the output's largest magnitude, 1.92 of each gradient's). split3 is as close to the
float64 result as highest (it differs from highest by float32 rounding: 1 output in
20,000 rounds the other way) and gives highest's bf16 outputs and gradients exactly on
every input of tests/pallas/test_sdpa_math.py; split2 rounds 6x as many outputs away
from the float64 result and changes a few elements of those tests. Speed is the chip's
to decide (bench/attention_math.py rows ``exact_split2``/``exact_split3`` and their
``*_fwd_bwd``, against ``torch_math_tpu``): until it has, "highest" stays.
"""

from __future__ import annotations

import contextvars
import functools
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
#: bfloat16 inputs' value product (Note [The value product in pieces]): "highest" is
#: p @ v in float32 at HIGHEST; "split2"/"split3" sum p's 2/3 bfloat16 pieces times v.
BF16_VALUE_PRODUCT = "highest"
VALUE_PRODUCTS = {"highest": 0, "split2": 2, "split3": 3}  # name -> pieces of p


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


def exact_attention(q, k, v, mask=None, causal=False, scale=None, value_product=None):
    """softmax(q k^T * scale + mask) v without dropout (Note [SDPA math by platform]).

    Args:
        q: (..., Hq, L, E); k: (..., Hkv, S, E); v: (..., Hkv, S, Ev), one float dtype,
            the same leading dims; Hq a multiple of Hkv (grouped query heads). 2-D inputs
            (L, E) have no heads.
        mask: None, or bool (True attends) / additive float of q's dtype, broadcasting to
            (..., Hq, L, S).
        causal: attend to key j from query i where j <= i (top-left aligned, as torch).
        scale: the scores' factor; default 1 / sqrt(E).
        value_product: for bfloat16 inputs, one of :data:`VALUE_PRODUCTS` (default
            :data:`BF16_VALUE_PRODUCT`; Note [The value product in pieces]); other
            dtypes take "highest" only.

    Returns:
        (..., Hq, L, Ev) in q's dtype; 0 on rows where every key is masked.
    """
    if q.ndim == 2:
        out = exact_attention(q[None], k[None], v[None], mask, causal, scale, value_product)
        return out[0]
    pieces = _value_pieces(value_product, q.dtype)
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
    if pieces:
        out = _split_product(p, v, pieces)
    else:
        out = jnp.einsum("...hgls,...hse->...hgle", p, v.astype(acc), precision=_HIGHEST)
    return out.reshape(*batch, heads, length, v.shape[-1]).astype(q.dtype)


def _value_pieces(value_product, dtype) -> int:
    """How many bfloat16 pieces of p the value product takes; 0 for one product at HIGHEST."""
    if value_product is None:
        value_product = BF16_VALUE_PRODUCT if dtype == jnp.bfloat16 else "highest"
    if value_product not in VALUE_PRODUCTS:
        raise ValueError(
            f"exact_attention: value_product must be one of {tuple(VALUE_PRODUCTS)}, "
            f"got {value_product!r}"
        )
    if VALUE_PRODUCTS[value_product] and dtype != jnp.bfloat16:
        raise ValueError(
            f"exact_attention: value_product={value_product!r} needs bfloat16 inputs (v "
            f"must be exact in bfloat16), got {jnp.dtype(dtype).name}; use 'highest'"
        )
    return VALUE_PRODUCTS[value_product]


def _pieces(p, n: int):
    """p (float32) as ``n`` bfloat16 pieces, each the rounding of what the others left."""
    out, rest = [], p
    for i in range(n):
        out.append(rest.astype(jnp.bfloat16))
        if i + 1 < n:
            rest = rest - out[-1].astype(p.dtype)
    return out


def _products(pieces, v, spec: str):
    """The sum of the bfloat16 products ``einsum(spec, piece, v)``, accumulated in float32."""
    terms = [jnp.einsum(spec, a, v, preferred_element_type=jnp.float32) for a in pieces]
    return functools.reduce(jnp.add, terms)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _split_product(p, v, n: int):
    """p @ v for float32 p (..., Hkv, G, L, S) and bfloat16 v (..., Hkv, S, Ev), as the
    sum of ``n`` bfloat16 products (Note [The value product in pieces]); bfloat16 out."""
    return _products(_pieces(p, n), v, "...hgls,...hse->...hgle").astype(v.dtype)


def _split_fwd(p, v, n):
    return _split_product(p, v, n), (p, v)


def _split_bwd(n, saved, g):
    # g is bfloat16, as the output: dp = g v^T is one exact product, dv sums n of them.
    p, v = saved
    dp = jnp.einsum("...hgle,...hse->...hgls", g, v, preferred_element_type=jnp.float32)
    dv = _products(_pieces(p, n), g, "...hgls,...hgle->...hse")
    return dp, dv.astype(v.dtype)


_split_product.defvjp(_split_fwd, _split_bwd)


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
