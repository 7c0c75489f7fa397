"""Linear algebra: the factorizations and solvers every ``torch.linalg.*`` function reaches,
lowered to ``jax.lax.linalg`` / ``jax.numpy.linalg``.

Most of ``torch.linalg`` (``det``, ``inv``, ``solve``, ``svd``, ``pinv``, ``matrix_rank``,
``norm``, ``cond``, ``tensorsolve``...) is CompositeImplicitAutograd: it reaches us as a
handful of core ops (``linalg_lu_factor_ex``, ``_linalg_svd``, ``_linalg_eigh``,
``_linalg_det``, ``_linalg_solve_ex``...) plus ``_linalg_check_errors``. Backward formulas
are torch's own and call the same ops.

Checks: each lowering first runs the op on meta tensors (``_checked``), which raises torch's
own shape/dtype errors ("linalg.solve: Incompatible shapes of A and B ...") before any jax
work. Numerical failures follow torch: the ``_ex`` ops return LAPACK-style ``info`` codes
(1-based index of the first zero pivot of U; order of the first non-positive-definite
leading minor for Cholesky) and ``_linalg_check_errors`` turns a nonzero code into torch's
``LinAlgError`` naming the public function ("linalg.inv: The diagonal element 2 is zero").
CPU and CUDA read ``info`` back on the host and raise at the op, so these checks (and the
ones torch's kernels make themselves: the ``_ex`` ops with ``check_errors=True``,
``cholesky_inverse``'s zero diagonal, ``_linalg_svd`` of a matrix holding NaN) are device
checks made at the op (``_require_info``; Note [Device-side checks] in
torchjax/device/_checks.py): eager raises at the op, ``torchjax.jit`` and
``torch.compile(backend="tpu")`` when the call returns, with torch's exception and text.

Pivots are LAPACK's: 1-based int32 row swaps, so torch's ``pivots`` is jax's plus one.

Note [LU of the transpose]
For contiguous real ``A``, ATen's ``_linalg_det``/``_linalg_slogdet`` factor ``A^T`` (it
saves a copy into LAPACK's column-major layout) and their backward formulas call
``linalg_lu_solve(LU, pivots, ..., adjoint=!use_A_T)`` on that factor. The ``LU`` we return
must be the same factorization, so the handler reads ``A``'s contiguity at the torch level
and passes ``use_A_T`` to the lowering. (``_linalg_solve_ex`` factors ``A`` itself.)

The QR family is in ops/linalg_qr.py, the LDL family (LAPACK's Bunch-Kaufman ``sytrf``
replayed step by step) in ops/linalg_ldl.py. ``linalg_eig`` uses ``jnp.linalg.eig``,
which XLA implements on CPU only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torchjax._compat.torch import OpOverload, pytree
from torchjax.device import _checks
from torchjax.ops import writeback
from torchjax.ops.linalg_results import (
    CHECK_ERRORS,
    cpu_layout,
    raise_cpus_refusal,
)
from torchjax.ops.registry import functional_handler, handler, lowering
from torchjax.ops.schema import arg

aten = torch.ops.aten

HIGHEST = lax.Precision.HIGHEST


# ---------------------------------------------------------------------------------------
# registration: torch's meta checks, then the lowering


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _checked(op, *, meta=True, use_A_T=None, post=None, column_major=(), out_as_result=True):
    """Register ``fn`` as the lowering of ``op.default`` behind torch's meta kernel (its
    input checks and error messages). ``out=`` overloads derive from it as usual.
    ``use_A_T`` names the matrix argument whose layout decides Note [LU of the transpose].
    ``post(result, args, kwargs)`` runs on the torch-level result: the registry may run
    ``fn`` traced (Note [Compiled lowerings]), so checks that read values live there.
    Results take the strides CPU gives them (Note [LAPACK's column-major results] in
    ops/linalg_results.py): the meta kernel's, or column-major for the results at the
    indices in ``column_major``;
    an out= tensor CPU resizes takes them too unless ``out_as_result`` is False (a CPU
    kernel that resizes its out and copies the result into it). A call the meta kernel
    refuses raises CPU's exception for it (Note [Linalg refusals in CPU's words] in
    ops/linalg_results.py)."""

    def deco(fn):
        func = op if isinstance(op, OpOverload) else op.default
        lowered = functional_handler(func, fn)
        if out_as_result:
            writeback.RESIZED_AS_RESULT.add(func._opname)

        @handler(func)
        def checked(args, kwargs):
            metas = None
            if meta:
                margs = pytree.tree_map(_to_meta, args)
                mkwargs = pytree.tree_map(_to_meta, kwargs)
                try:
                    metas = func(*margs, **mkwargs)
                except CHECK_ERRORS:
                    raise_cpus_refusal(func, args, kwargs)
                    raise
            if use_A_T is not None:
                a = args[0] if args else kwargs[use_A_T]
                kwargs = {**kwargs, "use_A_T": a.is_contiguous() and not a.is_complex()}
            if meta:
                result = lowered(args, kwargs)
            else:
                try:  # the lowering makes torch's checks, or JAX refuses what torch does
                    result = lowered(args, kwargs)
                except CHECK_ERRORS:
                    raise_cpus_refusal(func, args, kwargs)
                    raise
            if post is not None:
                result = post(result, args, kwargs)
            return cpu_layout(result, metas, column_major)

        return fn

    return deco


# ---------------------------------------------------------------------------------------
# helpers


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x)) if jnp.iscomplexobj(x) else _mT(x)


def _matmul(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _broadcast_batch(a, b):
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return (
        jnp.broadcast_to(a, batch + a.shape[-2:]),
        jnp.broadcast_to(b, batch + b.shape[-2:]),
    )


def _empty(dtype):
    return jnp.zeros((0,), dtype=dtype)


def _lu(a):
    """(LU, torch pivots, row permutation, info) of ``a`` (..., m, n), partial pivoting.

    ``A = P L U`` with ``A[perm] = L U``; info is the 1-based index of the first exact
    zero on U's diagonal (LAPACK getrf), 0 if none."""
    lu, piv, perm = lax.linalg.lu(a)
    return lu, (piv + 1).astype(jnp.int32), perm, _zero_diagonal_info(lu)


