"""Flash attention: portable Pallas forward and backward kernels, and a jnp reference.

Forward (Pallas): grid ``(batch, q_heads, Sq // block_q)``; each program holds one block
of queries and walks the keys/values of its kv head block by block with the online
softmax (running max ``m``, running sum ``l``, f32 accumulator), so the (Sq, Sk) score
matrix is never materialised; it also writes the log-sum-exp per query row. Causal
programs stop at the diagonal block.

Backward (Pallas, ``jax.custom_vjp``; the FlashAttention-2 split): ``delta = sum(dO * O)``
per row in jnp, then two kernels that rebuild each tile's probabilities from the saved
log-sum-exp: ``dq`` with grid ``(batch, q_heads, Sq // block_q)`` walking key blocks,
and ``dk``/``dv`` with grid ``(batch, kv_heads, Sk // block_k)`` walking the query blocks
of every query head of its group (GQA gradients summed in-kernel, no atomics). Causal
programs skip the tiles past the diagonal.

The kernels use only BlockSpecs, ``pl.ds`` slices and ``fori_loop``: the same code runs
in interpret mode on CPU (tested against the reference) and lowers to Triton for GPU
and to Mosaic for TPU (tested by cross-platform lowering, tests/pallas/test_lowering.py;
never compiled or run on a GPU/TPU here). Per-row statistics (log-sum-exp, ``delta``)
are (S, 1) columns so every block meets Mosaic's rule (last two block dims divisible by
(8, 128) or equal to the array's). The jax-shipped kernels are not
used because each is tied to one platform: ``jax.experimental.pallas.ops.tpu.
flash_attention`` needs TPU scratch memory and ``PrefetchScalarGridSpec``,
``ops.gpu.attention`` Triton, and neither takes an arbitrary additive mask with GQA.

Semantics match ``F.scaled_dot_product_attention`` (dropout 0): ``is_causal`` is the
top-left aligned lower triangle (key j visible to query i iff j <= i); a boolean mask
keeps True positions; a float mask is added to the scores; a row with every key masked
gives zeros (as CPU torch and the math path's ``_safe_softmax``), not NaN. GQA/MQA:
query head h reads kv head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from torchjax.pallas._op import compiler_params

_F32 = jnp.float32


def _dot(a, b, trans_b=False):
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=_F32)


def _fwd_kernel(*refs, scale, causal, block_q, block_k, seq_k, has_mask):
    if has_mask:
        q_ref, k_ref, v_ref, mask_ref, o_ref, lse_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    i = pl.program_id(2)
    q = q_ref[...]
    n_blocks = seq_k // block_k
    if causal:
        # Blocks right of the diagonal are fully masked: skip them.
        n_blocks = jnp.minimum(n_blocks, ((i + 1) * block_q + block_k - 1) // block_k)

    def body(j, carry):
        m, denom, acc = carry
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s = _dot(q, k, trans_b=True) * scale
        if has_mask:
            s = s + mask_ref[:, pl.ds(start, block_k)].astype(_F32)
        if causal:
            rows = i * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
            cols = start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
            s = jnp.where(cols <= rows, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        # A row masked so far has m == -inf: shift by 0 instead (exp(-inf) = 0, no NaN).
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - shift[:, None])
        alpha = jnp.exp(m - shift)
        denom = alpha * denom + p.sum(axis=1)
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
        return m_new, denom, acc

    m0 = jnp.full((block_q,), -jnp.inf, _F32)
    denom0 = jnp.zeros((block_q,), _F32)
    acc0 = jnp.zeros((block_q, v_ref.shape[-1]), _F32)
    m, denom, acc = lax.fori_loop(0, n_blocks, body, (m0, denom0, acc0))
    empty = denom == 0.0  # every key masked: output 0, as torch
    o_ref[...] = (acc / jnp.where(empty, 1.0, denom)[:, None]).astype(o_ref.dtype)
    lse = jnp.where(empty, 0.0, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(denom))
    lse_ref[...] = lse[:, None]


def _check(q, k, v, mask, block_q, block_k):
    b, hq, sq, d = q.shape
    _, hkv, sk, _ = k.shape
    if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[-1] != d or hq % hkv:
        raise ValueError(
            "torchjax.pallas.flash_attention: expected q (B, Hq, Sq, D), k (B, Hkv, Sk, D), "
            f"v (B, Hkv, Sk, Dv) with Hq a multiple of Hkv, got {q.shape}, {k.shape}, {v.shape}"
        )
    if sq % block_q or sk % block_k:
        raise ValueError(
            f"torchjax.pallas.flash_attention: Sq={sq} and Sk={sk} must be multiples of "
            f"block_q={block_q} and block_k={block_k}; pass smaller blocks"
        )
    if mask is not None and (mask.ndim != 4 or mask.shape[2:] != (sq, sk)):
        raise ValueError(
            "torchjax.pallas.flash_attention: mask must be (B or 1, Hq or 1, Sq, Sk) = "
            f"(.., .., {sq}, {sk}), got {mask.shape}"
        )


def _forward(q, k, v, mask, causal, scale, block_q, block_k, interpret):
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = hq // hkv
    in_specs = [
        pl.BlockSpec((None, None, block_q, d), lambda b_, h, i: (b_, h, i, 0)),
        pl.BlockSpec((None, None, sk, d), lambda b_, h, i: (b_, h // group, 0, 0)),
        pl.BlockSpec((None, None, sk, dv), lambda b_, h, i: (b_, h // group, 0, 0)),
    ]
    args = [q, k, v]
    if mask is not None:
        mb, mh = mask.shape[0] > 1, mask.shape[1] > 1
        in_specs.append(
            pl.BlockSpec(
                (None, None, block_q, sk),
                lambda b_, h, i: (b_ if mb else 0, h if mh else 0, i, 0),
            )
        )
        args.append(mask)
    kernel = functools.partial(
        _fwd_kernel,
        scale=scale,
        causal=causal,
        block_q=block_q,
        block_k=block_k,
        seq_k=sk,
        has_mask=mask is not None,
    )
    return pl.pallas_call(
        kernel,
        grid=(b, hq, sq // block_q),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, block_q, dv), lambda b_, h, i: (b_, h, i, 0)),
            pl.BlockSpec((None, None, block_q, 1), lambda b_, h, i: (b_, h, i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hq, sq, dv), q.dtype),
            jax.ShapeDtypeStruct((b, hq, sq, 1), _F32),
        ],
        interpret=interpret,
        compiler_params=compiler_params(),
        name="torchjax_flash_attention_fwd",
    )(*args)


def _scores(q, k, mask, causal, scale, q_start, k_start):
    """f32 scores of query rows ``q`` against key block ``k`` (heads already matched)."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=_F32) * scale
    if mask is not None:
        s = s + mask.astype(_F32)
    if causal:
        rows = q_start + jnp.arange(q.shape[2])[:, None]
        cols = k_start + jnp.arange(k.shape[2])[None, :]
        s = jnp.where(cols <= rows, s, -jnp.inf)
    return s


