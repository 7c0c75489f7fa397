"""Ragged dot, grid form (TPU, interpret): tiled over m, k and n with a visit schedule.

Note [Ragged dot visit schedule]
Rows are sorted by group, so a row tile of ``block_m`` rows meets one or more groups, and
a group spans one or more row tiles. The grid walks a static list of ``T = tiles_m + G -
1`` visits, each a (row tile, group) pair, in row-tile order (so also in group order:
groups are contiguous). That bound holds because a row tile is visited once per group
boundary strictly inside it, plus once. Per visit the schedule gives (computed in jnp
from ``group_sizes``, passed by scalar prefetch so index maps can read it):

- ``tiles[t]``, ``groups[t]``: which lhs/out row tile and which rhs matrix to fetch;
- ``firsts[t]``: first visit of its row tile (forward) or of its group (``tgmm``);
- ``valids[t]``: 0 for the unused tail of the list (fewer boundaries than the bound),
  whose slots repeat the last real visit's tile and group, so the pipeline fetches
  nothing new and the kernel does nothing.

A row tile past ``sum(group_sizes)`` meets no group; it still gets one visit (with the
last group, whose row range misses it) so its rows are written as zeros.

``gmm`` (forward, and ``dlhs``): grid ``(N / block_n, T, K / block_k)``; the k loop
accumulates ``lhs_tile @ rhs[group]_tile`` in f32 scratch and the last k step stores the
rows of the visit's group into the output tile. Consecutive visits of one row tile keep
the same output block, which stays in VMEM (nothing is written back until the index
changes), so each group fills its own rows; the first visit zeroes the others.

``tgmm`` (``drhs``): grid ``(K / block_k, N / block_n, T)``; consecutive visits of one
group keep the same (block_k, block_n) output block and accumulate ``lhs_tile^T @
dout_tile`` over the group's row tiles, rows of other groups masked to 0. Groups with no
rows are never visited: their gradient is set to 0 after the kernel.

This is the grouped-matmul design of jax's megablox kernels (a group-offset schedule
read through scalar prefetch); the code is torchjax's own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from torchjax.pallas._tiling import compiler_params, kernel_dot, pallas_call, scratch

F32 = jnp.float32


def _dot(a, b, contract_a, contract_b):
    dims = (((contract_a,), (contract_b,)), ((), ()))
    return kernel_dot(a, b, dims)


def _rows_of_group(offsets, tile, group, block_m):
    rows = tile * block_m + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    return (rows >= offsets[group]) & (rows < offsets[group + 1])


def _gmm_kernel(offsets, tiles, groups, firsts, valids, lhs, rhs, out, acc, *, block_m, trans):
    t, k = pl.program_id(1), pl.program_id(2)

    @pl.when(valids[t] == 1)
    def _visit():
        @pl.when(k == 0)
        def _init():
            acc[...] = jnp.zeros(acc.shape, F32)

        acc[...] += _dot(lhs[...], rhs[...], 1, 1 if trans else 0)

        @pl.when(k == pl.num_programs(2) - 1)
        def _store():
            keep = _rows_of_group(offsets, tiles[t], groups[t], block_m)
            # The output block is not read from HBM: the first visit writes every row.
            before = jnp.where(firsts[t] == 1, jnp.zeros(out.shape, out.dtype), out[...])
            out[...] = jnp.where(keep, acc[...].astype(out.dtype), before)


def gmm(lhs, rhs, schedule, trans, blocks, interpret, plat):
    """out[r] = lhs[r] @ (rhs[g].T if trans else rhs[g]) for row r of group g; ``lhs``
    (M, Kc) with M a multiple of block_m."""
    block_m, block_k, block_n = blocks
    m, kc = lhs.shape
    n = rhs.shape[1] if trans else rhs.shape[2]
    visits = schedule[1].shape[0]
    from jax.experimental.pallas import tpu as pltpu

    rhs_spec = (
        pl.BlockSpec((None, block_n, block_k), lambda j, t, k, o, tl, g, f, v: (g[t], j, k))
        if trans
        else pl.BlockSpec((None, block_k, block_n), lambda j, t, k, o, tl, g, f, v: (g[t], k, j))
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(n // block_n, visits, kc // block_k),
        in_specs=[
            pl.BlockSpec((block_m, block_k), lambda j, t, k, o, tl, g, f, v: (tl[t], k)),
            rhs_spec,
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda j, t, k, o, tl, g, f, v: (tl[t], j)),
        scratch_shapes=[scratch(plat, (block_m, block_n), F32)],
    )
    return pallas_call(
        functools.partial(_gmm_kernel, block_m=block_m, trans=trans),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        interpret=interpret,
        compiler_params=compiler_params(plat, ("parallel", "arbitrary", "arbitrary")),
        name="torchjax_ragged_dot",
    )(*schedule, lhs, rhs)


def _tgmm_kernel(offsets, tiles, groups, firsts, valids, lhs, dout, out, acc, *, block_m, trans):
    t = pl.program_id(2)

    @pl.when(valids[t] == 1)
    def _visit():
        @pl.when(firsts[t] == 1)
        def _init():
            acc[...] = jnp.zeros(acc.shape, F32)

        keep = _rows_of_group(offsets, tiles[t], groups[t], block_m)
        x = jnp.where(keep, lhs[...], jnp.zeros(lhs.shape, lhs.dtype))
        d = jnp.where(keep, dout[...], jnp.zeros(dout.shape, dout.dtype))
        acc[...] += _dot(d, x, 0, 0) if trans else _dot(x, d, 0, 0)
        out[...] = acc[...].astype(out.dtype)


def tgmm(lhs, dout, schedule, trans, blocks, interpret, plat, out_dtype, groups):
    """Per group g: lhs[rows_g]^T @ dout[rows_g] (K, N), or its transpose if ``trans``;
    ``schedule``'s ``firsts`` mark the first visit of each group."""
    block_m, block_k, block_n = blocks
    k, n = lhs.shape[1], dout.shape[1]
    visits = schedule[1].shape[0]
    from jax.experimental.pallas import tpu as pltpu

    out_spec = (
        pl.BlockSpec((None, block_n, block_k), lambda kk, j, t, o, tl, g, f, v: (g[t], j, kk))
        if trans
        else pl.BlockSpec((None, block_k, block_n), lambda kk, j, t, o, tl, g, f, v: (g[t], kk, j))
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(k // block_k, n // block_n, visits),
        in_specs=[
            pl.BlockSpec((block_m, block_k), lambda kk, j, t, o, tl, g, f, v: (tl[t], kk)),
            pl.BlockSpec((block_m, block_n), lambda kk, j, t, o, tl, g, f, v: (tl[t], j)),
        ],
        out_specs=out_spec,
        scratch_shapes=[scratch(plat, (block_n, block_k) if trans else (block_k, block_n), F32)],
    )
    return pallas_call(
        functools.partial(_tgmm_kernel, block_m=block_m, trans=trans),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((groups, n, k) if trans else (groups, k, n), out_dtype),
        interpret=interpret,
        compiler_params=compiler_params(plat, ("parallel", "parallel", "arbitrary")),
        name="torchjax_ragged_dot_tgmm",
    )(*schedule, lhs, dout)
