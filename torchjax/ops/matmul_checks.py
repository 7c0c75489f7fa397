"""The argument checks of the matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``,
``addbmm``, ``mv``, ``addmv``, ``dot``, ``vdot``, and ``matmul``'s batch dims), in CPU
torch's order and with its texts.

All are structured kernels: the meta function checks dtypes and shapes, then ``addmm``'s
CPU kernel expands ``self`` to the result's shape, and only then does ``AT_DISPATCH``
refuse a dtype it has no kernel for ('Bool'). The checks take torch tensors or jax arrays
alike (``ndim``, ``shape``, ``dtype``): the lowerings in matmul.py run them on arrays, and
the dtype refusal of a bool call runs them on the tensors first (Note [Checks before the
refusal] in torchjax/ops/dtype_refusals.py), so a bool call with bad shapes raises the
shape error, as CPU does. Reference: ``TORCH_META_FUNC(mm)``, ``ADDMM_META()`` and
``addmm_impl_cpu_``, ``common_checks_baddbmm_bmm`` and ``bmm_out_or_baddbmm_`` in
aten/src/ATen/native/LinearAlgebra.cpp; ``TORCH_META_FUNC(addmv)``, ``addmv_out_cpu``,
``mv``, ``dot_check`` and ``dot_out`` in Blas.cpp.

Sizes a kernel reads before it checks the rank (``baddbmm``'s ``batch2.size(2)``, an
input of 0-d ``addmv`` in its size text) are read as torch reads them (``_size``), so a
tensor without that dim raises torch's IndexError.
"""

from __future__ import annotations

import math

import torch

from torchjax._compat.torch import infer_size
from torchjax.ops import dtype_refusals
from torchjax.ops.registry import precheck
from torchjax.ops.schema import arg
from torchjax.ops.writeback import dtype_name, exact_dtype_error
from torchjax.tensor.dtypes import aten_type_name, check_scalar_fits, to_torch_dtype

aten = torch.ops.aten


def _torch_dtype(dtype) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else to_torch_dtype(dtype)


def _type_meta(dtype) -> str:
    return dtype_name(_torch_dtype(dtype))


def is_bool(x) -> bool:
    return _torch_dtype(x.dtype) == torch.bool


def _inner(mat1, mat2) -> None:
    if mat1.shape[1] != mat2.shape[0]:
        raise RuntimeError(
            f"mat1 and mat2 shapes cannot be multiplied ({mat1.shape[0]}x{mat1.shape[1]} "
            f"and {mat2.shape[0]}x{mat2.shape[1]})"
        )


def mm_checks(self, mat2) -> None:
    """``TORCH_META_FUNC(mm)``: ranks, inner sizes, then equal dtypes."""
    if self.ndim != 2:
        raise RuntimeError("self must be a matrix")
    if mat2.ndim != 2:
        raise RuntimeError("mat2 must be a matrix")
    _inner(self, mat2)
    if _torch_dtype(self.dtype) != _torch_dtype(mat2.dtype):
        raise RuntimeError(
            "expected m1 and m2 to have the same dtype, but got: "
            f"{_type_meta(self.dtype)} != {_type_meta(mat2.dtype)}"
        )


def bmm_checks(self, mat2) -> None:
    """``common_checks_baddbmm_bmm``: ranks, then batch and inner sizes."""
    for name, a in (("batch1", self), ("batch2", mat2)):
        if a.ndim != 3:
            raise RuntimeError(f"{name} must be a 3D tensor")
    want = [self.shape[0], self.shape[2]]
    if [mat2.shape[0], mat2.shape[1]] != want:
        raise RuntimeError(
            f"Expected size for first two dimensions of batch2 tensor to be: {want} but got: "
            f"{[mat2.shape[0], mat2.shape[1]]}."
        )


# ``bmm_out_or_baddbmm_`` multiplies small batches (k * n * m below this) in its own
# kernel, dispatched on batch1's dtype; larger ones with a gemm per matrix (or MKL's
# batched gemm), dispatched on the result's dtype (batch2's): the two word a bool or a
# mixed-dtype call differently.
_SMALL_BMM = 400
# The result dtypes whose large products CPU hands to MKL's batched gemm, which reads the
# batches as the result's type; other large products go through mm/addmm_ per matrix.
_BATCHED_GEMM = (torch.float32, torch.float64, torch.complex64, torch.complex128)


