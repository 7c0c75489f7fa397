"""Flash attention backward (the FlashAttention-2 split): ``dq`` and ``dk``/``dv`` kernels.

``delta = sum(dO * O)`` per query row is computed in jnp; each kernel rebuilds a tile's
probabilities from the forward's row statistics (:func:`probs`), so nothing (Sq, Sk)-sized
is stored. Two forms, as the forward (Note [Kernel platforms] in
torchjax/pallas/_tiling.py):

- grid form (TPU, interpret): ``dq`` has grid ``(batch, q_heads, Sq / block_q,
  Sk / block_k)`` with a (block_q, D) f32 scratch accumulator; ``dk``/``dv`` has grid
  ``(batch, kv_heads, Sk / block_k, group, Sq / block_q)``, the last two "arbitrary":
  one program per (key block, query head of the kv head's group, query block), summing
  into (block_k, D) f32 scratch, so GQA gradients add up in-kernel without atomics and
  per-program memory is one block of each operand whatever Sq.
- loop form (GPU/Triton): ``dq`` walks key blocks and ``dk``/``dv`` the query blocks of
  every query head of its group in ``fori_loop``s (blocks spanning the sequence; Triton
  loads only the tiles it reads).

Both skip the tiles above the causal diagonal (Note [Causal block skipping] in
torchjax/pallas/_flash_fwd.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from torchjax.pallas import _mask_blocks as mask_blocks
from torchjax.pallas._flash_fwd import F32, dot, last_key_block, masked_scores, widen
from torchjax.pallas._tiling import STAT_LANES, compiler_params, grid_spec, pallas_call, scratch


def probs(q, k, m, inv, bias, scale, causal, q_start, k_start):
    """Probabilities of one tile from the forward's row statistics, (block_q, L) blocks
    (Note [Flash residuals], Note [Row statistics across lanes])."""
    s = masked_scores(q, k, bias, scale, causal, q_start, k_start)
    n = s.shape[1]
    return jnp.exp(s - widen(m, n)) * widen(inv, n)


def dq_tile(q, k, v, bias, do, m, inv, delta, *, scale, causal, q_start, k_start):
    p = probs(q, k, m, inv, bias, scale, causal, q_start, k_start)
    ds = p * (dot(do, v, trans_b=True) - widen(delta, p.shape[1])) * scale
    return dot(ds.astype(k.dtype), k)


def dkv_tile(q, k, v, bias, do, m, inv, delta, *, scale, causal, q_start, k_start):
    p = probs(q, k, m, inv, bias, scale, causal, q_start, k_start)
    dv = dot(p.astype(do.dtype), do, trans_a=True)
    ds = p * (dot(do, v, trans_b=True) - widen(delta, p.shape[1])) * scale
    return dot(ds.astype(q.dtype), q, trans_a=True), dv


def first_query_block(j, block_q, block_k, n_q):
    """The first query block that sees key block ``j`` under ``causal``, clamped to a
    valid block index (with Sq < Sk late key blocks see no query)."""
    return jnp.minimum((j * block_k) // block_q, n_q - 1)


def _split(refs, has_mask, n_out):
    refs = list(refs)
    mask_ref = refs.pop(3) if has_mask else None
    return refs[:7], mask_ref, refs[7 : 7 + n_out], refs[7 + n_out :]


# -- grid form ----------------------------------------------------------------------------


def _load(ins, mask):
    """A grid program's blocks, in :func:`dq_tile`'s argument order."""
    q, k, v, do, m, inv, delta = (r[...] for r in ins)
    return q, k, v, None if mask is None else mask[...], do, m, inv, delta


def _split_table(refs, tiles):
    refs = list(refs)
    return (refs.pop(0) if tiles else None), refs


def _dq_grid_kernel(*refs, scale, causal, block_q, block_k, has_mask, tiles):
    table, refs = _split_table(refs, tiles)
    ins, mask, (dq_ref,), (acc,) = _split(refs, has_mask, 1)
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        acc[...] = jnp.zeros(acc.shape, F32)

    def step(biased=True):
        starts = dict(q_start=i * block_q, k_start=j * block_k)
        tile = _load(ins, mask if biased else None)
        acc[...] += dq_tile(*tile, scale=scale, causal=causal, **starts)

    if tiles:  # Note [Mask block map]
        code = tiles.code(table, pl.program_id(0), pl.program_id(1), i, j)
        pl.when(code == 1)(lambda: step(False))
        pl.when(code == 2)(step)
    elif causal:
        pl.when(j <= last_key_block(i, block_q, block_k))(step)
    else:
        step()

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = acc[...].astype(dq_ref.dtype)


def _dkv_grid_kernel(*refs, scale, causal, block_q, block_k, has_mask, tiles, group):
    table, refs = _split_table(refs, tiles)
    ins, mask, (dk_ref, dv_ref), (dk_acc, dv_acc) = _split(refs, has_mask, 2)
    j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, F32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, F32)

    def step(biased=True):
        starts = dict(q_start=i * block_q, k_start=j * block_k)
        tile = _load(ins, mask if biased else None)
        dk, dv = dkv_tile(*tile, scale=scale, causal=causal, **starts)
        dk_acc[...] += dk
        dv_acc[...] += dv

    if tiles:  # Note [Mask block map]
        head = pl.program_id(1) * group + g
        code = tiles.code(table, pl.program_id(0), head, j, i)
        pl.when(code == 1)(lambda: step(False))
        pl.when(code == 2)(step)
    elif causal:  # query blocks wholly above the diagonal never see this key block
        pl.when((i + 1) * block_q - 1 >= j * block_k)(step)
    else:
        step()

    @pl.when((g == pl.num_programs(3) - 1) & (i == pl.num_programs(4) - 1))
    def _finish():
        dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _inputs(arrays, q_block, q_map, kv_rows, kv_map, mask_spec):
    """The in_specs and arguments of a backward kernel, in the kernels' order: q, k, v,
    the mask (``mask_spec``, when there is one), do, m, inv, delta. The query-side arrays
    (q, do, m, inv, delta) take blocks of leading dims ``q_block`` by ``q_map``; k and v take
    ``kv_rows`` rows by ``kv_map``."""
    q, k, v, mask, do, m, inv, delta = arrays
    d, dv, lanes = q.shape[-1], v.shape[-1], m.shape[-1]
    specs = [
        pl.BlockSpec((*q_block, d), q_map),
        pl.BlockSpec((None, None, kv_rows, d), kv_map),
        pl.BlockSpec((None, None, kv_rows, dv), kv_map),
        pl.BlockSpec((*q_block, dv), q_map),
        pl.BlockSpec((*q_block, lanes), q_map),
        pl.BlockSpec((*q_block, lanes), q_map),
        pl.BlockSpec((*q_block, lanes), q_map),
    ]
    args = [q, k, v, do, m, inv, delta]
    if mask is not None:
        specs.insert(3, mask_spec)
        args.insert(3, mask)
    return specs, args


def _grid_backward(
    q, k, v, mask, causal, scale, block_q, block_k, interpret, plat, stats, delta, do
):
    b, hq, sq, d = q.shape
    hkv, sk, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    group = hq // hkv
    n_q = sq // block_q
    mb = mask is not None and mask.shape[0] > 1
    mh = mask is not None and mask.shape[1] > 1
    kernel_args = dict(scale=scale, causal=causal, block_q=block_q, block_k=block_k)
    kernel_args["has_mask"] = mask is not None
    arrays = (q, k, v, mask, do, *stats, delta)
    semantics = ("parallel", "parallel", "parallel", "arbitrary")

    # dq: (batch, q head, query block, key block).
    tiles = mask_blocks.Tiles.of(mask, causal, block_q, block_k)

    def kv_block(b_, h, i, j, table):
        if tiles:  # Note [Mask block map]
            return tiles.fetch(table[0], b_, h, i, j)
        return jnp.minimum(j, last_key_block(i, block_q, block_k)) if causal else j

    def mask_col(b_, h, i, j, table):
        return tiles.mask_fetch(table[0], b_, h, i, j) if tiles else kv_block(b_, h, i, j, ())

    row = lambda b_, h, i, j, *_: (b_, h, i, 0)  # noqa: E731
    kv = lambda b_, h, i, j, *t: (b_, h // group, kv_block(b_, h, i, j, t), 0)  # noqa: E731
    mask_spec = mask is not None and pl.BlockSpec(
        (None, None, block_q, block_k),
        lambda b_, h, i, j, *t: (b_ if mb else 0, h if mh else 0, i, mask_col(b_, h, i, j, t)),
    )
    specs, args = _inputs(arrays, (None, None, block_q), row, block_k, kv, mask_spec)
    prefetch = [tiles.table] if tiles else []
    dq = pallas_call(
        functools.partial(_dq_grid_kernel, tiles=tiles, **kernel_args),
        grid_spec=grid_spec(
            plat,
            len(prefetch),
            grid=(b, hq, n_q, sk // block_k),
            in_specs=specs,
            out_specs=pl.BlockSpec((None, None, block_q, d), row),
            scratch_shapes=[scratch(plat, (block_q, d), F32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        compiler_params=compiler_params(plat, semantics),
        name="torchjax_flash_attention_dq",
    )(*prefetch, *args)

    # dk, dv: (batch, kv head, key block, query head in the group, query block).
    tiles = mask_blocks.Tiles.of(mask, causal, block_q, block_k, by_key=True)

    def q_block(b_, h, j, g, i, table):
        if tiles:  # Note [Mask block map]
            return tiles.fetch(table[0], b_, h * group + g, j, i)
        return jnp.maximum(i, first_query_block(j, block_q, block_k, n_q)) if causal else i

    def mask_row(b_, h, j, g, i, table):
        if tiles:
            return tiles.mask_fetch(table[0], b_, h * group + g, j, i)
        return q_block(b_, h, j, g, i, ())

    qrow = lambda b_, h, j, g, i, *t: (b_, h * group + g, q_block(b_, h, j, g, i, t), 0)  # noqa: E731
    key = lambda b_, h, j, g, i, *_: (b_, h, j, 0)  # noqa: E731
    mask_spec = mask is not None and pl.BlockSpec(
        (None, None, block_q, block_k),
        lambda b_, h, j, g, i, *t: (
            b_ if mb else 0,
            h * group + g if mh else 0,
            mask_row(b_, h, j, g, i, t),
            j,
        ),
    )
    specs, args = _inputs(arrays, (None, None, block_q), qrow, block_k, key, mask_spec)
    key_out = [
        pl.BlockSpec((None, None, block_k, d), key),
        pl.BlockSpec((None, None, block_k, dv_dim), key),
    ]
    prefetch = [tiles.table] if tiles else []
    dk, dv = pallas_call(
        functools.partial(_dkv_grid_kernel, tiles=tiles, group=group, **kernel_args),
        grid_spec=grid_spec(
            plat,
            len(prefetch),
            grid=(b, hkv, sk // block_k, group, n_q),
            in_specs=specs,
            out_specs=key_out,
            scratch_shapes=[
                scratch(plat, (block_k, d), F32),
                scratch(plat, (block_k, dv_dim), F32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        interpret=interpret,
        compiler_params=compiler_params(plat, (*semantics, "arbitrary")),
        name="torchjax_flash_attention_dkv",
    )(*prefetch, *args)
    return dq, dk, dv


# -- loop form ----------------------------------------------------------------------------


def _dq_loop_kernel(*refs, scale, causal, block_q, block_k, seq_k, has_mask):
    (q_ref, k_ref, v_ref, do_ref, m_ref, inv_ref, delta_ref), mask_ref, (dq_ref,), _ = _split(
        refs, has_mask, 1
    )
    i = pl.program_id(2)
    q, do, delta = q_ref[...], do_ref[...], delta_ref[...]
    m, inv = m_ref[...], inv_ref[...]
    n_blocks = seq_k // block_k
    if causal:
        n_blocks = jnp.minimum(n_blocks, last_key_block(i, block_q, block_k) + 1)

    def body(j, acc):
        start = pl.multiple_of(j * block_k, block_k)
        cols = pl.ds(start, block_k)
        bias = mask_ref[:, cols] if has_mask else None
        k, v = k_ref[cols, :], v_ref[cols, :]
        starts = dict(q_start=i * block_q, k_start=start)
        tile = dq_tile(q, k, v, bias, do, m, inv, delta, scale=scale, causal=causal, **starts)
        return acc + tile

    dq = lax.fori_loop(0, n_blocks, body, jnp.zeros(dq_ref.shape, F32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_loop_kernel(*refs, scale, causal, block_q, block_k, seq_q, group, mask_heads, has_mask):
    ins, mask_ref, (dk_ref, dv_ref), _ = _split(refs, has_mask, 2)
    q_ref, k_ref, v_ref, do_ref, m_ref, inv_ref, delta_ref = ins
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    n_q = seq_q // block_q
    # Query blocks wholly above the diagonal never see this key block (with Sq < Sk,
    # none may: an empty loop).
    first = (j * block_k) // block_q if causal else 0
    dk = jnp.zeros(dk_ref.shape, F32)
    dv = jnp.zeros(dv_ref.shape, F32)
    for h in range(group):  # the query heads sharing this kv head (GQA), unrolled

        def body(i, carry, h=h):
            start = pl.multiple_of(i * block_q, block_q)
            rows = pl.ds(start, block_q)
            bias = mask_ref[h if mask_heads > 1 else 0, rows, :] if has_mask else None
            q, do = q_ref[h, rows, :], do_ref[h, rows, :]
            m, inv, delta = m_ref[h, rows, :], inv_ref[h, rows, :], delta_ref[h, rows, :]
            starts = dict(q_start=start, k_start=j * block_k)
            ddk, ddv = dkv_tile(
                q, k, v, bias, do, m, inv, delta, scale=scale, causal=causal, **starts
            )
            return carry[0] + ddk, carry[1] + ddv

        dk, dv = lax.fori_loop(first, n_q, body, (dk, dv))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _loop_backward(
    q, k, v, mask, causal, scale, block_q, block_k, interpret, plat, stats, delta, do
):
    b, hq, sq, d = q.shape
    hkv, sk, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    group = hq // hkv
    mb = mask is not None and mask.shape[0] > 1
    mh = mask.shape[1] if mask is not None else 1
    common = dict(scale=scale, causal=causal, block_q=block_q, block_k=block_k)
    common["has_mask"] = mask is not None

    row = lambda b_, h, i: (b_, h, i, 0)  # noqa: E731
    whole_kv = lambda b_, h, i: (b_, h // group, 0, 0)  # noqa: E731
    mask_spec = mask is not None and pl.BlockSpec(
        (None, None, block_q, sk), lambda b_, h, i: (b_ if mb else 0, h if mh > 1 else 0, i, 0)
    )
    arrays = (q, k, v, mask, do, *stats, delta)
    specs, args = _inputs(arrays, (None, None, block_q), row, sk, whole_kv, mask_spec)
    dq = pallas_call(
        functools.partial(_dq_loop_kernel, seq_k=sk, **common),
        grid=(b, hq, sq // block_q),
        in_specs=specs,
        out_specs=pl.BlockSpec((None, None, block_q, d), row),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        compiler_params=compiler_params(plat),
        name="torchjax_flash_attention_dq",
    )(*args)

    group_rows = lambda b_, h, j: (b_, h, 0, 0)  # noqa: E731
    key = lambda b_, h, j: (b_, h, j, 0)  # noqa: E731
    mask_spec = mask is not None and pl.BlockSpec(
        (None, group if mh > 1 else 1, sq, block_k),
        lambda b_, h, j: (b_ if mb else 0, h if mh > 1 else 0, 0, j),
    )
    specs, args = _inputs(arrays, (None, group, sq), group_rows, block_k, key, mask_spec)
    dk, dv = pallas_call(
        functools.partial(_dkv_loop_kernel, seq_q=sq, group=group, mask_heads=mh, **common),
        grid=(b, hkv, sk // block_k),
        in_specs=specs,
        out_specs=[
            pl.BlockSpec((None, None, block_k, d), key),
            pl.BlockSpec((None, None, block_k, dv_dim), key),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        interpret=interpret,
        compiler_params=compiler_params(plat),
        name="torchjax_flash_attention_dkv",
    )(*args)
    return dq, dk, dv


def backward(q, k, v, mask, causal, scale, block_q, block_k, interpret, plat, o, stats, do):
    """``(dq, dk, dv)`` in the dtypes of q, k, v; ``stats`` the forward's row statistics
    ``(m, inv_denom)`` (Note [Flash residuals])."""
    delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1, keepdims=True)  # (B, Hq, Sq, 1)
    delta = jnp.broadcast_to(delta, (*delta.shape[:-1], STAT_LANES[plat]))
    form = _loop_backward if plat == "gpu" else _grid_backward
    return form(q, k, v, mask, causal, scale, block_q, block_k, interpret, plat, stats, delta, do)
