"""Linear algebra, the LDL family: ``linalg_ldl_factor_ex`` and ``linalg_ldl_solve``, the
Bunch-Kaufman factorization of a symmetric (or Hermitian) indefinite matrix in LAPACK's
``sytrf``/``hetrf`` output format, and the solve from it (``sytrs``/``hetrs``).
Registered with ops/linalg.py's ``_checked`` (torch's meta checks first).

Note [LDL in LAPACK's format]
torch returns what LAPACK's ``?sytrf(uplo='L')`` writes: ``A = L D L^T`` (``L^H`` when
``hermitian``) with ``L = P(1) L(1) ... P(k) L(k)``, each ``P(i)`` one row interchange and
``D`` block diagonal with 1x1 and 2x2 blocks. The output packs ``D`` on the diagonal (and
first subdiagonal for a 2x2 block) and the multipliers of ``L`` below it; torch zeroes the
upper triangle. ``pivots`` are 1-based: ``ipiv[k] = kp + 1`` for a 1x1 block that swapped
rows k and kp, ``ipiv[k] = ipiv[k + 1] = -(kp + 1)`` for a 2x2 block that swapped rows
k + 1 and kp. Earlier columns are not permuted by later interchanges (unlike getrf), so the
format is only readable by a solve that replays the steps. jax has no such factorization,
so this is LAPACK's unblocked ``?sytf2``/``?hetf2`` step by step (Bunch-Kaufman partial
pivoting, alpha = (1 + sqrt(17)) / 8, the first largest element as ``i?amax`` picks it,
``|re| + |im|`` for complex), one ``lax.while_loop`` iteration per pivot block, so the
pivot choices and the packed values are LAPACK's. For matrices larger than LAPACK's block
size (64) ``?sytrf`` uses the blocked ``?lasyf``, whose choices are the same in exact
arithmetic; rounding may differ there. The step works on the whole matrix with masks (a
traced ``k`` cannot slice), O(n^3) per factorization like LAPACK, but without blocking.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.ops.linalg import _broadcast_batch, _checked, _require_info

aten = torch.ops.aten

_ALPHA = (1 + np.sqrt(17.0)) / 8


def _cabs1(x):
    # LAPACK's i?amax on complex data compares |re| + |im|, not the modulus
    return jnp.abs(x.real) + jnp.abs(x.imag) if jnp.iscomplexobj(x) else jnp.abs(x)


def _conj(x, hermitian):
    return jnp.conj(x) if hermitian else x


def _diag_abs(x, hermitian):
    return jnp.abs(x.real) if hermitian else _cabs1(x)


def _pivot(a, k, idx, hermitian):
    """The Bunch-Kaufman choice at column k: (kp, kstep, zero column?)."""
    n = a.shape[-1]
    absakk = _diag_abs(a[k, k], hermitian)
    col = jnp.where(idx > k, _cabs1(a[:, k]), -1)
    imax = jnp.argmax(col)
    colmax = jnp.where(k < n - 1, col[imax], 0)
    zero = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
    row = jnp.where((idx >= k) & (idx < imax), _cabs1(a[imax, :]), -1)
    below = jnp.where(idx > imax, _cabs1(a[:, imax]), -1)
    rowmax = jnp.maximum(jnp.max(row), jnp.max(below))
    one_k = zero | (absakk >= _ALPHA * colmax) | (absakk >= _ALPHA * colmax * (colmax / rowmax))
    one_imax = _diag_abs(a[imax, imax], hermitian) >= _ALPHA * rowmax
    kp = jnp.where(one_k, k, imax)
    kstep = jnp.where(one_k | one_imax, 1, 2)
    return kp, kstep, zero


def _interchange(a, k, kk, kp, idx, hermitian):
    """Swap rows and columns kk and kp of the trailing matrix a[k:, k:] (lower storage)."""
    lower = idx[:, None] >= idx[None, :]
    full = jnp.where(lower, a, _conj(a.T, hermitian))
    perm = jnp.where(idx == kk, kp, jnp.where(idx == kp, kk, idx))
    swapped = full[perm][:, perm]
    trailing = (idx[:, None] >= k) & (idx[None, :] >= k) & lower
    return jnp.where(trailing, swapped, a)


def _update_1x1(a, k, idx, hermitian):
    d = a[k, k].real if hermitian else a[k, k]
    r1 = 1 / d
    x = jnp.where(idx > k, a[:, k], 0)
    rest = (idx[:, None] > k) & (idx[None, :] > k) & (idx[:, None] >= idx[None, :])
    a = jnp.where(rest, a + x[:, None] * (-r1 * _conj(x, hermitian))[None, :], a)
    return a.at[:, k].set(jnp.where(idx > k, x * r1, a[:, k]))


def _update_2x2(a, k, idx, hermitian):
    below = idx > k + 1
    xk, xk1 = jnp.where(below, a[:, k], 0), jnp.where(below, a[:, k + 1], 0)
    if hermitian:
        d = jnp.abs(a[k + 1, k])
        d11, d22 = a[k + 1, k + 1].real / d, a[k, k].real / d
        d21 = a[k + 1, k] / d
        d = (1 / (d11 * d22 - 1)) / d
        wk = d * (d11 * xk - d21 * xk1)
        wkp1 = d * (d22 * xk1 - jnp.conj(d21) * xk)
    else:
        d21 = a[k + 1, k]
        d11, d22 = a[k + 1, k + 1] / d21, a[k, k] / d21
        d21 = (1 / (d11 * d22 - 1)) / d21
        wk = d21 * (d11 * xk - xk1)
        wkp1 = d21 * (d22 * xk1 - xk)
    rest = below[:, None] & below[None, :] & (idx[:, None] >= idx[None, :])
    upd = (
        a
        - xk[:, None] * _conj(wk, hermitian)[None, :]
        - xk1[:, None] * _conj(wkp1, hermitian)[None, :]
    )
    a = jnp.where(rest, upd, a)
    a = a.at[:, k].set(jnp.where(below, wk, a[:, k]))
    return a.at[:, k + 1].set(jnp.where(below, wkp1, a[:, k + 1]))


def _sytf2(a, hermitian):
    n = a.shape[-1]
    idx = jnp.arange(n)
    if hermitian:  # hetf2 reads only the real part of the diagonal and keeps it real
        a = jnp.where(jnp.eye(n, dtype=bool), a.real.astype(a.dtype), a)

    def body(carry):
        k, a, ipiv, info = carry
        kp, kstep, zero = _pivot(a, k, idx, hermitian)
        kk = k + kstep - 1
        a = jnp.where(kp != kk, _interchange(a, k, kk, kp, idx, hermitian), a)
        updated = lax.cond(
            kstep == 1,
            lambda a: _update_1x1(a, k, idx, hermitian),
            lambda a: _update_2x2(a, k, idx, hermitian),
            a,
        )
        a = jnp.where(zero, a, updated)
        code = jnp.where(kstep == 1, kp + 1, -(kp + 1)).astype(jnp.int32)
        ipiv = jnp.where((idx == k) | ((idx == k + 1) & (kstep == 2)), code, ipiv)
        info = jnp.where((info == 0) & zero, k + 1, info).astype(jnp.int32)
        return k + kstep, a, ipiv, info

    init = (jnp.int32(0), a, jnp.zeros(n, jnp.int32), jnp.int32(0))
    _, a, ipiv, info = lax.while_loop(lambda c: c[0] < n, body, init)
    return jnp.tril(a), ipiv, info


@_checked(aten.linalg_ldl_factor_ex)
def linalg_ldl_factor_ex(self, *, hermitian=False, check_errors=False):
    """aten::linalg_ldl_factor_ex - Bunch-Kaufman LDL of a symmetric (``hermitian``:
    Hermitian) matrix from its lower triangle, in LAPACK's packed format (Note [LDL in
    LAPACK's format]). Shapes: (*, n, n) -> LD (*, n, n), pivots (*, n) int32, info (*)
    int32: 1 + the first zero pivot's index, 0 if none. Reference: torch.linalg.ldl_factor_ex.
    """
    n = self.shape[-1]
    batch = self.shape[:-2]
    if n == 0:
        return self, jnp.zeros(batch + (0,), jnp.int32), jnp.zeros(batch, jnp.int32)
    fn = lambda a: _sytf2(a, hermitian)  # noqa: E731
    for _ in batch:
        fn = jax.vmap(fn)
    ld, pivots, info = fn(self)
    if check_errors:
        _require_info(info, "torch.linalg.ldl_factor_ex", self.ndim == 2)
    return ld, pivots, info


def _swap_rows(b, i, j):
    bi, bj = b[i], b[j]
    return b.at[i].set(bj).at[j].set(bi)


def _sytrs(ld, ipiv, b, hermitian):
    """Solve A X = B from ``?sytrf``'s output, as LAPACK's ``?sytrs``/``?hetrs``."""
    n = ld.shape[-1]
    idx = jnp.arange(n)
    diag = (lambda x: x.real) if hermitian else (lambda x: x)

    def forward(carry):  # L D Y = B, steps k = 0, 1, ...
        k, b = carry
        two = ipiv[k] < 0

        def one(b):
            b = _swap_rows(b, k, ipiv[k] - 1)
            b = b - jnp.where(idx > k, ld[:, k], 0)[:, None] * b[k][None, :]
            return b.at[k].multiply(1 / diag(ld[k, k]))

        def pair(b):
            b = _swap_rows(b, k + 1, -ipiv[k] - 1)
            below = idx > k + 1
            b = b - jnp.where(below, ld[:, k], 0)[:, None] * b[k][None, :]
            b = b - jnp.where(below, ld[:, k + 1], 0)[:, None] * b[k + 1][None, :]
            akm1k = ld[k + 1, k]
            akm1 = ld[k, k] / _conj(akm1k, hermitian)
            ak = ld[k + 1, k + 1] / akm1k
            denom = akm1 * ak - 1
            bkm1, bk = b[k] / _conj(akm1k, hermitian), b[k + 1] / akm1k
            return b.at[k].set((ak * bkm1 - bk) / denom).at[k + 1].set((akm1 * bk - bkm1) / denom)

        return k + jnp.where(two, 2, 1), lax.cond(two, pair, one, b)

    def backward(carry):  # L^T X = Y (L^H), steps k = n - 1, n - 2, ...
        k, b = carry
        two = ipiv[k] < 0

        def dot(j, b):
            col = jnp.where(idx > k, _conj(ld[:, j], hermitian), 0)
            return b.at[j].add(-(col[:, None] * b).sum(0))

        def one(b):
            return _swap_rows(dot(k, b), k, ipiv[k] - 1)

        def pair(b):
            return _swap_rows(dot(k - 1, dot(k, b)), k, -ipiv[k] - 1)

        return k - jnp.where(two, 2, 1), lax.cond(two, pair, one, b)

    _, b = lax.while_loop(lambda c: c[0] < n, forward, (jnp.int32(0), b))
    _, b = lax.while_loop(lambda c: c[0] >= 0, backward, (jnp.int32(n - 1), b))
    return b


@_checked(aten.linalg_ldl_solve)
def linalg_ldl_solve(LD, pivots, B, *, hermitian=False):
    """aten::linalg_ldl_solve - solve A X = B from ``linalg_ldl_factor``'s LD and pivots
    (Note [LDL in LAPACK's format]). Shapes: LD (*, n, n), pivots (*, n), B (*, n, k);
    batch dims broadcast. Reference: torch.linalg.ldl_solve."""
    ld, b = _broadcast_batch(LD, B)
    if ld.shape[-1] == 0 or b.shape[-1] == 0:
        return b
    ipiv = jnp.broadcast_to(pivots, ld.shape[:-1])
    fn = lambda ld, p, b: _sytrs(ld, p, b, hermitian)  # noqa: E731
    for _ in ld.shape[:-2]:
        fn = jax.vmap(fn)
    return fn(ld, ipiv, b)
