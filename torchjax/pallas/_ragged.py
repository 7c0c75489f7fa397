"""Ragged dot (grouped matmul) for Mixture-of-Experts: Pallas kernels and the reference.

``ragged_dot(lhs, rhs, group_sizes)`` multiplies consecutive row groups of ``lhs`` (the
tokens routed to each expert, sorted by expert) by that group's ``rhs`` matrix, like
``jax.lax.ragged_dot``. Rows past ``sum(group_sizes)`` are 0.

Kernels: ``gmm`` (forward, and ``dlhs`` = ``dout`` times each group's transposed
matrix) and ``tgmm`` (``drhs``, one matrix per group: ``lhs[rows_g]^T @ dout[rows_g]``),
both tiled over m, k and n, in two forms (Note [Kernel platforms] in
torchjax/pallas/_tiling.py): on TPU and in interpret mode a grid over a (row tile, group)
visit schedule read through scalar prefetch, the k reduction in the grid and f32 scratch
(Note [Ragged dot visit schedule], torchjax/pallas/_ragged_grid.py); on GPU a loop form
(torchjax/pallas/_ragged_loop.py). Either way a program holds one tile of each operand,
whatever the number of experts or their size. Block sizes come from the platform's
table. Backward: ``jax.custom_vjp`` with both kernels; ``group_sizes`` gets no gradient.

Interpret mode on CPU is tested against ``jax.lax.ragged_dot``; the Triton (GPU) and
Mosaic (TPU) lowerings by cross-platform lowering; compiled runs on GPU/TPU are
unverified here (no hardware).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from torchjax.pallas import _ragged_grid, _ragged_loop, _tiling

_I32 = jnp.int32


def schedule(group_sizes, tiles_m: int, block_m: int):
    """The visit schedule of Note [Ragged dot visit schedule]: int32 arrays ``(offsets
    (G + 1,), tiles (T,), groups (T,), firsts (T,), valids (T,), group_firsts (T,))``
    with ``T = tiles_m + G - 1``; ``firsts`` marks a row tile's first visit,
    ``group_firsts`` a group's."""
    sizes = group_sizes.astype(_I32)
    n_groups = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    lo = jnp.arange(tiles_m, dtype=_I32) * block_m
    # Groups meeting row tile i: end > lo and start < lo + block_m, a contiguous range.
    g_first = jnp.searchsorted(ends, lo, side="right").astype(_I32)
    g_last = jnp.searchsorted(starts, lo + block_m, side="left").astype(_I32) - 1
    counts = jnp.maximum(g_last - g_first + 1, 1)  # a tile past the rows: one visit
    visit_end = jnp.cumsum(counts)
    visit_start = visit_end - counts
    t = jnp.arange(tiles_m + n_groups - 1, dtype=_I32)
    tile = jnp.minimum(jnp.searchsorted(visit_end, t, side="right"), tiles_m - 1).astype(_I32)
    group = jnp.clip(g_first[tile] + t - visit_start[tile], 0, n_groups - 1)
    valid = t < visit_end[-1]
    last = visit_end[-1] - 1  # unused slots repeat the last visit (nothing fetched)
    tile = jnp.where(valid, tile, tile[last])
    group = jnp.where(valid, group, group[last])
    firsts = t == visit_start[tile]
    previous = jnp.concatenate([jnp.full((1,), -1, _I32), group[:-1]])
    group_firsts = group != previous
    offsets = jnp.concatenate([jnp.zeros((1,), _I32), ends])
    as_int = [x.astype(_I32) for x in (firsts, valid, group_firsts)]
    return offsets, tile, group, as_int[0], as_int[1], as_int[2]