def bmm_kernel_checks(batch1, batch2, name="bmm", beta=0, alpha=1) -> None:
    """``bmm_out_or_baddbmm_``'s refusals, made only when there is something to compute:
    no kernel for bool, the Scalars converted to the kernel's opmath type, then batch2
    (or the result) of batch1's dtype. With k == 0, ``baddbmm`` computes ``self * beta``
    with torch's ``mul_`` instead, which refuses a beta the result cannot hold."""
    bs, n, k = batch1.shape
    m = batch2.shape[2]
    if not bs * n * m:
        return
    if not k:
        if name == "baddbmm":
            check_beta_casts(batch2.dtype, beta)
        return
    small = k * n * m < _SMALL_BMM
    first, second = (batch1, batch2) if small else (batch2, batch1)
    if is_bool(first):
        kernel = name if small else "addmm_impl_cpu_"
        raise NotImplementedError(f"\"{kernel}\" not implemented for 'Bool'")
    a, b = _torch_dtype(batch1.dtype), _torch_dtype(batch2.dtype)
    if not small and a != b and b not in _BATCHED_GEMM:
        # A gemm per matrix through mm/addmm_, whose meta checks word it.
        if name == "bmm":
            raise RuntimeError(
                "expected m1 and m2 to have the same dtype, but got: "
                f"{_type_meta(a)} != {_type_meta(b)}"
            )
        raise RuntimeError(
            "mat1 and mat2 must have the same dtype, but got "
            f"{aten_type_name(a)} and {aten_type_name(b)}"
        )
    check_scalar_converts(first.dtype, name, alpha, beta, opmath=True)
    if _torch_dtype(first.dtype) != _torch_dtype(second.dtype):
        raise RuntimeError(
            f"expected scalar type {aten_type_name(first.dtype)} but found "
            f"{aten_type_name(second.dtype)}"
        )


def check_scalar_converts(dtype, op, *scalars, opmath=False) -> None:
    """A kernel reads its Scalars (alpha, beta) as its computation type with c10's
    ``checked_convert``: a complex one into a real type, or one past the type's range,
    is refused. ``opmath``: half-precision kernels read them as float."""
    dtype = _torch_dtype(dtype)
    if opmath and dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    for scalar in scalars:
        check_scalar_fits(scalar, dtype, op)


def _numel(x) -> int:
    return math.prod(x.shape)


def _stand_in(shape, dtype) -> torch.Tensor:
    """A zero-stride CPU tensor of this shape and dtype (no memory): torch's own methods
    run on it raise torch's errors for it."""
    return torch.empty((), dtype=_torch_dtype(dtype)).expand(tuple(shape))


def _size(x, dim) -> int:
    """``x.size(dim)``, raising torch's IndexError where ``x`` has no such dim."""
    if dim < len(x.shape):
        return x.shape[dim]
    return _stand_in(x.shape, x.dtype).size(dim)


def _check_inplace(self, shape, dtype) -> None:
    """The structured kernels' ``check_inplace``: ``self`` has the result's dtype, then
    its shape (no broadcasting into it)."""
    if _torch_dtype(self.dtype) != _torch_dtype(dtype):
        raise RuntimeError(
            f"Bad in-place call: input tensor dtype {_type_meta(self.dtype)} and output "
            f"tensor dtype {_type_meta(dtype)} should match"
        )
    if tuple(self.shape) != tuple(shape):
        raise RuntimeError(
            f"Bad in-place call: input tensor size {list(self.shape)} and output tensor "
            f"size {list(shape)} should match"
        )


