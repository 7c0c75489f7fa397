"""Ragged dot (grouped matmul) for Mixture-of-Experts: portable Pallas kernels.

``ragged_dot(lhs, rhs, group_sizes)`` multiplies consecutive row groups of ``lhs`` (the
tokens routed to each expert, sorted by expert) by that group's ``rhs`` matrix, like
``jax.lax.ragged_dot``. Rows past ``sum(group_sizes)`` are 0.

Kernels (both Pallas, BlockSpecs + ``fori_loop`` only: compiled on GPU/TPU, interpret
mode on CPU):

- ``_gmm`` (forward, and ``dlhs`` = ``dout`` times each group's transposed matrix): grid
  ``(M / block_m, N / block_n)``; a program loops over the groups and multiplies only
  those whose row range meets its row block (rows of other groups masked to 0), so the
  work is about ``M / block_m + G`` block matmuls, not ``G`` times that.
- ``_tgmm`` (``drhs``, one matrix per group: ``lhs[rows_g]^T @ dout[rows_g]``): grid
  ``(G, N / block_n)``; a program loops over the row blocks its group covers.

Backward: ``jax.custom_vjp`` with both kernels; ``group_sizes`` gets no gradient.
Limits: a forward program holds all G matrices' (K, block_n) columns in fast memory,
and a ``_tgmm`` program all M rows of ``lhs``: right for the small-to-medium MoE layers
torchjax tests, not tuned for giant experts (tokamax's kernels, wrapped in
torchjax/pallas/_tokamax.py, tile K and use TPU scalar prefetch). Interpret mode on CPU
is tested against ``jax.lax.ragged_dot``; the Triton (GPU) and Mosaic (TPU) lowerings by
cross-platform lowering; compiled runs on GPU/TPU are unverified here (no hardware).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from torchjax.pallas._op import compiler_params

_F32 = jnp.float32


def _block(n: int, sizes=(128, 64, 32, 16, 8)) -> int:
    return next((b for b in sizes if n % b == 0), n)


def _gmm_kernel(starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref, *, block_m, groups, trans):
    row0 = pl.program_id(0) * block_m
    rows = row0 + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    x = lhs_ref[...]

    def body(g, acc):
        start, end = starts_ref[g], ends_ref[g]

        def hit(acc):
            xg = jnp.where((rows >= start) & (rows < end), x, jnp.zeros_like(x))
            dims = (((1,), (1 if trans else 0,)), ((), ()))
            return acc + lax.dot_general(xg, rhs_ref[g], dims, preferred_element_type=_F32)

        return lax.cond((start < row0 + block_m) & (end > row0), hit, lambda a: a, acc)

    acc = lax.fori_loop(0, groups, body, jnp.zeros(out_ref.shape, _F32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _offsets(group_sizes):
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return ends - group_sizes.astype(jnp.int32), ends


def _pad_rows(x, block_m):
    pad = -x.shape[0] % block_m
    return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _gmm(lhs, rhs, group_sizes, trans, interpret):
    """out[r] = lhs[r] @ (rhs[g].T if trans else rhs[g]) for row r in group g."""
    m, k = lhs.shape
    groups = rhs.shape[0]
    n = rhs.shape[1] if trans else rhs.shape[2]
    block_m, block_n = min(_block(m), 128) if m % 8 == 0 else 8, _block(n)
    x = _pad_rows(lhs, block_m)
    starts, ends = _offsets(group_sizes)
    rhs_spec = (
        pl.BlockSpec((groups, block_n, k), lambda i, j: (0, j, 0))
        if trans
        else pl.BlockSpec((groups, k, block_n), lambda i, j: (0, 0, j))
    )
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, block_m=block_m, groups=groups, trans=trans),
        grid=(x.shape[0] // block_m, n // block_n),
        in_specs=[
            pl.BlockSpec((groups,), lambda i, j: (0,)),
            pl.BlockSpec((groups,), lambda i, j: (0,)),
            pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
            rhs_spec,
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], n), lhs.dtype),
        interpret=interpret,
        compiler_params=compiler_params(),
        name="torchjax_ragged_dot",
    )(starts, ends, x, rhs)
    return out[:m]


def _tgmm_kernel(starts_ref, ends_ref, lhs_ref, dout_ref, out_ref, *, block_m, trans):
    g = pl.program_id(0)
    start, end = starts_ref[g], ends_ref[g]

    def body(t, acc):
        r0 = pl.multiple_of(t * block_m, block_m)
        rows = r0 + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
        keep = (rows >= start) & (rows < end)
        x = lhs_ref[pl.ds(r0, block_m), :]
        d = dout_ref[pl.ds(r0, block_m), :]
        x = jnp.where(keep, x, jnp.zeros_like(x))
        a, b = (d, x) if trans else (x, d)
        return acc + lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=_F32)

    first = start // block_m
    last = jnp.maximum((end + block_m - 1) // block_m, first)
    acc = lax.fori_loop(first, last, body, jnp.zeros(out_ref.shape, _F32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _tgmm(lhs, dout, group_sizes, trans, interpret, out_dtype):
    """Per group g: lhs[rows_g]^T @ dout[rows_g] (K, N), or its transpose if ``trans``."""
    m, k = lhs.shape
    n = dout.shape[1]
    groups = group_sizes.shape[0]
    block_m = min(_block(m), 128) if m % 8 == 0 else 8
    block_n = _block(n)
    x, d = _pad_rows(lhs, block_m), _pad_rows(dout, block_m)
    starts, ends = _offsets(group_sizes)
    out_block, out_index = (
        ((None, block_n, k), lambda g, j: (g, j, 0))
        if trans
        else ((None, k, block_n), lambda g, j: (g, 0, j))
    )
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, block_m=block_m, trans=trans),
        grid=(groups, n // block_n),
        in_specs=[
            pl.BlockSpec((groups,), lambda g, j: (0,)),
            pl.BlockSpec((groups,), lambda g, j: (0,)),
            pl.BlockSpec((x.shape[0], k), lambda g, j: (0, 0)),
            pl.BlockSpec((x.shape[0], block_n), lambda g, j: (0, j)),
        ],
        out_specs=pl.BlockSpec(out_block, out_index),
        out_shape=jax.ShapeDtypeStruct((groups, n, k) if trans else (groups, k, n), out_dtype),
        interpret=interpret,
        compiler_params=compiler_params(),
        name="torchjax_ragged_dot_tgmm",
    )(starts, ends, x, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ragged(lhs, rhs, group_sizes, trans, interpret):
    return _gmm(lhs, rhs, group_sizes, trans, interpret)


def _ragged_fwd(lhs, rhs, group_sizes, trans, interpret):
    return _gmm(lhs, rhs, group_sizes, trans, interpret), (lhs, rhs, group_sizes)


def _ragged_bwd(trans, interpret, res, dout):
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)
    dlhs = _gmm(dout, rhs, group_sizes, not trans, interpret)
    drhs = _tgmm(lhs, dout, group_sizes, trans, interpret, rhs.dtype)
    return dlhs, drhs, None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def ragged_dot(lhs, rhs, group_sizes, *, transpose_rhs: bool = False, interpret=None):
    """Grouped matmul with the Pallas kernels: ``jax.lax.ragged_dot`` semantics.

    Args:
        lhs: (M, K) float32/bfloat16/float16, rows sorted by group.
        rhs: (G, K, N), or (G, N, K) with ``transpose_rhs=True`` (the layout of
            ``nn.Linear``-style expert weights, used without a transposed copy).
        group_sizes: (G,) integer, rows per group; ``sum <= M``.
        transpose_rhs: see ``rhs``.
        interpret: Pallas interpret mode; default on CPU only.

    Returns:
        (M, N) in ``lhs``'s dtype, accumulated in float32; rows past
        ``sum(group_sizes)`` are 0. Differentiable in ``lhs`` and ``rhs``.

    Raises:
        ValueError: mismatched shapes or dtypes.
    """
    from torchjax.pallas._op import interpret_default

    g = rhs.shape[0]
    k_rhs = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    if lhs.ndim != 2 or rhs.ndim != 3 or k_rhs != lhs.shape[1] or group_sizes.shape != (g,):
        raise ValueError(
            "torchjax.pallas.ragged_dot: expected lhs (M, K), rhs "
            f"{'(G, N, K)' if transpose_rhs else '(G, K, N)'}, group_sizes (G,); got "
            f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}"
        )
    if lhs.dtype != rhs.dtype:
        raise ValueError(
            f"torchjax.pallas.ragged_dot: lhs and rhs dtypes differ ({lhs.dtype} vs "
            f"{rhs.dtype}); cast one first"
        )
    interpret = interpret_default() if interpret is None else interpret
    return _ragged(lhs, rhs, group_sizes.astype(jnp.int32), transpose_rhs, interpret)


def ragged_dot_reference(lhs, rhs, group_sizes, *, transpose_rhs: bool = False):
    """The reference: ``jax.lax.ragged_dot`` (rhs transposed first when asked)."""
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    return lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32))