def _pad_rows(x, block_m):
    pad = -x.shape[0] % block_m
    return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _gmm(lhs, rhs, group_sizes, trans, blocks, interpret, plat):
    m = lhs.shape[0]
    x = _pad_rows(lhs, blocks[0])
    if plat == "gpu":
        offsets = jnp.concatenate([jnp.zeros((1,), _I32), jnp.cumsum(group_sizes)])
        out = _ragged_loop.gmm(x, rhs, offsets[:-1], offsets[1:], trans, blocks, interpret, plat)
    else:
        offsets, tiles, groups, firsts, valids, _ = schedule(
            group_sizes, x.shape[0] // blocks[0], blocks[0]
        )
        sched = (offsets, tiles, groups, firsts, valids)
        out = _ragged_grid.gmm(x, rhs, sched, trans, blocks, interpret, plat)
    return out[:m]


def _tgmm(lhs, dout, group_sizes, trans, blocks, interpret, plat, out_dtype):
    x, d = _pad_rows(lhs, blocks[0]), _pad_rows(dout, blocks[0])
    n_groups = group_sizes.shape[0]
    if plat == "gpu":
        offsets = jnp.concatenate([jnp.zeros((1,), _I32), jnp.cumsum(group_sizes)])
        return _ragged_loop.tgmm(
            x, d, offsets[:-1], offsets[1:], trans, blocks, interpret, plat, out_dtype
        )
    offsets, tiles, groups, _, valids, group_firsts = schedule(
        group_sizes, x.shape[0] // blocks[0], blocks[0]
    )
    sched = (offsets, tiles, groups, group_firsts, valids)
    out = _ragged_grid.tgmm(x, d, sched, trans, blocks, interpret, plat, out_dtype, n_groups)
    # A group without rows is never visited: its block was never written.
    return jnp.where((group_sizes > 0)[:, None, None], out, jnp.zeros((), out_dtype))


