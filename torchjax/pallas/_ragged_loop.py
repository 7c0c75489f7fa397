"""Ragged dot, loop form (GPU/Triton: no scalar prefetch, no scratch; Note [Kernel
platforms] in torchjax/pallas/_tiling.py).

``gmm``: grid ``(M / block_m, N / block_n)``; a program loops over the groups, skips
those whose row range misses its row tile, and for each hit walks K in ``block_k``
tiles, storing that group's rows. ``tgmm``: grid ``(G, K / block_k, N / block_n)``; a
program walks the row tiles its group covers. Blocks spanning K (gmm) or M (tgmm) are
pointer offsets in Triton: each ``pl.ds`` read loads one tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from torchjax.pallas._tiling import compiler_params, kernel_dot, pallas_call

F32 = jnp.float32


def _gmm_kernel(starts, ends, lhs, rhs, out, *, block_m, block_k, groups, trans):
    row0 = pl.program_id(0) * block_m
    rows = row0 + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    contract = 1 if trans else 0
    n_k = lhs.shape[1] // block_k

    def group(g, acc):
        start, end = starts[g], ends[g]

        def hit(acc):
            def k_step(kk, part):
                cols = pl.ds(pl.multiple_of(kk * block_k, block_k), block_k)
                w = rhs[g, :, cols] if trans else rhs[g, cols, :]
                dims = (((1,), (contract,)), ((), ()))
                return part + kernel_dot(lhs[:, cols], w, dims)

            part = lax.fori_loop(0, n_k, k_step, jnp.zeros(acc.shape, F32))
            return jnp.where((rows >= start) & (rows < end), part, acc)

        return lax.cond((start < row0 + block_m) & (end > row0), hit, lambda a: a, acc)

    acc = lax.fori_loop(0, groups, group, jnp.zeros(out.shape, F32))
    out[...] = acc.astype(out.dtype)


def gmm(lhs, rhs, starts, ends, trans, blocks, interpret, plat):
    block_m, block_k, block_n = blocks
    m, kc = lhs.shape
    groups = rhs.shape[0]
    n = rhs.shape[1] if trans else rhs.shape[2]
    rhs_spec = (
        pl.BlockSpec((groups, block_n, kc), lambda i, j: (0, j, 0))
        if trans
        else pl.BlockSpec((groups, kc, block_n), lambda i, j: (0, 0, j))
    )
    kernel = functools.partial(
        _gmm_kernel, block_m=block_m, block_k=block_k, groups=groups, trans=trans
    )
    return pallas_call(
        kernel,
        grid=(m // block_m, n // block_n),
        in_specs=[
            pl.BlockSpec((groups,), lambda i, j: (0,)),
            pl.BlockSpec((groups,), lambda i, j: (0,)),
            pl.BlockSpec((block_m, kc), lambda i, j: (i, 0)),
            rhs_spec,
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        interpret=interpret,
        compiler_params=compiler_params(plat),
        name="torchjax_ragged_dot",
    )(starts, ends, lhs, rhs)


def _tgmm_kernel(starts, ends, lhs, dout, out, *, block_m, trans):
    g = pl.program_id(0)
    start, end = starts[g], ends[g]

    def body(t, acc):
        r0 = pl.multiple_of(t * block_m, block_m)
        rows = r0 + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
        keep = (rows >= start) & (rows < end)
        x = lhs[pl.ds(r0, block_m), :]
        d = dout[pl.ds(r0, block_m), :]
        x = jnp.where(keep, x, jnp.zeros_like(x))
        d = jnp.where(keep, d, jnp.zeros_like(d))
        a, b = (d, x) if trans else (x, d)
        return acc + kernel_dot(a, b, (((0,), (0,)), ((), ())))

    first = start // block_m
    last = jnp.maximum((end + block_m - 1) // block_m, first)
    acc = lax.fori_loop(first, last, body, jnp.zeros(out.shape, F32))
    out[...] = acc.astype(out.dtype)


def tgmm(lhs, dout, starts, ends, trans, blocks, interpret, plat, out_dtype):
    block_m, block_k, block_n = blocks
    m, k = lhs.shape
    n = dout.shape[1]
    groups = starts.shape[0]
    out_block, out_index = (
        ((None, block_n, block_k), lambda g, kk, j: (g, j, kk))
        if trans
        else ((None, block_k, block_n), lambda g, kk, j: (g, kk, j))
    )
    return pallas_call(
        functools.partial(_tgmm_kernel, block_m=block_m, trans=trans),
        grid=(groups, k // block_k, n // block_n),
        in_specs=[
            pl.BlockSpec((groups,), lambda g, kk, j: (0,)),
            pl.BlockSpec((groups,), lambda g, kk, j: (0,)),
            pl.BlockSpec((m, block_k), lambda g, kk, j: (0, kk)),
            pl.BlockSpec((m, block_n), lambda g, kk, j: (0, j)),
        ],
        out_specs=pl.BlockSpec(out_block, out_index),
        out_shape=jax.ShapeDtypeStruct((groups, n, k) if trans else (groups, k, n), out_dtype),
        interpret=interpret,
        compiler_params=compiler_params(plat),
        name="torchjax_ragged_dot_tgmm",
    )(starts, ends, lhs, dout)
