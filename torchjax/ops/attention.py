"""Attention: what ``F.scaled_dot_product_attention`` needs on a tpu tensor.

How SDPA reaches us (torch 2.13): ``aten::scaled_dot_product_attention`` is
CompositeImplicitAutograd. Its backend choice (``_fused_sdp_choice_stub``) has no
PrivateUse1 kernel unless one is registered from C++, so for a tpu tensor it always takes
the math path, ``_scaled_dot_product_attention_math`` (also CompositeImplicit), above the
dispatcher. We therefore see its pieces: ``mul`` (q and k each scaled by sqrt(scale)),
``bmm``/``mm`` through ``matmul``, the mask as ``add`` (boolean masks first turned into
0 / -inf), ``_safe_softmax`` when a mask is given (``_softmax`` otherwise),
``native_dropout`` for ``dropout_p``, ``repeat_interleave`` for ``enable_gqa``, and
autograd differentiates those. Causal masks arrive as ``tril`` of ``ones`` plus
``masked_fill``.

Fully masked rows (a boolean mask that is all False in a row, e.g. left padding): CPU
torch returns zeros there, and so does ``_safe_softmax`` (the math path's softmax for
masked attention), so the result is finite and equal to CPU, not NaN.

What CPU's choice between its flash kernel and the math path refuses, which the math path
alone would not, is refused first (torchjax/ops/attention_checks.py, Note [CPU's SDPA
kernel choice]).
"""

from __future__ import annotations

import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax._compat.jax import constant_value, trace_state_clean, x64_enter, x64_exit
from torchjax._compat.torch_checkpoint import checkpoint_region
from torchjax.ops.attention_checks import cpu_flash_selected, math_scale
from torchjax.ops.norm import _check_dim, _opmath
from torchjax.ops.registry import functional_handler, lowering
from torchjax.tensor._fake import is_fake
from torchjax.tensor._tensor import JaxTensor, wrap
from torchjax.tensor.dtypes import to_jax_dtype

aten = torch.ops.aten


@lowering(aten._safe_softmax)
def _safe_softmax(self, dim, dtype=None):
    """aten::_safe_softmax - softmax along ``dim``, but 0 (not NaN) on a slice whose
    inputs are all -inf (a fully masked attention row).

    Dtypes: input cast to ``dtype`` first when given; f16/bf16 computed in float32.
    Reference: torch/_decomp/decompositions.py (safe_softmax)."""
    out_dtype = self.dtype if dtype is None else to_jax_dtype(dtype)
    dim = _check_dim("_safe_softmax", self, dim)
    x = self.astype(out_dtype).reshape(self.shape or (1,))
    x = x.astype(_opmath(out_dtype))
    masked = jnp.all(x == -jnp.inf, axis=dim, keepdims=True)
    out = jnp.where(masked, jnp.zeros((), x.dtype), jax.nn.softmax(x, axis=dim))
    return out.reshape(self.shape).astype(out_dtype)