def _perm_from_pivots(pivots, m):
    return lax.linalg.lu_pivots_to_permutation(pivots - 1, m)


def _tri(a, b, *, lower, left=True, adjoint=False, unit=False):
    a, b = _broadcast_batch(a, b)
    return lax.linalg.triangular_solve(
        a,
        b,
        left_side=left,
        lower=lower,
        transpose_a=adjoint,
        conjugate_a=adjoint and jnp.iscomplexobj(a),
        unit_diagonal=unit,
    )


def _lu_solve(lu, perm, b, adjoint=False):
    """Solve ``A X = B`` (or ``A^H X = B``) from ``A[perm] = L U``."""
    lu, b = _broadcast_batch(lu, b)
    perm = jnp.broadcast_to(perm, lu.shape[:-1])
    if not adjoint:
        x = jnp.take_along_axis(b, perm[..., None], axis=-2)
        x = _tri(lu, x, lower=True, unit=True)
        return _tri(lu, x, lower=False)
    x = _tri(lu, b, lower=False, adjoint=True)
    x = _tri(lu, x, lower=True, unit=True, adjoint=True)
    return jnp.take_along_axis(x, jnp.argsort(perm, axis=-1)[..., None], axis=-2)


def _unpack(lu, perm, dtype):
    m, n = lu.shape[-2:]
    k = min(m, n)
    eye = jnp.eye(m, dtype=dtype)
    p = _mT(jnp.take(eye, perm, axis=0))
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=dtype)
    upper = jnp.triu(lu[..., :k, :])
    return p, lower, upper


def _cholesky_fails(factor):
    # A factor with a non-finite diagonal failed: jax fills a failed factor with NaN on
    # CPU and GPU. On TPU XLA's own Cholesky runs, whose result XLA leaves undefined for
    # such input (the square root of a non-positive pivot is NaN; not measured on a chip).
    return ~jnp.all(jnp.isfinite(jnp.diagonal(factor, axis1=-2, axis2=-1)), -1)