def _blocks(plat, m, k, n, blocks):
    """(block_m, block_k, block_n) for a (M, K) x (K, N) product: the caller's, or the
    platform's table fitted to the dims (M is padded to a multiple of block_m)."""
    want = blocks or _tiling.default_blocks("ragged", plat)
    # Mosaic: k and n tiles are lane dims (multiples of 128, or the whole dim); m tiles
    # sublanes, rounded to 16 rows (bfloat16 packs two per sublane). Triton: powers of two.
    tpu = plat == "tpu"
    step = 8 if blocks is not None else _tiling.LANE if tpu else 16
    block_m = min(want[0], -(-m // 16) * 16)
    if not tpu:
        block_m = min(want[0], max(16, 1 << (m - 1).bit_length()))
    block_k = _tiling.fit_block(k, want[1], step, whole=tpu or blocks is not None)
    block_n = _tiling.fit_block(n, want[2], step, whole=tpu or blocks is not None)
    if blocks is not None:  # a caller's blocks, raised to what Mosaic accepts on TPU
        block_m = _tiling.legal_block(plat, block_m, block_m, 8)
        block_k = _tiling.legal_block(plat, k, block_k, _tiling.LANE)
        block_n = _tiling.legal_block(plat, n, block_n, _tiling.LANE)
    return block_m, block_k, block_n


# Note [Ragged dot parts by platform]
# Each part of a ragged dot (the forward, ``dlhs``, ``drhs``) runs the faster of the
# Pallas kernel and XLA's ``lax.ragged_dot`` (itself a Mosaic kernel on TPU), as measured
# on the chip: a v5e, bfloat16, at (M, K, N, groups) = (8192, 2048, 1024, 64),
# (16384, 2048, 768, 128) and (8192, 4096, 14336, 8), in ms:
#   forward  lax 1.39 / 1.98 / 9.02     Pallas 1.80 / 3.13 / 10.52
#   dlhs     lax 2.22 / 3.25 / 26.27    Pallas 1.90 / 2.85 / 10.66
#   drhs     lax 1.35 / 1.70 / 10.64    Pallas 2.80 / 4.49 / 15.29
# Half precision only: the measured rows are bfloat16, and a float32 ``lax.ragged_dot``
# would need HIGHEST precision, which Mosaic refuses for half operands and was not run
# for float32 (Note [Kernel matmul precision]). Platforms and dtypes not listed run
# every part with the Pallas kernels. XLA's parts trace in 32-bit mode, as the kernels
# do (Note [Kernels trace in 32-bit mode]).
XLA_PARTS = {"tpu": frozenset({"fwd", "drhs"})}
_HALF = (jnp.bfloat16, jnp.float16)


# Note [Rows past the groups under XLA's ragged dot]
# ``lax.ragged_dot`` on TPU leaves the output rows past ``sum(group_sizes)`` as they were
# in memory, not 0: on a v5e, 1000 of 1024 rows in groups, all 24 rows past them held
# nonzero values in float32 and bfloat16 alike (XLA:CPU writes zeros). This op promises
# zeros there (a MoE layer's pairs routed past the experts are summed with their
# weights), so XLA's forward is masked to the grouped rows, and XLA's ``drhs`` reads a
# cotangent masked the same way, so no row outside the groups reaches a gradient.
def _grouped_rows(x, group_sizes):
    rows = lax.broadcasted_iota(_I32, (x.shape[0], 1), 0)
    return jnp.where(rows < jnp.sum(group_sizes.astype(_I32)), x, jnp.zeros((), x.dtype))


def _xla_fwd(lhs, rhs, group_sizes, trans):
    with jax.enable_x64(False):
        out = ragged_dot_reference(lhs, rhs, group_sizes, transpose_rhs=trans)
        return _grouped_rows(out, group_sizes)


def _xla_drhs(lhs, dout, group_sizes, trans, rhs_shape):
    """``drhs`` by XLA's own transpose of ``lax.ragged_dot`` (its forward is unused)."""
    g, kk, n = rhs_shape if not trans else (rhs_shape[0], rhs_shape[2], rhs_shape[1])
    sizes = group_sizes.astype(_I32)
    with jax.enable_x64(False):
        dout = _grouped_rows(dout, sizes)
        w = jnp.zeros((g, kk, n), lhs.dtype)
        _, vjp = jax.vjp(lambda w: lax.ragged_dot(lhs, w, sizes), w)
        (drhs,) = vjp(dout)
    return jnp.swapaxes(drhs, 1, 2) if trans else drhs


def _forward(lhs, rhs, group_sizes, trans, blocks, interpret, plat, xla_parts):
    if "fwd" in xla_parts:
        return _xla_fwd(lhs, rhs, group_sizes, trans)
    return _gmm(lhs, rhs, group_sizes, trans, blocks, interpret, plat)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _ragged(lhs, rhs, group_sizes, trans, blocks, interpret, plat, xla_parts):
    return _forward(lhs, rhs, group_sizes, trans, blocks, interpret, plat, xla_parts)


def _ragged_fwd(lhs, rhs, group_sizes, trans, blocks, interpret, plat, xla_parts):
    out = _forward(lhs, rhs, group_sizes, trans, blocks, interpret, plat, xla_parts)
    return out, (lhs, rhs, group_sizes)


def _ragged_bwd(trans, blocks, interpret, plat, xla_parts, res, dout):
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)
    block_m, block_k, block_n = blocks
    # dlhs (M, K) = dout (M, N) x rhs^T: the forward's k and n tiles swap roles.
    dlhs = _gmm(dout, rhs, group_sizes, not trans, (block_m, block_n, block_k), interpret, plat)
    if "drhs" in xla_parts:
        drhs = _xla_drhs(lhs, dout, group_sizes, trans, rhs.shape)
    else:
        drhs = _tgmm(lhs, dout, group_sizes, trans, blocks, interpret, plat, rhs.dtype)
    return dlhs, drhs, None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def ragged_dot(lhs, rhs, group_sizes, *, transpose_rhs: bool = False, blocks=None, interpret=None):
    """Grouped matmul with the Pallas kernels (on TPU, in half precision, the forward and
    ``drhs`` are XLA's: Note [Ragged dot parts by platform]): ``jax.lax.ragged_dot``
    semantics.

    Args:
        lhs: (M, K) float32/bfloat16/float16 (float64: XLA's ragged_dot, no kernel),
            rows sorted by group.
        rhs: (G, K, N), or (G, N, K) with ``transpose_rhs=True`` (the layout of
            ``nn.Linear``-style expert weights, used without a transposed copy).
        group_sizes: (G,) integer, rows per group; ``sum <= M``.
        transpose_rhs: see ``rhs``.
        blocks: ``(block_m, block_k, block_n)`` wanted (each fitted to its dim); default:
            the platform's table in torchjax/pallas/_tiling.py.
        interpret: Pallas interpret mode; default on CPU only.

    Returns:
        (M, N) in ``lhs``'s dtype, accumulated in float32; rows past
        ``sum(group_sizes)`` are 0. Differentiable in ``lhs`` and ``rhs``.

    Raises:
        ValueError: mismatched shapes or dtypes, or a dtype other than these.
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
    if lhs.dtype == jnp.float64:
        # The kernels' platforms have no float64 products (Mosaic, Triton): XLA computes
        # it (Note [float64 ragged dot]).
        form = FLOAT64_FORMS.get(jax.default_backend(), ragged_dot_reference)
        return form(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)
    if lhs.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"torchjax.pallas.ragged_dot: lhs and rhs are {lhs.dtype}; the kernels take "
            "float32, bfloat16 or float16 (float64 runs XLA's ragged_dot)"
        )
    interpret = interpret_default() if interpret is None else interpret
    plat = _tiling.platform(interpret)
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    fitted = _blocks(plat, lhs.shape[0], lhs.shape[1], n, blocks)
    xla_parts = XLA_PARTS.get(plat, frozenset()) if lhs.dtype in _HALF else frozenset()
    return _ragged(
        lhs, rhs, group_sizes.astype(_I32), transpose_rhs, fitted, interpret, plat, xla_parts
    )


def ragged_dot_reference(lhs, rhs, group_sizes, *, transpose_rhs: bool = False):
    """The reference: ``jax.lax.ragged_dot`` (rhs transposed first when asked)."""
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    precision = _tiling.precision_of(lhs, rhs)
    return lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), precision=precision)


def ragged_dot_by_groups(lhs, rhs, group_sizes, *, transpose_rhs: bool = False):
    """``ragged_dot`` as one dense product per group, each row kept by the group it
    belongs to (rows past ``sum(group_sizes)`` belong to none: zeros, as ragged_dot):
    G times the FLOPs, made of plain dots every XLA backend has."""
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    group = jnp.searchsorted(ends, jnp.arange(lhs.shape[0], dtype=jnp.int32), side="right")
    precision = _tiling.precision_of(lhs, rhs)

    def one(acc, g_rhs):
        g, w = g_rhs
        part = jnp.dot(lhs, w, precision=precision, preferred_element_type=lhs.dtype)
        return acc + jnp.where((group == g)[:, None], part, 0), None

    init = jnp.zeros((lhs.shape[0], rhs.shape[2]), lhs.dtype)
    out, _ = lax.scan(one, init, (jnp.arange(rhs.shape[0], dtype=jnp.int32), rhs))
    return out


# Note [float64 ragged dot]
# No kernel has float64 products, so a float64 ragged dot is XLA's ``lax.ragged_dot``,
# except where XLA lacks it: XLA:TPU emulates float64 by rewriting each op into float32
# pairs, and has no rewrite for ragged-dot ("UNIMPLEMENTED: While rewriting computation
# to not contain X64 element types ... ragged-dot", seen on a v5e). There it is one
# dense product per group (:func:`ragged_dot_by_groups`, tested on CPU against torch).
# The platforms whose float64 ragged dot is not ``lax.ragged_dot``:
FLOAT64_FORMS = {"tpu": ragged_dot_by_groups}