def _probs(q, k, lse, mask_block, scale, causal, q_start, k_start):
    """Probabilities of one (query block, key block) tile from the forward's lse
    (a (block_q, 1) column)."""
    s = _dot(q, k, trans_b=True) * scale
    if mask_block is not None:
        s = s + mask_block.astype(_F32)
    if causal:
        shape = (q.shape[0], k.shape[0])
        rows = q_start + lax.broadcasted_iota(jnp.int32, shape, 0)
        cols = k_start + lax.broadcasted_iota(jnp.int32, shape, 1)
        s = jnp.where(cols <= rows, s, -jnp.inf)
    return jnp.exp(s - lse)


def _dq_kernel(*refs, scale, causal, block_q, block_k, seq_k, has_mask):
    if has_mask:
        q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
    i = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    n_blocks = seq_k // block_k
    if causal:
        n_blocks = jnp.minimum(n_blocks, ((i + 1) * block_q + block_k - 1) // block_k)

    def body(j, dq):
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        m = mask_ref[:, pl.ds(start, block_k)] if has_mask else None
        p = _probs(q, k, lse, m, scale, causal, i * block_q, start)
        ds = p * (_dot(do, v, trans_b=True) - delta) * scale
        return dq + _dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, n_blocks, body, jnp.zeros(dq_ref.shape, _F32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(*refs, scale, causal, block_q, block_k, seq_q, group, mask_heads, has_mask):
    if has_mask:
        q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    # Query blocks above the diagonal never see this key block.
    first = (j * block_k) // block_q if causal else 0
    dk = jnp.zeros(dk_ref.shape, _F32)
    dv = jnp.zeros(dv_ref.shape, _F32)
    for h in range(group):  # the query heads sharing this kv head (GQA), unrolled

        def body(i, carry, h=h):
            dk, dv = carry
            start = pl.multiple_of(i * block_q, block_q)
            rows = pl.ds(start, block_q)
            q, do = q_ref[h, rows, :], do_ref[h, rows, :]
            m = mask_ref[h if mask_heads > 1 else 0, rows, :] if has_mask else None
            p = _probs(q, k, lse_ref[h, rows, :], m, scale, causal, start, j * block_k)
            dv = dv + _dot(p.astype(do.dtype).T, do)
            ds = p * (_dot(do, v, trans_b=True) - delta_ref[h, rows, :]) * scale
            return dk + _dot(ds.astype(q.dtype).T, q), dv

        dk, dv = lax.fori_loop(first, seq_q // block_q, body, (dk, dv))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward(q, k, v, mask, causal, scale, block_q, block_k, interpret, o, lse, do):
    b, hq, sq, d = q.shape
    hkv, sk, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    group = hq // hkv
    delta = jnp.sum(do.astype(_F32) * o.astype(_F32), axis=-1, keepdims=True)  # (B, Hq, Sq, 1)
    has_mask = mask is not None
    mb = has_mask and mask.shape[0] > 1
    mh = mask.shape[1] if has_mask else 1
    common = dict(scale=scale, causal=causal, block_q=block_q, block_k=block_k)

    # dq: one program per (batch, q head, query block), walking the key blocks.
    specs = [
        pl.BlockSpec((None, None, block_q, d), lambda b_, h, i: (b_, h, i, 0)),
        pl.BlockSpec((None, None, sk, d), lambda b_, h, i: (b_, h // group, 0, 0)),
        pl.BlockSpec((None, None, sk, dv_dim), lambda b_, h, i: (b_, h // group, 0, 0)),
    ]
    args = [q, k, v]
    if has_mask:
        specs.append(
            pl.BlockSpec(
                (None, None, block_q, sk),
                lambda b_, h, i: (b_ if mb else 0, h if mh > 1 else 0, i, 0),
            )
        )
        args.append(mask)
    specs += [
        pl.BlockSpec((None, None, block_q, dv_dim), lambda b_, h, i: (b_, h, i, 0)),
        pl.BlockSpec((None, None, block_q, 1), lambda b_, h, i: (b_, h, i, 0)),
        pl.BlockSpec((None, None, block_q, 1), lambda b_, h, i: (b_, h, i, 0)),
    ]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, seq_k=sk, has_mask=has_mask, **common),
        grid=(b, hq, sq // block_q),
        in_specs=specs,
        out_specs=pl.BlockSpec((None, None, block_q, d), lambda b_, h, i: (b_, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        compiler_params=compiler_params(),
        name="torchjax_flash_attention_dq",
    )(*args, do, lse, delta)

    # dk, dv: one program per (batch, kv head, key block), walking the query blocks of
    # every query head in its group.
    specs = [
        pl.BlockSpec((None, group, sq, d), lambda b_, h, j: (b_, h, 0, 0)),
        pl.BlockSpec((None, None, block_k, d), lambda b_, h, j: (b_, h, j, 0)),
        pl.BlockSpec((None, None, block_k, dv_dim), lambda b_, h, j: (b_, h, j, 0)),
    ]
    args = [q, k, v]
    if has_mask:
        mask_block = group if mh > 1 else 1
        specs.append(
            pl.BlockSpec(
                (None, mask_block, sq, block_k),
                lambda b_, h, j: (b_ if mb else 0, h if mh > 1 else 0, 0, j),
            )
        )
        args.append(mask)
    specs += [
        pl.BlockSpec((None, group, sq, dv_dim), lambda b_, h, j: (b_, h, 0, 0)),
        pl.BlockSpec((None, group, sq, 1), lambda b_, h, j: (b_, h, 0, 0)),
        pl.BlockSpec((None, group, sq, 1), lambda b_, h, j: (b_, h, 0, 0)),
    ]
    dk, dv = pl.pallas_call(
        functools.partial(
            _dkv_kernel, seq_q=sq, group=group, mask_heads=mh, has_mask=has_mask, **common
        ),
        grid=(b, hkv, sk // block_k),
        in_specs=specs,
        out_specs=[
            pl.BlockSpec((None, None, block_k, d), lambda b_, h, j: (b_, h, j, 0)),
            pl.BlockSpec((None, None, block_k, dv_dim), lambda b_, h, j: (b_, h, j, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        interpret=interpret,
        compiler_params=compiler_params(),
        name="torchjax_flash_attention_dkv",
    )(*args, do, lse, delta)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _flash(q, k, v, mask, causal, scale, block_q, block_k, interpret):
    return _forward(q, k, v, mask, causal, scale, block_q, block_k, interpret)[0]


def _flash_fwd(q, k, v, mask, causal, scale, block_q, block_k, interpret):
    o, lse = _forward(q, k, v, mask, causal, scale, block_q, block_k, interpret)
    return o, (q, k, v, mask, o, lse)


def _flash_bwd(causal, scale, block_q, block_k, interpret, res, do):
    q, k, v, mask, o, lse = res
    dq, dk, dv = _backward(
        q, k, v, mask, causal, scale, block_q, block_k, interpret, o, lse, do.astype(o.dtype)
    )
    # The mask gets no gradient (the SDPA dispatch rule sends masks that require grad to
    # the jnp path).
    return dq, dk, dv, None if mask is None else jnp.zeros_like(mask)


_flash.defvjp(_flash_fwd, _flash_bwd)


def additive_mask(mask, dtype=_F32):
    """A boolean (True = attend) or float mask as an additive float mask (4-D)."""
    if mask is None:
        return None
    if mask.dtype == jnp.bool_:
        mask = jnp.where(mask, 0.0, -jnp.inf).astype(dtype)
    return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


def flash_attention(
    q,
    k,
    v,
    mask=None,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = 128,
    block_k: int = 128,
    interpret: bool | None = None,
):
    """Attention ``softmax(q @ k^T * scale + mask) @ v`` with the Pallas flash kernel.

    Args:
        q: (B, Hq, Sq, D) float32/bfloat16/float16.
        k: (B, Hkv, Sk, D), ``Hq % Hkv == 0`` (GQA/MQA), same dtype as ``q``.
        v: (B, Hkv, Sk, Dv), same dtype.
        mask: None, or boolean (True = attend) or float (added to the scores),
            broadcastable to (B, Hq, Sq, Sk) with its last two dims exactly (Sq, Sk)
            (leading dims 1 or full; rank 2-4).
        causal: top-left aligned causal mask (key j visible to query i iff j <= i).
        scale: score scale; default ``1 / sqrt(D)``.
        block_q, block_k: query/key block sizes (clipped to Sq/Sk; must divide them).
        interpret: Pallas interpret mode; default on CPU only.

    Returns:
        (B, Hq, Sq, Dv) in ``q``'s dtype; dots accumulate in float32, the softmax is f32.
        Differentiable in q, k, v (blocked jnp backward, see module docstring).

    Raises:
        ValueError: shapes not as above, or Sq/Sk not multiples of the blocks.
    """
    from torchjax.pallas._op import interpret_default

    block_q, block_k = min(block_q, q.shape[2]), min(block_k, k.shape[2])
    mask = additive_mask(mask)
    _check(q, k, v, mask, block_q, block_k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    interpret = interpret_default() if interpret is None else interpret
    return _flash(q, k, v, mask, bool(causal), scale, block_q, block_k, interpret)


def attention_reference(q, k, v, mask=None, *, causal=False, scale=None):
    """The jnp reference: the same semantics as :func:`flash_attention`, materialising
    the (Sq, Sk) scores in float32 (fully masked rows give 0)."""
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _scores(q, k, additive_mask(mask), causal, scale, 0, 0)
    m = s.max(axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))
    denom = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    out = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v, preferred_element_type=_F32)
    return out.astype(q.dtype)