def _cholesky_info(src, factor):
    """LAPACK potrf's info, traceable: 0 where ``factor`` (jax's Cholesky of ``src``, the
    lower triangle read) succeeded, else the order of the first leading minor of ``src``
    that is not positive definite. Minors of a failed matrix fail from that order on, so
    the order is bisected: a minor of order k is factored as ``src`` with everything
    outside its leading k x k block replaced by the identity (its factor is finite exactly
    when the minor's is), about log2(n) factorizations, made only when one failed."""
    n = src.shape[-1]
    failed = _cholesky_fails(factor)
    if n == 0:
        return jnp.zeros(src.shape[:-2], dtype=jnp.int32)
    idx = jnp.arange(n)
    eye = jnp.eye(n, dtype=src.dtype)

    def step(_, bounds):
        lo, hi = bounds  # the order is in [lo, hi]; the minor of order hi fails
        mid = (lo + hi) // 2
        inside = idx < mid[..., None]
        minor = jnp.where(inside[..., :, None] & inside[..., None, :], src, eye)
        fails = _cholesky_fails(lax.linalg.cholesky(minor, symmetrize_input=False))
        open_ = lo < hi
        return jnp.where(open_ & ~fails, mid + 1, lo), jnp.where(open_ & fails, mid, hi)

    def bisect():
        ones = jnp.ones(failed.shape, dtype=jnp.int32)
        _, hi = lax.fori_loop(0, n.bit_length(), step, (ones, ones * n))
        return jnp.where(failed, hi, 0).astype(jnp.int32)

    return lax.cond(jnp.any(failed), bisect, lambda: jnp.zeros(failed.shape, jnp.int32))


# ---------------------------------------------------------------------------------------
# errors


def _torch_error(api_name, is_matrix, batch, info):
    """The error torch's own CPU ``_linalg_check_errors`` raises for ``info`` in batch
    element ``batch``: its type and its text, word for word."""
    if is_matrix:
        codes = torch.tensor(info, dtype=torch.int32)
    else:
        codes = torch.zeros(batch + 1, dtype=torch.int32)
        codes[batch] = info
    try:
        aten._linalg_check_errors(codes, api_name, is_matrix=is_matrix)
    except RuntimeError as error:  # LinAlgError, or RuntimeError for lu_factor and ldl
        return error
    raise AssertionError(f"torch accepts info {info} for {api_name}")


@functools.cache
def _error_type(api_name, sample):
    return type(_torch_error(api_name, True, 0, sample))


@dataclasses.dataclass(frozen=True)
class _InfoText:
    """The message of ``_require_info`` for (batch element, info); hashable by value, so
    a check has one code per (api_name, is_matrix) (torchjax/device/_checks.py)."""

    api_name: str
    is_matrix: bool

    def __call__(self, batch, info):
        return str(_torch_error(self.api_name, self.is_matrix, batch, info))


def _require_info(info, api_name, is_matrix, sample=1):
    """Raise torch's error for the first nonzero entry of the LAPACK-style ``info`` (an
    array, flattened as torch counts batch elements), at the op: CPU and CUDA read info
    back there (Note [Device-side checks]). Under tracing the check is carried to the
    end of the compiled call. ``sample``: the sign of the codes, which picks the type."""
    flat = info.reshape(-1)
    if flat.size == 0:
        return
    first = jnp.argmax(flat != 0)
    _checks.require(
        jnp.any(flat != 0),
        (first, flat[first]),
        _error_type(api_name, sample),
        _InfoText(api_name, bool(is_matrix)),
        deferred=False,
    )


@lowering(aten._linalg_check_errors.default)
def _linalg_check_errors(info, api_name, *, is_matrix):
    """aten::_linalg_check_errors - raise torch's LinAlgError for a nonzero ``info``, with
    torch's own messages ("linalg.inv: (Batch element 1): The diagonal element 2 is zero
    ..."), at the op in eager and when a compiled call returns (``_require_info``)."""
    _require_info(info, api_name, is_matrix)