def addmm_checks(self, mat1, mat2, inplace=False, out=None, func=None) -> None:
    """``ADDMM_META()``: equal dtypes (self and mat2, then mat1 and mat2), ranks, inner
    sizes; then the structured kernel's output checks (``addmm_``: ``self`` is (n, m)
    already; ``addmm.out`` (``func``): ``out`` has the dtype); then the CPU kernel's
    expand of ``self`` to (n, m)."""
    for name, a in (("self", self), ("mat1", mat1)):
        if _torch_dtype(a.dtype) != _torch_dtype(mat2.dtype):
            raise RuntimeError(
                f"{name} and mat2 must have the same dtype, but got "
                f"{aten_type_name(a.dtype)} and {aten_type_name(mat2.dtype)}"
            )
    for name, a in (("mat1", mat1), ("mat2", mat2)):
        if a.ndim != 2:
            raise RuntimeError(f"{name} must be a matrix, got {a.ndim}-D tensor")
    _inner(mat1, mat2)
    shape = (mat1.shape[0], mat2.shape[1])
    if inplace:
        _check_inplace(self, shape, mat2.dtype)
    if out is not None and out.dtype != _torch_dtype(mat2.dtype):
        raise exact_dtype_error(func, _torch_dtype(mat2.dtype), out.dtype)
    check_expand(self, shape)


def addmm_kernel_checks(dtype, mat1, mat2, beta=1, alpha=1, op="addmm") -> None:
    """``addmm_impl_cpu_``'s refusals for a result of ``dtype``, made only when the result
    is not empty: with k == 0 it computes ``self * beta`` with torch's ``mul``; else it
    has no bool kernel, and reads alpha and beta as the opmath type."""
    (n, k), m = mat1.shape, mat2.shape[1]
    if not n * m:
        return
    if not k:
        check_beta_casts(dtype, beta)
        return
    if is_bool(mat1):
        raise NotImplementedError("\"addmm_impl_cpu_\" not implemented for 'Bool'")
    check_scalar_converts(dtype, op, alpha, beta, opmath=True)


def addmv_checks(self, mat, vec, beta=1, alpha=1, inplace=False, out=None, func=None):
    """``TORCH_META_FUNC(addmv)``: ranks, sizes (an ``input`` of one element broadcasts),
    equal dtypes; the structured kernel's output checks; then ``addmv_out_cpu``: with an
    empty matrix, ``self * beta`` (beta read as self's type), else, for a non-empty
    result, no bool kernel and alpha, beta read as the matrix's type."""
    if not (mat.ndim == 2 and vec.ndim == 1 and self.ndim <= 1):
        raise RuntimeError(
            f"vector + matrix @ vector expected, got {self.ndim}, {mat.ndim}, {vec.ndim}"
        )
    if mat.shape[1] != vec.shape[0] or _numel(self) not in (mat.shape[0], 1):
        raise RuntimeError(
            f"size mismatch, got input ({_size(self, 0)}), mat ({mat.shape[0]}x"
            f"{mat.shape[1]}), vec ({vec.shape[0]})"
        )
    dts = [_torch_dtype(a.dtype) for a in (self, mat, vec)]
    if len(set(dts)) > 1:
        raise RuntimeError(
            "addmv input tensors must have the same dtype, but got "
            f"{aten_type_name(dts[0])}, {aten_type_name(dts[1])}, and {aten_type_name(dts[2])}"
        )
    if inplace:
        _check_inplace(self, (mat.shape[0],), vec.dtype)
    if out is not None and out.dtype != dts[2]:
        raise exact_dtype_error(func, dts[2], out.dtype)
    if not _numel(mat):
        if beta != 0:
            # ``scalar_tensor(beta, self's dtype)``: its fill reads beta as a double for
            # the half-precision types.
            half = _torch_dtype(self.dtype) in (torch.float16, torch.bfloat16)
            check_scalar_converts(torch.float64 if half else self.dtype, "addmv", beta)
    elif mat.shape[0]:
        if is_bool(mat):
            raise NotImplementedError("\"addmv_impl_cpu\" not implemented for 'Bool'")
        check_scalar_converts(mat.dtype, "addmv", beta, alpha)


