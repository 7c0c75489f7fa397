"""The argument checks of ``mm``, ``addmm`` and ``bmm`` (and of ``matmul``'s batch
dims), in CPU torch's order and with its texts.

All are structured kernels: the meta function checks dtypes and shapes, then ``addmm``'s
CPU kernel expands ``self`` to the result's shape, and only then does ``AT_DISPATCH``
refuse a dtype it has no kernel for ('Bool'). The checks take torch tensors or jax arrays
alike (``ndim``, ``shape``, ``dtype``): the lowerings in matmul.py run them on arrays, and
the dtype refusal of a bool call runs them on the tensors first (Note [Checks before the
refusal] in torchjax/ops/dtype_refusals.py), so a bool call with bad shapes raises the
shape error, as CPU does. Reference: ``TORCH_META_FUNC(mm)``, ``ADDMM_META()`` and
``addmm_impl_cpu_``, ``common_checks_baddbmm_bmm`` and ``bmm_out_or_baddbmm_`` in
aten/src/ATen/native/LinearAlgebra.cpp.
"""

from __future__ import annotations

import torch

from torchjax._compat.torch import infer_size
from torchjax.ops import dtype_refusals
from torchjax.ops.registry import precheck
from torchjax.ops.schema import arg
from torchjax.ops.writeback import dtype_name, exact_dtype_error
from torchjax.tensor.dtypes import aten_type_name, to_torch_dtype

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


def bmm_dtypes(self, mat2) -> None:
    """The CPU kernel's dispatch on batch1's dtype (no bool kernel), then its check that
    batch2 has that dtype; made only when there is something to multiply."""
    if is_bool(self):
        raise NotImplementedError("\"bmm\" not implemented for 'Bool'")
    if _torch_dtype(self.dtype) != _torch_dtype(mat2.dtype):
        raise RuntimeError(
            f"expected scalar type {aten_type_name(self.dtype)} but found "
            f"{aten_type_name(mat2.dtype)}"
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
    if inplace and tuple(self.shape) != shape:
        raise RuntimeError(
            f"Bad in-place call: input tensor size {list(self.shape)} and output tensor "
            f"size {list(shape)} should match"
        )
    if out is not None and out.dtype != _torch_dtype(mat2.dtype):
        raise exact_dtype_error(func, _torch_dtype(mat2.dtype), out.dtype)
    check_expand(self, shape)


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


@dtype_refusals.checked_first(aten.bmm)
def _bmm_first(args, kwargs) -> None:
    bmm_checks(arg(args, kwargs, 0, "self"), arg(args, kwargs, 1, "mat2"))


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