# ---------------------------------------------------------------------------------------
# LU family


@_checked(aten.linalg_lu_factor_ex)
def linalg_lu_factor_ex(A, *, pivot=True, check_errors=False):
    """aten::linalg_lu_factor_ex - packed LU with partial pivoting, LAPACK getrf style.

    Shapes: A (*, m, n) -> LU (*, m, n), pivots (*, min(m, n)) int32 1-based, info (*)
    int32. ``pivot=False`` raises as on CPU torch. Reference: torch.linalg.lu_factor_ex."""
    if not pivot:
        raise RuntimeError(
            "linalg.lu_factor: LU without pivoting is not implemented on the CPU "
            "(aten::linalg_lu_factor_ex on tpu follows CPU torch); use pivot=True"
        )
    lu, pivots, _, info = _lu(A)
    if check_errors:
        _require_info(info, "torch.linalg.lu_factor_ex", A.ndim == 2)
    return lu, pivots, info


@_checked(aten.linalg_lu)
def linalg_lu(A, *, pivot=True):
    """aten::linalg_lu - A = P L U. Shapes: P (*, m, m), L (*, m, k), U (*, k, n),
    k = min(m, n). ``pivot=False`` raises as on CPU torch. Reference: torch.linalg.lu."""
    if not pivot:
        raise RuntimeError(
            "linalg.lu_factor: LU without pivoting is not implemented on the CPU "
            "(aten::linalg_lu on tpu follows CPU torch); use pivot=True"
        )
    lu, _, perm, _ = _lu(A)
    return _unpack(lu, perm, A.dtype)


@_checked(aten.lu_unpack)
def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    """aten::lu_unpack - (P, L, U) from packed LU and 1-based pivots; a part not asked for
    is an empty tensor, as in torch. Reference: torch.lu_unpack."""
    m = LU_data.shape[-2]
    perm = _perm_from_pivots(LU_pivots, m)
    p, lower, upper = _unpack(LU_data, perm, LU_data.dtype)
    empty = _empty(LU_data.dtype)
    return (
        p if unpack_pivots else empty,
        lower if unpack_data else empty,
        upper if unpack_data else empty,
    )


@_checked(aten.linalg_lu_solve)
def linalg_lu_solve(LU, pivots, B, *, left=True, adjoint=False):
    """aten::linalg_lu_solve - solve A X = B (``left``) or X A = B from A's packed LU;
    ``adjoint`` uses A^H. Shapes: batch dims broadcast. Reference: torch.linalg.lu_solve."""
    perm = _perm_from_pivots(pivots, LU.shape[-1])
    if left:
        return _lu_solve(LU, perm, B, adjoint)
    # X A = B  <=>  A^H X^H = B^H
    return _mH(_lu_solve(LU, perm, _mH(B), not adjoint))


def _lu_maybe_transposed(A, use_A_T):
    return _lu(_mT(A) if use_A_T else A)


@_checked(aten._linalg_det, use_A_T="A")
def _linalg_det(A, use_A_T=False):
    """aten::_linalg_det - determinant, plus the LU factorization its backward uses.

    Shapes: A (*, n, n) -> det (*), LU (*, n, n), pivots (*, n) int32. The LU is of A^T
    when ATen's is (Note [LU of the transpose]). Reference: torch.linalg.det."""
    lu, pivots, _, _ = _lu_maybe_transposed(A, use_A_T)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(pivots != jnp.arange(1, pivots.shape[-1] + 1, dtype=jnp.int32), -1)
    sign = jnp.where(swaps % 2 == 1, -1, 1).astype(A.dtype)
    return sign * jnp.prod(diag, -1), lu, pivots