def mv_checks(self, vec, out=None, func=None) -> None:
    """CPU's ``mv``: ``addmv_`` (beta 0) into a result of (self.size(0),) and vec's dtype;
    ``mv.out``: ``addmv.out`` with ``out`` as its input too, unless ``out`` could not be
    one (more than 1-D, or neither self.size(0) nor one element)."""
    n = _size(self, 0)
    if out is not None and out.ndim <= 1 and _numel(out) in (n, 1):
        addmv_checks(out, self, vec, beta=0, out=out, func=func)
        return
    result = _stand_in((n,), vec.dtype)
    addmv_checks(result, self, vec, beta=0, inplace=out is None, out=out, func=func)


def dot_checks(self, other, out=None, name="dot") -> None:
    """``dot_out``'s result dtype, then ``dot_check``: ranks, dtypes, sizes; then the
    dispatch on self's dtype (``vdot`` of real tensors is ``dot``'s, named so)."""
    if out is not None and out.dtype != _torch_dtype(self.dtype):
        raise RuntimeError(
            f"result dtype {aten_type_name(out.dtype)} does not match input dtype "
            f"{aten_type_name(self.dtype)}"
        )
    if self.ndim != 1 or other.ndim != 1:
        raise RuntimeError(f"1D tensors expected, but got {self.ndim}D and {other.ndim}D tensors")
    if _torch_dtype(self.dtype) != _torch_dtype(other.dtype):
        raise RuntimeError(
            "dot : expected both vectors to have same dtype, but found "
            f"{aten_type_name(self.dtype)} and {aten_type_name(other.dtype)}"
        )
    n, m = self.shape[0], other.shape[0]
    if n != m:
        raise RuntimeError(
            f"inconsistent tensor size, expected tensor [{n}] and src [{m}] to have the "
            f"same number of elements, but got {n} and {m} elements respectively"
        )
    if is_bool(self):
        raise NotImplementedError("\"dot\" not implemented for 'Bool'")


def baddbmm_checks(self, batch1, batch2, beta=1, alpha=1, inplace=False, out=None, func=None):
    """``TORCH_META_FUNC(baddbmm)``: self expanded to (b, n, m) (sizes read before the
    ranks are checked), self of batch1's dtype, then ``common_checks_baddbmm_bmm`` and the
    output checks (the result has batch2's dtype); then ``bmm_out_or_baddbmm_``'s."""
    shape = (_size(batch1, 0), _size(batch1, 1), _size(batch2, 2))
    check_expand(self, shape)
    if _torch_dtype(self.dtype) != _torch_dtype(batch1.dtype):
        raise RuntimeError(
            f"Input dtypes must be the same, got: input {_type_meta(self.dtype)}, batch1: "
            f"{_type_meta(batch1.dtype)}, batch2: {_type_meta(batch2.dtype)}"
        )
    bmm_checks(batch1, batch2)
    if out is not None and out.dtype != _torch_dtype(batch2.dtype):
        raise exact_dtype_error(func, _torch_dtype(batch2.dtype), out.dtype)
    if inplace:
        _check_inplace(self, shape, batch2.dtype)
    bmm_kernel_checks(batch1, batch2, "baddbmm", beta, alpha)


def addbmm_checks(self, batch1, batch2, beta=1, alpha=1, result_dtype=None) -> None:
    """CPU's ``addbmm_out``: self expanded to (n, m) (sizes read before the ranks are
    checked), then ``addbmm_impl_``'s checks; the result (``self``'s dtype, or
    ``result_dtype``: out's) is then scaled by beta with torch's ``mul_`` when there is
    no batch, else accumulates ``addmm_`` of each batch, with its checks."""
    shape = (_size(batch1, 1), _size(batch2, 2))
    check_expand(self, shape)
    for name, a in (("batch1", batch1), ("batch2", batch2)):
        if a.ndim != 3:
            raise RuntimeError(f"{name} must be a 3D tensor")
    if batch1.shape[0] != batch2.shape[0]:
        raise RuntimeError(
            "batch1 and batch2 must have same number of batches, got "
            f"{batch1.shape[0]} and {batch2.shape[0]}"
        )
    if batch1.shape[2] != batch2.shape[1]:
        raise RuntimeError(
            f"Incompatible matrix sizes for bmm ({batch1.shape[1]}x{batch1.shape[2]} and "
            f"{batch2.shape[1]}x{batch2.shape[2]})"
        )
    dtype = self.dtype if result_dtype is None else result_dtype
    if not batch1.shape[0]:
        check_beta_casts(dtype, beta)
        return
    result = _stand_in(shape, dtype)
    mat1 = _stand_in(batch1.shape[1:], batch1.dtype)
    mat2 = _stand_in(batch2.shape[1:], batch2.dtype)
    addmm_checks(result, mat1, mat2, inplace=True)
    addmm_kernel_checks(dtype, mat1, mat2, beta, alpha, op="addbmm")
    if batch1.shape[0] > 1:  # the later batches accumulate: beta is 1 (an int) there
        addmm_kernel_checks(dtype, mat1, mat2, 1, alpha, op="addbmm")


