"""Flash attention forward: the per-tile online softmax and its two kernel forms.

Both forms apply :func:`fwd_tile` to one (query block, key block) tile at a time, so the
(Sq, Sk) scores are never materialised; they differ in who walks the key blocks
(Note [Kernel platforms] in torchjax/pallas/_tiling.py):

- grid form (TPU, interpret): grid ``(batch, q_heads, Sq / block_q, Sk / block_k)``, the
  last dimension "arbitrary"; the running max ``m``, sum ``l`` and f32 accumulator live
  in scratch, reset at the first key block and written out at the last. One program holds
  one q/k/v/mask block each: memory is bounded by the block sizes, not the sequence.
- loop form (GPU/Triton, which has no scratch): grid ``(batch, q_heads, Sq / block_q)``;
  a program walks its kv head's key blocks in a ``fori_loop`` (the key/value BlockSpec
  spans the sequence, but Triton loads only the ``pl.ds`` tile it reads).

Note [Causal block skipping]
With ``causal``, key block j is entirely above the diagonal for query block i when
``j * block_k > (i + 1) * block_q - 1``: every score is masked, and the tile would leave
``m``, ``l`` and the accumulator as they are. The grid form skips its body under
``pl.when`` and clamps the key/value/mask index maps to the last useful block, so the
pipeline sees the same block index again and fetches nothing; the loop form stops its loop
there. The backward kernels skip the same tiles (torchjax/pallas/_flash_bwd.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from torchjax.pallas import _mask_blocks as mask_blocks
from torchjax.pallas._tiling import (
    STAT_LANES,
    compiler_params,
    grid_spec,
    kernel_dot,
    pallas_call,
    scratch,
)

F32 = jnp.float32


def dot(a, b, trans_a=False, trans_b=False):
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return kernel_dot(a, b, dims)


def masked_scores(q, k, bias, scale, causal, q_start, k_start):
    """f32 scores of one (query block, key block) tile, mask and causal applied."""
    s = dot(q, k, trans_b=True) * scale
    if bias is not None:
        s = s + bias.astype(F32)
    if causal:
        shape = (q.shape[0], k.shape[0])
        rows = q_start + lax.broadcasted_iota(jnp.int32, shape, 0)
        cols = k_start + lax.broadcasted_iota(jnp.int32, shape, 1)
        s = jnp.where(cols <= rows, s, -jnp.inf)
    return s


def last_key_block(i, block_q, block_k):
    """The last key block query block ``i`` sees under ``causal`` (Note [Causal block
    skipping])."""
    return ((i + 1) * block_q - 1) // block_k


def widen(x, n: int):
    """A (rows, L) block of per-row statistics (Note [Row statistics across lanes]) as an
    operand of a (rows, n) tile: the lanes tiled when ``n`` is a multiple of L, cut when
    ``n < L``, else one lane broadcast."""
    lanes = x.shape[-1]
    if lanes == 1 or n == lanes:
        return x
    if n % lanes == 0:
        return jnp.tile(x, (1, n // lanes))
    return x[:, :n] if n < lanes else x[:, :1]


def fwd_tile(q, k, v, bias, m, denom, acc, *, scale, causal, q_start, k_start):
    """One online-softmax step: ``m`` (running max), ``denom`` (running sum) are
    (block_q, L) f32 row statistics, ``acc`` (block_q, Dv) f32."""
    s = masked_scores(q, k, bias, scale, causal, q_start, k_start)
    return softmax_step(s, v, m, denom, acc)


def softmax_step(s, v, m, denom, acc):
    """The online-softmax update of ``(m, denom, acc)`` by one tile of f32 scores ``s``
    (masked entries -inf) and its value rows ``v``."""
    m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
    # A row masked so far has m == -inf: shift by 0 instead (exp(-inf) = 0, no NaN).
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - widen(shift, s.shape[1]))
    alpha = jnp.exp(m - shift)
    denom = alpha * denom + p.sum(axis=1, keepdims=True)
    acc = widen(alpha, acc.shape[1]) * acc + dot(p.astype(v.dtype), v)
    return m_new, denom, acc


def fwd_finish(m, denom, acc):
    """Output block (f32) and the backward's row statistics (Note [Flash residuals]):
    the shift ``m`` and ``1 / denom``; a row with every key masked gives 0 (as torch),
    shift 0 and ``1 / denom`` 0."""
    empty = denom == 0.0
    inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, denom))
    shift = jnp.where(m == -jnp.inf, 0.0, m)
    return acc * widen(inv, acc.shape[1]), shift, inv


# Note [Flash residuals]
# The backward recomputes each tile's probabilities from two per-row statistics of the
# forward, ``exp(s - m) * (1 / denom)``, as XLA's softmax computes them, and not from the
# usual log-sum-exp, ``exp(s - (m + log(denom)))``: that form carries the platform's
# ``log`` error into every probability of the row, scaled by ``|log(denom)|`` (up to
# log(Sk)). XLA:TPU's float32 ``exp`` was measured 43 ulps (5e-6) from float64 on a v5e,
# and with the log-sum-exp form the float32 gradients were 2.7e-5 to 5.1e-5 (of their
# scale) from CPU torch's float64, where XLA:TPU's own attention was 1.3e-6 and the
# forward output 9e-7; on CPU, a log 6e-6 off moved the gradients from 8e-7 to 1e-5. One
# more (B, H, Sq, 1) float32 array is the price.


def _grid_kernel(*refs, scale, causal, block_q, block_k, has_mask, residuals, tiles):
    refs = list(refs)
    table = refs.pop(0) if tiles else None
    mask_ref = refs.pop(3) if has_mask else None
    q_ref, k_ref, v_ref, o_ref = refs[:4]
    m_ref, inv_ref = refs[4:6] if residuals else (None, None)
    m_sc, l_sc, acc_sc = refs[-3:]
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    def step(biased=True):
        m, denom, acc = fwd_tile(
            q_ref[...],
            k_ref[...],
            v_ref[...],
            mask_ref[...] if biased and mask_ref is not None else None,
            m_sc[...],
            l_sc[...],
            acc_sc[...],
            scale=scale,
            causal=causal,
            q_start=i * block_q,
            k_start=j * block_k,
        )
        m_sc[...], l_sc[...], acc_sc[...] = m, denom, acc

    if tiles:  # Note [Mask block map]
        b, h = pl.program_id(0), pl.program_id(1)
        code = tiles.code(table, b, h, i, j)
        pl.when(code == 1)(lambda: step(False))
        pl.when(code == 2)(step)
    elif causal:
        pl.when(j <= last_key_block(i, block_q, block_k))(step)
    else:
        step()

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        out, shift, inv = fwd_finish(m_sc[...], l_sc[...], acc_sc[...])
        o_ref[...] = out.astype(o_ref.dtype)
        if residuals:
            m_ref[...], inv_ref[...] = shift, inv


def _outputs(q, v, block_q, row, residuals, lanes):
    """out_specs and out_shape of a forward: the output, then the row statistics
    (B, Hq, Sq, ``lanes``) when ``residuals``."""
    b, hq, sq, dv = (*q.shape[:3], v.shape[-1])
    specs = [pl.BlockSpec((None, None, block_q, dv), row)]
    shapes = [jax.ShapeDtypeStruct((b, hq, sq, dv), q.dtype)]
    if residuals:
        specs += [pl.BlockSpec((None, None, block_q, lanes), row)] * 2
        shapes += [jax.ShapeDtypeStruct((b, hq, sq, lanes), F32)] * 2
    return specs, shapes


def _grid_forward(q, k, v, mask, causal, scale, block_q, block_k, interpret, plat, residuals):
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = hq // hkv
    tiles = mask_blocks.Tiles.of(mask, causal, block_q, block_k)

    def kv_block(i, j):
        return jnp.minimum(j, last_key_block(i, block_q, block_k)) if causal else j

    # With a block map the index maps read the prefetched table (Note [Mask block map]).
    def kv(b_, h, i, j, *table):
        if tiles:
            return (b_, h // group, tiles.fetch(table[0], b_, h, i, j), 0)
        return (b_, h // group, kv_block(i, j), 0)

    row = lambda b_, h, i, j, *_: (b_, h, i, 0)  # noqa: E731
    in_specs = [
        pl.BlockSpec((None, None, block_q, d), row),
        pl.BlockSpec((None, None, block_k, d), kv),
        pl.BlockSpec((None, None, block_k, dv), kv),
    ]
    args = [q, k, v]
    if mask is not None:
        mb, mh = mask.shape[0] > 1, mask.shape[1] > 1

        def mask_map(b_, h, i, j, *table):
            col = tiles.mask_fetch(table[0], b_, h, i, j) if tiles else kv_block(i, j)
            return (b_ if mb else 0, h if mh else 0, i, col)

        in_specs.append(pl.BlockSpec((None, None, block_q, block_k), mask_map))
        args.append(mask)
    kernel = functools.partial(
        _grid_kernel,
        scale=scale,
        causal=causal,
        block_q=block_q,
        block_k=block_k,
        has_mask=mask is not None,
        residuals=residuals,
        tiles=tiles,
    )
    lanes = STAT_LANES[plat]
    out_specs, out_shape = _outputs(q, v, block_q, row, residuals, lanes)
    prefetch = [tiles.table] if tiles else []
    return pallas_call(
        kernel,
        grid_spec=grid_spec(
            plat,
            len(prefetch),
            grid=(b, hq, sq // block_q, sk // block_k),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                scratch(plat, (block_q, lanes), F32),
                scratch(plat, (block_q, lanes), F32),
                scratch(plat, (block_q, dv), F32),
            ],
        ),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=compiler_params(plat, ("parallel", "parallel", "parallel", "arbitrary")),
        name="torchjax_flash_attention_fwd",
    )(*prefetch, *args)


def _loop_kernel(*refs, scale, causal, block_q, block_k, seq_k, has_mask, residuals):
    refs = list(refs)
    mask_ref = refs.pop(3) if has_mask else None
    q_ref, k_ref, v_ref, o_ref, *stat_refs = refs
    i = pl.program_id(2)
    q = q_ref[...]
    n_blocks = seq_k // block_k
    if causal:
        n_blocks = jnp.minimum(n_blocks, last_key_block(i, block_q, block_k) + 1)

    def body(j, carry):
        start = pl.multiple_of(j * block_k, block_k)
        cols = pl.ds(start, block_k)
        bias = mask_ref[:, cols] if has_mask else None
        return fwd_tile(
            q,
            k_ref[cols, :],
            v_ref[cols, :],
            bias,
            *carry,
            scale=scale,
            causal=causal,
            q_start=i * block_q,
            k_start=start,
        )

    init = (
        jnp.full((block_q, 1), -jnp.inf, F32),
        jnp.zeros((block_q, 1), F32),
        jnp.zeros((block_q, v_ref.shape[-1]), F32),
    )
    out, shift, inv = fwd_finish(*lax.fori_loop(0, n_blocks, body, init))
    o_ref[...] = out.astype(o_ref.dtype)
    if residuals:
        stat_refs[0][...], stat_refs[1][...] = shift, inv


def _loop_forward(q, k, v, mask, causal, scale, block_q, block_k, interpret, plat, residuals):
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
        _loop_kernel,
        scale=scale,
        causal=causal,
        block_q=block_q,
        block_k=block_k,
        seq_k=sk,
        has_mask=mask is not None,
        residuals=residuals,
    )
    out_specs, out_shape = _outputs(
        q, v, block_q, lambda b_, h, i: (b_, h, i, 0), residuals, STAT_LANES[plat]
    )
    return pallas_call(
        kernel,
        grid=(b, hq, sq // block_q),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=compiler_params(plat),
        name="torchjax_flash_attention_fwd",
    )(*args)


def forward(q, k, v, mask, causal, scale, block_q, block_k, interpret, plat, residuals=True):
    """``(out, m, inv_denom)``: out (B, Hq, Sq, Dv) in q's dtype, the row statistics
    (B, Hq, Sq, L) f32 (Note [Flash residuals], Note [Row statistics across lanes]);
    ``(out,)`` without ``residuals`` (a forward nothing differentiates)."""
    form = _loop_forward if plat == "gpu" else _grid_forward
    return form(q, k, v, mask, causal, scale, block_q, block_k, interpret, plat, residuals)