def sdpa_math(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """aten::scaled_dot_product_attention without dropout, as one computation (the math
    path's numbers, fused): softmax(q k^T * scale + mask) v.

    Shapes: q (..., Hq, L, E), k (..., Hkv, S, E), v (..., Hkv, S, Ev) -> (..., Hq, L, Ev);
    leading dims broadcast; with ``enable_gqa`` k and v heads repeat Hq // Hkv times
    (``repeat_interleave``). ``attn_mask``: bool (True = attend) or additive float,
    broadcast to (..., L, S); ``is_causal``: the lower-triangular bool mask. Dtypes: one
    float dtype for q, k, v (Note [Fused SDPA in eager] says which calls come here).
    As torch's math path (``_scaled_dot_product_attention_math``), q and k are each
    scaled by sqrt(scale), and a masked softmax row that is all -inf gives zeros
    (``_safe_softmax``). Products use ``Precision.HIGHEST``. Reference:
    torch.nn.functional.scaled_dot_product_attention.
    """
    length, source = query.shape[-2], key.shape[-2]
    scale = math_scale(scale, query.shape[-1])
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        reps = query.shape[-3] // key.shape[-3]
        key, value = jnp.repeat(key, reps, axis=-3), jnp.repeat(value, reps, axis=-3)
    # A negative scale: q by -sqrt(|scale|), k by sqrt(|scale|), as the math path.
    root = jnp.asarray(math.sqrt(abs(scale)), query.dtype)
    q_root = -root if scale < 0 else root
    scores = jnp.matmul(query * q_root, jnp.swapaxes(key * root, -1, -2), precision=_HIGHEST)
    if is_causal:
        attn_mask = jnp.tril(jnp.ones((length, source), jnp.bool_))
    if attn_mask is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        if attn_mask.dtype == jnp.bool_:
            attn_mask = jnp.where(attn_mask, jnp.zeros((), scores.dtype), -jnp.inf)
        scores = scores + attn_mask
        dead = jnp.all(scores == -jnp.inf, axis=-1, keepdims=True)
        probs = jnp.where(dead, jnp.zeros((), scores.dtype), jax.nn.softmax(scores, axis=-1))
    return jnp.matmul(probs, value, precision=_HIGHEST)


_HIGHEST = jax.lax.Precision.HIGHEST
_SDPA_MATH = functional_handler(
    aten.scaled_dot_product_attention.default, sdpa_math, deterministic=True
)
_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)