def check_expand(self, shape) -> None:
    """Raise torch's error where ``self`` does not expand to ``shape``: the text is that of
    ``Tensor.expand`` itself, run on a zero-stride CPU stand-in of ``self``'s shape and
    dtype (no memory), as the CPU kernel's ``expand_size`` raises it."""
    shape = tuple(shape)
    fits = len(self.shape) <= len(shape) and all(
        s in (1, t) for s, t in zip(reversed(self.shape), reversed(shape))
    )
    if not fits:
        stand_in = torch.empty((), dtype=_torch_dtype(self.dtype)).expand(tuple(self.shape))
        stand_in.expand(shape)  # raises torch's RuntimeError
        raise AssertionError(f"expand of {tuple(self.shape)} to {shape} did not raise")


def check_beta_casts(self_dtype, beta) -> None:
    """With nothing to multiply (k == 0) CPU's addmm computes ``self * beta`` with torch's
    ``mul`` into the result: a ``beta`` whose type promotes past the result's dtype (an int
    into bool, a float into int64) is refused as ``mul_out`` refuses it."""
    dtype = _torch_dtype(self_dtype)
    if beta == 0:  # the kernel zeroes the result instead
        return
    result = torch.result_type(torch.empty((), dtype=dtype), beta)
    if not torch.can_cast(result, dtype):
        raise RuntimeError(
            f"result type {aten_type_name(result)} can't be cast to the desired output "
            f"type {aten_type_name(dtype)}"
        )


@dtype_refusals.checked_first(aten.mm)
def _mm_first(args, kwargs) -> None:
    mm_checks(arg(args, kwargs, 0, "self"), arg(args, kwargs, 1, "mat2"))


def _addmm_args(args, kwargs):
    return (arg(args, kwargs, i, n) for i, n in enumerate(("self", "mat1", "mat2")))


@dtype_refusals.checked_first(aten.bmm, whole=True)
def _bmm_first(args, kwargs) -> None:
    self, mat2 = arg(args, kwargs, 0, "self"), arg(args, kwargs, 1, "mat2")
    bmm_checks(self, mat2)
    bmm_kernel_checks(self, mat2)


@dtype_refusals.checked_first(aten.addmm)
def _addmm_first(args, kwargs) -> None:
    addmm_checks(*_addmm_args(args, kwargs))


@precheck(aten.addmm_)
def _addmm_inplace(args, kwargs) -> None:
    """``addmm_`` writes (n, m) into ``self``: CPU refuses any other shape of ``self`` (one
    that would broadcast included) after the meta checks, before its kernel reads a dtype.
    A precheck, so it also runs before the dtype refusal."""
    addmm_checks(*_addmm_args(args, kwargs), inplace=True)


@precheck(aten.addmm.out)
def _addmm_out(args, kwargs) -> None:
    """``addmm.out``: the meta checks, then ``out``'s dtype, as CPU's structured kernel
    orders them (ahead of the generic out= checks run on meta tensors, whose texts differ
    from CPU's for addmm)."""
    out = kwargs.get("out")
    addmm_checks(*_addmm_args(args, kwargs), out=out, func=aten.addmm.out)