@_checked(aten._linalg_slogdet, use_A_T="A")
def _linalg_slogdet(A, use_A_T=False):
    """aten::_linalg_slogdet - (sign, log|det|) plus the LU its backward uses.

    Shapes: A (*, n, n) -> sign (*) A's dtype, logabsdet (*) real dtype, LU, pivots.
    A singular matrix gives sign 0 and -inf, as torch. Reference: torch.linalg.slogdet."""
    lu, pivots, _, _ = _lu_maybe_transposed(A, use_A_T)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(pivots != jnp.arange(1, pivots.shape[-1] + 1, dtype=jnp.int32), -1)
    absdiag = jnp.abs(diag)
    unit = jnp.where(absdiag == 0, 0, diag / jnp.where(absdiag == 0, 1, absdiag))
    sign = jnp.where(swaps % 2 == 1, -1, 1).astype(A.dtype) * jnp.prod(unit, -1)
    return sign, jnp.sum(jnp.log(absdiag), -1), lu, pivots


@_checked(aten._linalg_solve_ex)
def _linalg_solve_ex(A, B, *, left=True, check_errors=False):
    """aten::_linalg_solve_ex - solve A X = B (or X A = B) by LU, numpy's vector rule for B.

    Shapes: B (*, n) is a vector when it is 1-D or A's shape minus the last dim; batch dims
    broadcast. Returns (X, LU, pivots, info), LU of A itself (unlike det).
    Reference: torch.linalg.solve_ex; ATen linalg_solve_ex_out."""
    lu, pivots, perm, info = _lu(A)
    if check_errors:
        _require_info(info, "torch.linalg.solve_ex", A.ndim == 2)
    vector = B.ndim == 1 or (B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])
    b = B[..., None] if vector else B
    if left:
        x = _lu_solve(lu, perm, b)
    else:
        x = _mH(_lu_solve(lu, perm, _mH(b), adjoint=True))
    return (x[..., 0] if vector else x), lu, pivots, info


@_checked(aten.linalg_inv_ex)
def linalg_inv_ex(A, *, check_errors=False):
    """aten::linalg_inv_ex - inverse by LU; info as getrf (singular: inf/NaN entries).
    Shapes: (*, n, n) -> (*, n, n), info (*) int32. Reference: torch.linalg.inv_ex."""
    lu, _, perm, info = _lu(A)
    if check_errors:
        _require_info(info, "linalg.inv_ex", A.ndim == 2)
    eye = jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape)
    return _lu_solve(lu, perm, eye), info


# ---------------------------------------------------------------------------------------
# triangular and Cholesky


@_checked(aten.linalg_solve_triangular)
def linalg_solve_triangular(self, B, *, upper, left=True, unitriangular=False):
    """aten::linalg_solve_triangular - solve with a triangular A (the other triangle is
    ignored). Shapes: batch dims broadcast. Reference: torch.linalg.solve_triangular."""
    return _tri(self, B, lower=not upper, left=left, unit=unitriangular)


@_checked(aten.triangular_solve)
def triangular_solve(self, A, upper=True, transpose=False, unitriangular=False):
    """aten::triangular_solve - legacy: solve op(A) X = self; returns (X, A broadcast to
    the batch shape). ``transpose`` is a plain transpose, as in ATen.
    Reference: torch.triangular_solve."""
    a, b = _broadcast_batch(A, self)
    x = lax.linalg.triangular_solve(
        a, b, left_side=True, lower=not upper, transpose_a=transpose, unit_diagonal=unitriangular
    )
    return x, a


def _cholesky_src(A, upper):
    # jax reads the lower triangle; torch's upper=True reads the upper one, i.e. the
    # lower triangle of A^H, and returns U = L^H.
    return _mH(A) if upper else A


@_checked(aten.linalg_cholesky_ex)
def linalg_cholesky_ex(self, *, upper=False, check_errors=False):
    """aten::linalg_cholesky_ex - Cholesky factor of a Hermitian positive-definite matrix
    and potrf's info. On failure the factor holds NaN (LAPACK leaves a partial factor).
    Shapes: (*, n, n) -> (*, n, n), info (*) int32. Reference: torch.linalg.cholesky_ex."""
    src = _cholesky_src(self, upper)
    lower = lax.linalg.cholesky(src, symmetrize_input=False)
    info = _cholesky_info(src, lower)
    if check_errors:
        _require_info(info, "linalg.cholesky_ex", self.ndim == 2)
    return (_mH(lower) if upper else lower), info