def sdpa_decomposed(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """aten::scaled_dot_product_attention without dropout for bfloat16 and float16:
    torch's math decomposition run on the arrays, so that one executable computes what
    the op-by-op decomposition computes, rounding to the half type where it rounds (Note
    [Fused SDPA in eager]). Shapes, masks and GQA as ``sdpa_math``."""
    q, k, v = wrap(query), wrap(key), wrap(value)
    mask = None if attn_mask is None else wrap(attn_mask)
    out = aten.scaled_dot_product_attention.default.decompose(
        q, k, v, mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return out._value()


_SDPA_DECOMPOSED = functional_handler(
    aten.scaled_dot_product_attention.default, sdpa_decomposed, deterministic=True
)


# Note [Fused SDPA in eager]
# Through the decomposition, one SDPA call is a dozen ATen ops (two scalings, bmm twice,
# the mask conversion, _safe_softmax, views, a clone), each its own XLA dispatch in
# eager. When nothing needs a gradient (inference, torch.no_grad) and there is no
# dropout, the same math runs as one compiled lowering: ``sdpa_math`` in float32/64;
# in bfloat16 and float16 ``sdpa_decomposed``, the decomposition itself traced into one
# executable (torch's math path computes half inputs in float32 and rounds once at the
# end), so the rounding to the half type happens where the op-by-op path rounds. The
# float32 intermediates are XLA's, not always bit for bit the op-by-op ones: in one
# program XLA:CPU folds the transpose of the keys into the q.k^T product and runs that
# dot on the untransposed layout, a different summation order (a (2, 7, 128) x
# (2, 128, 300) float32 product differed in the last bit in 3,537 of 4,200 elements).
# After the rounding to the half type that leaves about 1 element in 10,000 (float16) or
# 70,000 (bfloat16) one unit apart from the op-by-op result, on sequences of 37 keys
# and more; the shorter cases of tests/ops/test_attention.py are bit for bit equal.
# Calls needing autograd, dropout, fake tensors (torch.compile tracing), or unusual
# arguments (mixed dtypes; a mask together with is_causal where CPU's flash kernel would
# not take the call, see ``causal_into_mask``: torch raises there; shapes ``shapes_fit``
# refuses: head counts, head dims or lengths that do not match, where jax's matmul raised
# ValueError or TypeError) keep the decomposition, which raises torch's errors.
def fused_sdpa_applies(
    query, key, value, attn_mask, dropout_p, is_causal, enable_gqa=False
) -> bool:
    tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    if dropout_p != 0.0 or (is_causal and attn_mask is not None):
        return False
    if not all(type(t) is JaxTensor and not is_fake(t) for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    dt = query.dtype
    if dt not in _FUSED_DTYPES or key.dtype != dt or value.dtype != dt:
        return False
    if min(query.dim(), key.dim(), value.dim()) < 2:
        return False
    if dt in _HALF and key.shape[-2] == 0:
        return False  # traced, an empty sum came out -0.0 where op by op gives +0.0
    if not shapes_fit(query, key, value, attn_mask, enable_gqa):
        return False
    return attn_mask is None or attn_mask.dtype in (torch.bool, dt)


def shapes_fit(query, key, value, attn_mask, enable_gqa) -> bool:
    """Whether ``sdpa_math`` takes these shapes as the math path does: q, k, v of one
    rank, one batch shape, k and v of one length and head count, q and k of one head dim,
    q's heads equal to k's (a multiple of them with ``enable_gqa``), a mask broadcasting
    to the scores' shape without growing it."""
    q, k, v = query.shape, key.shape, value.shape
    if not len(q) == len(k) == len(v):
        return False
    if q[-1] != k[-1] or k[-2] != v[-2] or q[:-3] != k[:-3] or k[:-3] != v[:-3]:
        return False
    if len(q) < 3:
        if enable_gqa:
            return False  # the math path refuses to find a heads dim (IndexError)
    else:
        heads, kv_heads = q[-3], k[-3]
        if v[-3] != kv_heads:
            return False
        if heads != kv_heads and not (enable_gqa and kv_heads and heads % kv_heads == 0):
            return False
    if attn_mask is None:
        return True
    scores = (*q[:-1], k[-2])
    m = attn_mask.shape
    return len(m) <= len(scores) and all(a in (1, b) for a, b in zip(m[::-1], scores[::-1]))


# Note [Masks known at trace time]
# Under torch.compile, transformers cannot tell that a model's own position ids are not
# packed sequences (that reads values, which Dynamo cannot), so it builds the causal mask
# as a (B, 1, L, S) tensor from position comparisons and passes it to SDPA, where eager
# and torchjax.jit pass ``is_causal=True``. The flash kernel then reads the mask and
# computes every block, the masked half too (on the chip: a 1.1B Llama's train step
# spent 343 ms per step in attention against 193 ms with ``is_causal``). Inside a trace
# the mask is a traced value, but one the program computes from constants alone, so its
# value is known while tracing. SDPA evaluates such a mask (the equations that make it,
# as one small program: ``_compat.jax.constant_value``; a mask whose ops were evaluated
# while tracing is a concrete value already, Note [Values made from constants inside a
# trace] in torchjax/ops/executables.py) and, when it is exactly torch's
# causal mask (True on and below the diagonal of every (L, S) slice; a float mask 0
# there and -inf above), calls the kernels with ``is_causal=True`` and no mask; a mask
# that masks nothing becomes None. Both are the same computation: the same scores
# masked the same way. A mask that reads an argument of the program (the batch's
# padding mask) is not evaluated, nor one over ``KNOWN_MASK_ELEMENTS``, nor any mask
# outside a trace (eager would pay a host read per call). Each mask tensor is checked
# once (trace time only), however many layers share it, and keeps its verdict while its
# value does. A region of torch.utils.checkpoint (non-reentrant) is recomputed in the
# backward's trace, where the same mask is an argument, its value unknown: deciding
# there again took the masked kernel where the forward took the causal one, and that
# saves other tensors (torch's checkpoint refused the difference; seen with
# torch.compile of a checkpointed Llama on the chip). So the forward of a region
# records each decision on the region's checkpoint frame, and its recomputation replays
# them in order: the same calls, with the same values, take the same kernels.
KNOWN_MASK_ELEMENTS = 1 << 26
# A mask tensor's verdict, kept with its storage and the storage's version: reused
# while the tensor's value is unchanged.
_VERDICTS: dict = {}  # id(mask) -> (weak reference to it, storage, version, verdict)
# checkpoint frame -> (the forward's verdicts in call order, {group: next to replay})
_REGIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def known_mask(query, key, attn_mask, is_causal):
    """``(attn_mask, is_causal)``, with a traced mask of known value that is exactly
    causal turned into ``(None, True)`` and one that masks nothing into ``(None,
    is_causal)`` (Note [Masks known at trace time])."""
    if attn_mask is None or is_causal or not isinstance(attn_mask, JaxTensor):
        return attn_mask, is_causal
    if is_fake(attn_mask) or attn_mask.requires_grad:
        return attn_mask, is_causal
    region = checkpoint_region()
    if region is None:
        return _apply(_decide(query, key, attn_mask), attn_mask, is_causal)
    frame, recomputing, group = region
    verdicts, replayed = _REGIONS.setdefault(frame, ([], {}))
    if not recomputing:
        verdicts.append(_decide(query, key, attn_mask))
        return _apply(verdicts[-1], attn_mask, is_causal)
    at = replayed.get(group, 0)
    replayed[group] = at + 1
    return _apply(verdicts[at] if at < len(verdicts) else "mask", attn_mask, is_causal)


def _apply(verdict: str, attn_mask, is_causal):
    if verdict == "causal":
        return None, True
    if verdict == "all":
        return None, is_causal
    return attn_mask, is_causal


def _decide(query, key, attn_mask) -> str:
    """The verdict on ``attn_mask``: cached per tensor while its value is unchanged."""
    storage = attn_mask._storage
    seen = _VERDICTS.get(id(attn_mask))
    if seen is not None and seen[0]() is attn_mask and seen[1:3] == (storage, storage.version):
        return seen[3]
    arr = attn_mask._value()
    if arr.size > KNOWN_MASK_ELEMENTS:
        return "mask"
    if isinstance(arr, jax.core.Tracer):
        value = constant_value(arr)
    elif trace_state_clean():
        return "mask"  # eager: a host read per call
    else:
        # Made from constants and read while tracing: known already (Note [Values made
        # from constants inside a trace] in torchjax/ops/executables.py).
        value = arr
    verdict = _verdict(value, query.size(-2), key.size(-2))
    key_id = id(attn_mask)
    ref = weakref.ref(attn_mask, lambda _: _VERDICTS.pop(key_id, None))
    _VERDICTS[key_id] = (ref, storage, storage.version, verdict)
    return verdict


def _verdict(value, length: int, source: int) -> str:
    """ "causal", "all" (masks nothing) or "mask" for a mask's known ``value`` (None:
    not known) read at (..., L, S)."""
    if value is None:
        return "mask"
    host = np.asarray(value)
    if host.dtype == np.bool_:
        attend = host
    elif jnp.issubdtype(host.dtype, jnp.floating):  # bfloat16 too
        if not np.all((host == 0) | (host == -np.inf)):
            return "mask"
        attend = host == 0
    else:
        return "mask"
    attend = np.broadcast_to(attend, attend.shape[:-2] + (length, source))
    if attend.all():
        return "all"
    if (attend == np.tri(length, source, dtype=bool)).all():
        return "causal"
    return "mask"


def causal_into_mask(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa=False):
    """``(attn_mask, is_causal)`` with a causal flag folded into an explicit mask where
    CPU's default SDPA kernel (flash attention for CPU) takes the call and applies both:
    a bool mask ANDed with the lower triangle, a float mask -inf above it. Elsewhere CPU
    runs the math path, which refuses the pair, and so does our decomposition."""
    if attn_mask is None or not is_causal:
        return attn_mask, is_causal
    if not cpu_flash_selected(query, key, value, attn_mask, dropout_p, enable_gqa):
        return attn_mask, is_causal
    causal = torch.ones(
        query.size(-2), key.size(-2), dtype=torch.bool, device=attn_mask.device
    ).tril()
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal, False
    return attn_mask.masked_fill(~causal, float("-inf")), False


def fused_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """SDPA as one compiled lowering (Note [Fused SDPA in eager]); the caller checked
    ``fused_sdpa_applies``. Called from SDPA's Autograd kernel, above the Python dispatch
    key, so it enters x64 as ``JaxTensor.__torch_dispatch__`` does for every op."""
    token = x64_enter()
    fused = _SDPA_DECOMPOSED if query.dtype in _HALF else _SDPA_MATH
    try:
        args = (query, key, value, attn_mask, dropout_p, is_causal)
        return fused(args, {"scale": scale, "enable_gqa": enable_gqa})
    finally:
        x64_exit(token)