@precheck(aten.matmul)
def _matmul_batches(args, kwargs) -> None:
    """``aten::matmul`` reaches the op table whole only where the Autograd keys are
    skipped (``torch.inference_mode``), and torch's Python decomposition then words a
    batch mismatch its own way; CPU's composite kernel broadcasts the batch dims with
    ``infer_size`` ("The size of tensor a (6) must match the size of tensor b (3) at
    non-singleton dimension 1"), and so does this check, first."""
    a, b = arg(args, kwargs, 0, "self"), arg(args, kwargs, 1, "other")
    if a.dim() >= 1 and b.dim() >= 1 and max(a.dim(), b.dim()) >= 3:
        infer_size(a.shape[:-2], b.shape[:-2])


def _scales(kwargs):
    return {"beta": kwargs.get("beta", 1), "alpha": kwargs.get("alpha", 1)}


@dtype_refusals.checked_first(aten.mv, whole=True)
def _mv_first(args, kwargs) -> None:
    mv_checks(arg(args, kwargs, 0, "self"), arg(args, kwargs, 1, "vec"))


@precheck(aten.mv.out)
def _mv_out(args, kwargs) -> None:
    """``mv.out`` writes through ``addmv.out``, ``out`` its input where it can be one:
    CPU checks ``out``'s dtype among the inputs' (ahead of the generic out= checks)."""
    self, vec = arg(args, kwargs, 0, "self"), arg(args, kwargs, 1, "vec")
    mv_checks(self, vec, out=kwargs.get("out"), func=aten.mv.out)


def _dot_args(args, kwargs):
    # dot's second argument is ``tensor``, vdot's ``other``.
    other = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("other"))
    return arg(args, kwargs, 0, "self"), other


@dtype_refusals.checked_first(aten.dot, aten.vdot)
def _dot_first(args, kwargs) -> None:
    dot_checks(*_dot_args(args, kwargs))


@precheck(aten.dot.out, aten.vdot.out)
def _dot_out(args, kwargs) -> None:
    """``dot_out``/``vdot_out`` check the result's dtype first, in their own words."""
    dot_checks(*_dot_args(args, kwargs), out=kwargs.get("out"))


def _three(args, kwargs, names):
    return (arg(args, kwargs, i, n) for i, n in enumerate(names))


_ADDMV = ("self", "mat", "vec")
_BADDBMM = ("self", "batch1", "batch2")


@dtype_refusals.checked_first(aten.addmv, whole=True)
def _addmv_first(args, kwargs) -> None:
    addmv_checks(*_three(args, kwargs, _ADDMV), **_scales(kwargs))


@precheck(aten.addmv_, aten.addmv.out)
def _addmv_written(args, kwargs) -> None:
    """``addmv_`` keeps self's shape (no broadcasting into it); ``addmv.out`` needs
    ``out`` of vec's dtype: both checked as CPU's structured kernel orders them."""
    out = kwargs.get("out")
    func = aten.addmv.out if out is not None else None
    addmv_checks(
        *_three(args, kwargs, _ADDMV), **_scales(kwargs), inplace=out is None, out=out, func=func
    )


@dtype_refusals.checked_first(aten.baddbmm, whole=True)
def _baddbmm_first(args, kwargs) -> None:
    baddbmm_checks(*_three(args, kwargs, _BADDBMM), **_scales(kwargs))


@precheck(aten.baddbmm_, aten.baddbmm.out)
def _baddbmm_written(args, kwargs) -> None:
    """As ``addmv``'s: ``baddbmm_`` keeps self's shape and dtype (batch2's), ``out`` has
    batch2's dtype."""
    out = kwargs.get("out")
    func = aten.baddbmm.out if out is not None else None
    operands = _three(args, kwargs, _BADDBMM)
    baddbmm_checks(*operands, **_scales(kwargs), inplace=out is None, out=out, func=func)


@dtype_refusals.checked_first(aten.addbmm, whole=True)
def _addbmm_first(args, kwargs) -> None:
    addbmm_checks(*_three(args, kwargs, _BADDBMM), **_scales(kwargs))


@precheck(aten.addbmm.out)
def _addbmm_out(args, kwargs) -> None:
    """``addbmm.out`` accumulates into ``out`` itself: its dtype is the result's."""
    out = kwargs.get("out")
    addbmm_checks(*_three(args, kwargs, _BADDBMM), **_scales(kwargs), result_dtype=out.dtype)