@handler(aten.cholesky.default)
def cholesky(args, kwargs):
    """aten::cholesky - legacy Cholesky: linalg_cholesky_ex, then torch's error for a
    non-positive-definite input (named "cholesky")."""
    self, upper = args[0], arg(args, kwargs, 1, "upper", False)
    factor, info = aten.linalg_cholesky_ex.default(self, upper=upper)
    aten._linalg_check_errors.default(info, "cholesky", is_matrix=self.dim() == 2)
    return factor


def _zero_diagonal_info(a):
    # LAPACK trtri's info: 1 + the index of the first exact zero on the diagonal, 0 if none.
    diag = jnp.diagonal(a, axis1=-2, axis2=-1)
    if diag.shape[-1] == 0:
        return jnp.zeros(diag.shape[:-1], dtype=jnp.int32)
    zero = diag == 0
    return jnp.where(jnp.any(zero, -1), jnp.argmax(zero, -1) + 1, 0).astype(jnp.int32)


def _cho_solve(factor, b, upper):
    if upper:  # A = U^H U
        y = _tri(factor, b, lower=False, adjoint=True)
        return _tri(factor, y, lower=False)
    y = _tri(factor, b, lower=True)
    return _tri(factor, y, lower=True, adjoint=True)


@_checked(aten.cholesky_solve, out_as_result=False)
def cholesky_solve(self, input2, upper=False):
    """aten::cholesky_solve - solve A X = self given A's Cholesky factor ``input2``.
    Shapes: batch dims broadcast. Reference: torch.cholesky_solve."""
    return _cho_solve(input2, self, upper)


@_checked(aten.cholesky_inverse)
def cholesky_inverse(self, upper=False):
    """aten::cholesky_inverse - inverse of A from its Cholesky factor. A zero on the
    factor's diagonal raises torch's LinAlgError at the op, as LAPACK potri's info does
    on CPU. Reference: torch.cholesky_inverse."""
    _require_info(_zero_diagonal_info(self), "cholesky_inverse", self.ndim == 2)
    eye = jnp.broadcast_to(jnp.eye(self.shape[-1], dtype=self.dtype), self.shape)
    return _cho_solve(self, eye, upper)


# ---------------------------------------------------------------------------------------
# spectral: eigh, eig, svd


@_checked(aten._linalg_eigh)
def _linalg_eigh(A, UPLO="L", compute_v=True):
    """aten::_linalg_eigh - eigenvalues (ascending, real dtype) and eigenvectors of a
    Hermitian matrix, reading the ``UPLO`` triangle. Without ``compute_v`` the vectors are
    an empty tensor, as torch. Reference: torch.linalg.eigh."""
    w, v = jnp.linalg.eigh(A, UPLO=UPLO, symmetrize_input=False)
    return w, (v if compute_v else _empty(A.dtype))


@_checked(aten.linalg_eig, column_major=(1,))
def linalg_eig(self):
    """aten::linalg_eig - eigen-decomposition of a general matrix; complex outputs, unit
    eigenvectors (LAPACK geev convention on both sides). Reference: torch.linalg.eig."""
    w, v = jnp.linalg.eig(self)
    cdt = jnp.result_type(self.dtype, jnp.complex64)
    return w.astype(cdt), v.astype(cdt)


def _require_svd_finite(A):
    # LAPACK gesdd returns info -4 (its argument A is invalid) when A's largest magnitude
    # is NaN, i.e. A holds a NaN (infinities alone pass, and give NaN), and ATen raises
    # "linalg.svd: The algorithm failed to converge because the input matrix contained
    # non-finite values." for it.
    nan = jnp.any(jnp.isnan(A), axis=(-2, -1))
    _require_info(jnp.where(nan, -4, 0).astype(jnp.int32), "linalg.svd", A.ndim == 2, -4)


