"""Flash attention: Pallas forward and backward kernels, and a jnp reference.

The kernels (torchjax/pallas/_flash_fwd.py, torchjax/pallas/_flash_bwd.py) work one
(query block, key block) tile at a time: the forward keeps the online softmax's running
max, sum and f32 accumulator and writes the log-sum-exp per query row; the backward
(``jax.custom_vjp``, the FlashAttention-2 split) rebuilds each tile's probabilities from
it in a ``dq`` kernel and a ``dk``/``dv`` kernel (GQA gradients summed in-kernel). On TPU
and in interpret mode the tile walk is the grid's innermost dimension with the running
state in scratch, so a program holds one block of each operand whatever the sequence
length; on GPU (Triton has no scratch) it is a ``fori_loop`` in the kernel. Tiles
above the causal diagonal are skipped. Block sizes come from a per-platform table. See
Note [Kernel platforms] (torchjax/pallas/_tiling.py) and docs/kernels.md.

Interpret mode on CPU is tested against the reference; the Triton (GPU) and Mosaic (TPU)
lowerings by cross-platform lowering (tests/pallas/test_lowering.py), and the Mosaic one
on a TPU by the TPU tier (tests/tpu). Per-row statistics (the softmax's shift and
``1 / sum``, Note [Flash residuals] in _flash_fwd.py; ``delta``) are
(S, 1) columns so every block meets Mosaic's rule (last two block dims divisible by
(8, 128) or equal to the array's). The jax-shipped kernels are not used because each is
tied to one platform (``ops.tpu.flash_attention`` to Mosaic, ``ops.gpu.attention`` to
Triton), and neither takes an arbitrary additive mask with GQA.

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

from torchjax.pallas import _tiling
from torchjax.pallas._flash_bwd import backward
from torchjax.pallas._flash_fwd import forward

_F32 = jnp.float32


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


def _scores(q, k, mask, causal, scale, q_start, k_start):
    """f32 scores of query rows ``q`` against key block ``k`` (heads already matched)."""
    s = (
        jnp.einsum(
            "bhqd,bhkd->bhqk",
            q,
            k,
            precision=_tiling.precision_of(q, k),
            preferred_element_type=_F32,
        )
        * scale
    )
    if mask is not None:
        s = s + mask.astype(_F32)
    if causal:
        rows = q_start + jnp.arange(q.shape[2])[:, None]
        cols = k_start + jnp.arange(k.shape[2])[None, :]
        s = jnp.where(cols <= rows, s, -jnp.inf)
    return s


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _flash(q, k, v, mask, causal, scale, blocks, interpret, plat):
    # Nothing differentiates this call: no row statistics are written.
    return forward(q, k, v, mask, causal, scale, *blocks[:2], interpret, plat, False)[0]


def _flash_fwd(q, k, v, mask, causal, scale, blocks, interpret, plat):
    o, m, inv = forward(q, k, v, mask, causal, scale, *blocks[:2], interpret, plat)
    return o, (q, k, v, mask, o, (m, inv))


def _flash_bwd(causal, scale, blocks, interpret, plat, res, do):
    q, k, v, mask, o, stats = res
    do = do.astype(o.dtype)
    dq, dk, dv = backward(q, k, v, mask, causal, scale, *blocks[2:], interpret, plat, o, stats, do)
    # The mask gets no gradient (the SDPA dispatch rule sends masks that require grad to
    # the jnp path).
    return dq, dk, dv, None if mask is None else jnp.zeros_like(mask)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _blocks(plat, sq, sk, block_q, block_k, head_dim, masked):
    """(forward block_q, block_k, backward block_q, block_k): the caller's for both, or
    the platform's table (torchjax/pallas/_tiling.py) fitted to Sq and Sk."""
    # Mosaic: a key block is the lane dim of the mask block (multiple of 128 or all of
    # Sk) and a query block a sublane dim (multiple of 8); Triton: powers of two.
    q_step, k_step = (8, _tiling.LANE) if plat == "tpu" else (16, 16)
    out = []
    for want_q, want_k in _tiling.flash_blocks(plat, head_dim, masked):
        whole = plat != "gpu"
        bq = (
            _tiling.fit_block(sq, want_q, q_step, whole)
            if block_q is None
            else _tiling.legal_block(plat, sq, block_q, 8)
        )
        bk = (
            _tiling.fit_block(sk, want_k, k_step, whole)
            if block_k is None
            else _tiling.legal_block(plat, sk, block_k, _tiling.LANE)
        )
        out += [bq, bk]
    return tuple(out)


def additive_mask(mask, dtype=_F32):
    """A boolean (True = attend) or float mask as an additive float mask (4-D)."""
    if mask is None:
        return None
    if mask.dtype == jnp.bool_:
        # The two values in ``dtype`` itself: Python floats would select in float64 under
        # JAX's x64 (on in every torchjax op), a float64 (B, H, L, S) array per call
        # converted after, which a TPU emulates.
        mask = jnp.where(mask, jnp.zeros((), dtype), jnp.full((), -jnp.inf, dtype))
    return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


def flash_attention(
    q,
    k,
    v,
    mask=None,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
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
        block_q, block_k: query/key block sizes for the forward and backward kernels
            (clipped to Sq/Sk; must divide them); default: the platform's table in
            torchjax/pallas/_tiling.py, fitted to Sq and Sk.
        interpret: Pallas interpret mode; default on CPU only.

    Returns:
        (B, Hq, Sq, Dv) in ``q``'s dtype; dots accumulate in float32, the softmax is f32.
        Differentiable in q, k, v (blocked jnp backward, see module docstring).

    Raises:
        ValueError: shapes not as above, or Sq/Sk not multiples of the blocks.
    """
    from torchjax.pallas._op import interpret_default

    interpret = interpret_default() if interpret is None else interpret
    plat = _tiling.platform(interpret)
    # A boolean mask becomes 0 / -inf, exact in bfloat16: half the bytes of float32 for
    # the tiles that read it (Note [Mask block map]).
    mask = additive_mask(mask, jnp.bfloat16)
    # FLASH_UNMASKED's blocks were measured on 2-byte q/k/v; float32 ones take the table's
    # (at 1024 blocks the float32 dk/dv kernel asked for 18 MiB of scoped VMEM on a v5e
    # and failed to compile: Note [Flash blocks by input width] in _tiling.py).
    wide = q.dtype.itemsize > 2 or (mask is not None and mask.dtype.itemsize > 2)
    blocks = _blocks(plat, q.shape[2], k.shape[2], block_q, block_k, q.shape[-1], wide)
    _check(q, k, v, mask, *blocks[:2])
    _check(q, k, v, mask, *blocks[2:])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _flash(q, k, v, mask, bool(causal), scale, blocks, interpret, plat)


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
    pv = p.astype(v.dtype)
    precision = _tiling.precision_of(pv, v)
    out = jnp.einsum("bhqk,bhkd->bhqd", pv, v, precision=precision, preferred_element_type=_F32)
    return out.astype(q.dtype)
