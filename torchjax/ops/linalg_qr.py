"""Linear algebra, the QR family: Householder QR (``linalg_qr``, ``geqrf``), products with
the Householder reflectors (``linalg_householder_product``, ``ormqr``) and least squares
(``linalg_lstsq``, by SVD). Registered with ops/linalg.py's ``_checked`` (torch's meta
checks first); the module docstring there says how checks and errors follow torch.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from torchjax.ops import layouts
from torchjax.ops.linalg import _checked, _concrete, _empty, _matmul, _mH, _mT
from torchjax.ops.linalg_results import column_major_plan
from torchjax.tensor._tensor import view_of, wrap

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------
# QR and Householder


@_checked(aten.linalg_qr)
def linalg_qr(A, mode="reduced"):
    """aten::linalg_qr - Householder QR. ``mode``: reduced, complete, or r (Q is then an
    empty tensor, as torch). Reference: torch.linalg.qr."""
    if mode == "r":
        return _empty(A.dtype), jnp.linalg.qr(A, mode="r")
    q, r = jnp.linalg.qr(A, mode=mode)
    return q, r


@_checked(aten.geqrf, meta=False, column_major=(0,))
def geqrf(self):
    """aten::geqrf - LAPACK geqrf: R and the Householder reflectors packed in one matrix,
    plus tau (*, min(m, n)). Reference: torch.geqrf."""
    # numpy's "raw" mode is LAPACK's output in Fortran order, hence the transpose.
    h, tau = jnp.linalg.qr(self, mode="raw")
    return _mT(h), tau


@_checked(aten.linalg_householder_product)
def linalg_householder_product(input, tau):
    """aten::linalg_householder_product - the first n columns of H_1 ... H_k (LAPACK
    orgqr). Reference: torch.linalg.householder_product."""
    return lax.linalg.householder_product(input, tau)


@_checked(aten.ormqr)
def ormqr(self, input2, input3, left=True, transpose=False):
    """aten::ormqr - multiply ``input3`` by Q (or Q^H with ``transpose``) given as
    Householder reflectors ``self`` and ``input2`` (LAPACK ormqr). Q is formed in full by
    padding the reflectors with zero ones (tau = 0 is the identity reflector).
    Reference: torch.ormqr."""
    order = input3.shape[-2] if left else input3.shape[-1]
    k = input2.shape[-1]
    refl = self[..., :, :k]
    refl = jnp.concatenate(
        [refl, jnp.zeros(refl.shape[:-1] + (order - k,), dtype=refl.dtype)], axis=-1
    )
    taus = jnp.concatenate(
        [input2, jnp.zeros(input2.shape[:-1] + (order - k,), dtype=input2.dtype)], axis=-1
    )
    q = lax.linalg.householder_product(refl, taus)
    if transpose:
        q = _mH(q)
    return _matmul(q, input3) if left else _matmul(input3, q)


# ---------------------------------------------------------------------------------------
# least squares


def _lstsq_post(result, args, kwargs):
    # residuals exist only when every matrix has full rank: a data-dependent shape, so
    # decided here in eager (under tracing they are kept).
    x, residuals, rank, s = result
    n = args[0].shape[-1]
    r = rank._value()
    if residuals.numel() and rank.numel() and _concrete(r) and not bool(jnp.all(r == n)):
        residuals = wrap(_empty(residuals._value().dtype), residuals._device_index)
    m = args[0].shape[-2]
    if m > n and x.dim() == args[0].dim() and x.numel():
        x = _in_lapacks_buffer(x, m)
    return x, residuals, rank, s


def _in_lapacks_buffer(x, m):
    """``x`` (..., n, k) as CPU returns a solution of a tall system: the first n rows of
    the column-major (..., m, k) buffer LAPACK solved in (strides (1, m) for a matrix;
    Note [LAPACK's column-major results] in ops/linalg_results.py). The rows past n, which
    LAPACK leaves holding residual terms, are zeros here; only ``as_strided`` or the
    storage reaches them."""
    arr = x._value()
    pad = jnp.zeros(arr.shape[:-2] + (m - arr.shape[-2], arr.shape[-1]), arr.dtype)
    full = wrap(jnp.concatenate([arr, pad], axis=-2), x._device_index)
    full = layouts.apply_layout(full, column_major_plan(full._size))
    return view_of(full, x._size, full._stride, 0)


@_checked(aten.linalg_lstsq, meta=False, post=_lstsq_post, column_major=(0,))
def linalg_lstsq(self, b, rcond=None, *, driver=None):
    """aten::linalg_lstsq - least-squares solution of A X = B, computed by SVD.

    Returns (solution, residuals, rank, singular_values) with CPU torch's shapes per
    ``driver`` (default gelsy): rank (A's batch, int64) unless gels; singular_values only
    for gelsd/gelss; residuals (squared column norms of B - A X) only when m > n, driver
    is not gelsy and every matrix has full rank (else an empty tensor). rcond defaults to
    eps * max(m, n). Reference: torch.linalg.lstsq; ATen linalg_lstsq_out."""
    # torch's checks (meta has no kernel to make them).
    if self.ndim < 2:
        raise RuntimeError("torch.linalg.lstsq: input must have at least 2 dimensions.")
    if b.ndim < 1:
        raise RuntimeError("torch.linalg.lstsq: other must have at least 1 dimension.")
    driver = driver or "gelsy"
    m, n = self.shape[-2:]
    vector = b.ndim == self.ndim - 1
    bb = b[..., None] if vector else b
    real = jnp.finfo(self.dtype).dtype
    if rcond is None or rcond < 0:
        rcond = jnp.finfo(real).eps * max(m, n)
    u, s, vh = jnp.linalg.svd(self, full_matrices=False)
    cutoff = rcond * s[..., :1] if s.shape[-1] else s[..., :1]
    keep = s > cutoff
    rank = jnp.sum(keep, -1).astype(jnp.int64)
    s_inv = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0).astype(self.dtype)
    x = _matmul(_mH(vh) * s_inv[..., None, :], _matmul(_mH(u), bb))
    residuals = _empty(real)
    if m > n and driver != "gelsy":
        residuals = jnp.sum(jnp.abs(bb - _matmul(self, x)) ** 2, axis=-2).astype(real)
    if vector:
        x = x[..., 0]
    return (
        x,
        residuals,
        rank if driver != "gels" else _empty(jnp.int64),
        s.astype(real) if driver in ("gelsd", "gelss") else _empty(real),
    )