@_checked(aten._linalg_svd, column_major=(0, 2))
def _linalg_svd(A, full_matrices=False, compute_uv=True, *, driver=None):
    """aten::_linalg_svd - A = U diag(S) Vh, S descending in the real dtype. Without
    ``compute_uv`` U and Vh are empty tensors, as torch. A matrix holding NaN raises
    torch's LinAlgError at the op (``_require_svd_finite``). Reference: torch.linalg.svd."""
    _require_svd_finite(A)
    if not compute_uv:
        return _empty(A.dtype), jnp.linalg.svd(A, compute_uv=False), _empty(A.dtype)
    u, s, vh = jnp.linalg.svd(A, full_matrices=full_matrices)
    return u, s, vh


@_checked(aten.linalg_matrix_exp)
def linalg_matrix_exp(self):
    """aten::linalg_matrix_exp - matrix exponential (scaling and squaring with Pade; ATen
    uses Taylor, equal to float tolerance). Reference: torch.linalg.matrix_exp."""
    if self.shape[-1] == 0:
        return self
    if self.dtype in (jnp.float16, jnp.bfloat16):  # jax's expm refuses half types
        return jax.scipy.linalg.expm(self.astype(jnp.float32)).astype(self.dtype)
    return jax.scipy.linalg.expm(self)


@_checked(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(self, atol=None, rtol=None, hermitian=False):
    """aten::linalg_pinv.atol_rtol_tensor - Moore-Penrose pseudo-inverse, singular values
    below max(atol, rtol * s_max) dropped. Default rtol is eps * max(m, n), zero when a
    positive atol is given (ATen get_atol_rtol). Reference: torch.linalg.pinv."""
    m, n = self.shape[-2:]
    if self.size == 0:
        return jnp.zeros(self.shape[:-2] + (n, m), dtype=self.dtype)
    real = jnp.finfo(self.dtype).dtype
    default_rtol = jnp.asarray(jnp.finfo(real).eps * max(m, n), dtype=jnp.float64)
    atol_ = jnp.zeros((), dtype=jnp.float64) if atol is None else atol
    if rtol is None:
        rtol = default_rtol if atol is None else jnp.where(atol > 0, 0.0, default_rtol)
    if hermitian:
        # torch reads only the lower triangle; jax's default would symmetrise the input
        s, u = jnp.linalg.eigh(self, UPLO="L", symmetrize_input=False)
        s_abs = jnp.abs(s)
        max_val = jnp.max(s_abs, -1, keepdims=True)
        vh_h = u
    else:
        _require_svd_finite(self)  # ATen's pinv calls linalg.svd
        u, s, vh = jnp.linalg.svd(self, full_matrices=False)
        s_abs = s
        max_val = s[..., :1]
        vh_h = _mH(vh)
    tol = jnp.maximum(jnp.asarray(atol_)[..., None], jnp.asarray(rtol)[..., None] * max_val)
    s_inv = jnp.where(s_abs > tol, 1 / s, 0).astype(self.dtype)
    return _matmul(vh_h * s_inv[..., None, :], _mH(u))


# Note [matrix_rank out=]
# ATen's CompositeImplicitAutograd out= kernels of linalg_matrix_rank, given a tensor
# subclass (every tpu tensor), compute ``at::sum(S > tol, -1)`` and rebind their C++
# ``out`` reference to it: the Python out tensor is never written and keeps whatever it
# held, a silent wrong result (CPU tensors take the ``sum_out`` branch). A fallthrough at
# AutogradPrivateUse1 sends these overloads to the registry instead, which runs the
# functional sibling (the same composite, whose result is right) and writes it into out
# with torch's out= checks (ops/writeback.py). The result is an integer count: autograd
# above has nothing to record.
_MATRIX_RANK_OUT_LIB = torch.library.Library("aten", "IMPL", "AutogradPrivateUse1")
for _overload in ("out", "out_tol_tensor", "atol_rtol_tensor_out", "atol_rtol_float_out"):
    _MATRIX_RANK_OUT_LIB.impl(f"linalg_matrix_rank.{_overload}", torch.library.fallthrough_kernel)
