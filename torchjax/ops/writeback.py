"""Checks before a result is written into ``out=`` or ``self`` (in-place): torch's rules.

Note [out= checks]
torch checks an ``out=`` call in the kernel, and the rules differ by op family; we take
them from torch where torch can tell us, and state the rest here:

- Dtypes. The op runs first on meta tensors with the same sizes, strides and dtypes
  (``check_out_on_meta``): a structured kernel's meta function refuses what its CPU
  kernel refuses (``mm`` into float64, ``max.dim`` values of another dtype, ``argmax``
  into float), with torch's message, and accepts the casts torch accepts (``cumsum``
  of float into int64). Meta does not check everything the CPU kernels check: index
  and exponent outputs of multi-output ops (``sort``/``topk``/``kthvalue``/``mode``
  indices must be int64, ``frexp``'s exponent int32) and the outputs of index-valued
  ops (``nonzero``, ``argmax``, ``searchsorted``, ...) must have exactly the result's
  dtype (``exact_integer_outputs``). Where meta has no kernel, values follow torch's
  casting rule (``torch.can_cast``).
- Overlap. ``torch.add(x[:3], 1, out=x[1:])`` or ``x[1:].add_(x[:3])`` is refused,
  as TensorIterator's ``assert_no_partial_overlap`` does, with the same test
  (``overlap_status``, ATen's ``get_overlap_status``): same memory, and either the same
  range with other strides or intersecting ranges, both tensors non-overlapping and
  dense (otherwise torch calls it too hard and allows it; so do we, and our result is
  the one computed before the write, as if the input had been cloned). Reductions
  (schemas with ``keepdim``) do not check in torch and do not here.
"""

from __future__ import annotations

import math

import torch

from torchjax.tensor import dtypes
from torchjax.tensor._reinterpret import Interpretation
from torchjax.tensor._tensor import JaxTensor

_OVERLAP_MESSAGE = (
    "unsupported operation: some elements of the input tensor and the written-to tensor "
    "refer to a single memory location. Please clone() the tensor before performing the "
    "operation."
)

# Single-output ops whose integer result is an index (its dtype is the op's, not the
# input's): torch's kernels check the out dtype exactly.
_INDEX_VALUED = frozenset(
    {"nonzero", "argmax", "argmin", "searchsorted", "bucketize", "argsort", "argwhere"}
)


def _root(storage):
    return storage.root if storage.__class__ is Interpretation else storage


def _non_overlapping_and_dense(size, stride) -> bool:
    dims = sorted((s, n) for n, s in zip(size, stride) if n != 1)
    expected = 1
    for s, n in dims:
        if s != expected:
            return False
        expected *= n
    return True


def overlap_status(a: JaxTensor, b: JaxTensor) -> str:
    """ATen's get_overlap_status: "full", "partial", "no" or "too_hard"."""
    if a is b:
        return "full"
    if _root(a._storage) is not _root(b._storage):
        return "no"
    na, nb = math.prod(a._size), math.prod(b._size)
    if na == 0 or nb == 0:
        return "no"
    if not (
        _non_overlapping_and_dense(a._size, a._stride)
        and _non_overlapping_and_dense(b._size, b._stride)
    ):
        return "too_hard"
    ia, ib = a.element_size(), b.element_size()
    a0, b0 = a._offset * ia, b._offset * ib
    a1, b1 = a0 + na * ia, b0 + nb * ib
    if a0 == b0 and a1 == b1:
        return "full" if a._stride == b._stride else "partial"
    return "partial" if a0 < b1 and b0 < a1 else "no"


def _tensors(x):
    if isinstance(x, JaxTensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


# Ops whose out= refuses any overlap with an input, full overlap too (ATen's
# assert_no_overlap in their out kernels): the result is gathered from the input while
# the output is written.
_NO_OVERLAP = frozenset({"index_select", "gather", "take", "masked_select", "kthvalue", "cat"})

_INTERNAL_OVERLAP_MESSAGE = (
    "unsupported operation: more than one element of the written-to tensor refers to a "
    "single memory location. Please clone() the tensor before performing the operation."
)


def check_no_internal_overlap(func, written) -> None:
    """ATen's assert_no_internal_overlap: a written tensor with a stride-0 dimension of
    size > 1 (an expanded tensor) is refused before anything is resized or computed."""
    for w in written:
        if isinstance(w, JaxTensor) and any(st == 0 and n > 1 for n, st in zip(w._size, w._stride)):
            raise RuntimeError(
                f"{_INTERNAL_OVERLAP_MESSAGE} (in aten::{func._opname}.{func._overloadname})"
            )


def check_no_partial_overlap(func, written, args, kwargs) -> None:
    """Refuse an input that partly shares memory with a written tensor (see Note), or
    shares any for the ops in ``_NO_OVERLAP``."""
    refused = ("partial", "full") if func._opname in _NO_OVERLAP else ("partial",)
    for w in written:
        if not isinstance(w, JaxTensor):
            continue
        root = _root(w._storage)
        for x in (*args, *kwargs.values()):
            for t in _tensors(x):
                if _root(t._storage) is not root or (t is w and "full" not in refused):
                    continue
                if overlap_status(t, w) in refused:
                    raise RuntimeError(
                        f"{_OVERLAP_MESSAGE} (in aten::{func._opname}.{func._overloadname})"
                    )


def checks_overlap(func) -> bool:
    """Whether torch checks input/output overlap for ``func`` (not reductions, except
    the ``_NO_OVERLAP`` ones)."""
    if func._opname in _NO_OVERLAP:
        return True
    return not any(a.name == "keepdim" for a in func._schema.arguments)


def _to_meta(x, meta_like):
    if isinstance(x, JaxTensor):
        return meta_like(x)
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(y, meta_like) for y in x)
    return x


def check_out_on_meta(func, args, kwargs, out_names, meta_like) -> bool:
    """Run ``func`` (an out= overload) on meta copies of its arguments: torch's own dtype
    checks raise with torch's message. True when meta accepted the call, False when meta
    cannot tell (no meta kernel, or one that needs data).

    The meta outs are empty tensors of the outs' dtypes: resizing those warns nothing
    (torch's resize warning is raised once, by our write; a C++ warning from this nested
    call would surface after it returns, out of reach of ``warnings`` filters)."""

    def empty_meta(out):
        if isinstance(out, (list, tuple)):
            # A ``Tensor(a!)[] out`` argument (split_copy, unbind_copy...): torch copies
            # into each out as it is, never resizing it, so the meta call gets their shapes.
            return [_to_meta(o, meta_like) for o in out]
        return torch.empty(0, dtype=out.dtype, device="meta")

    margs = [_to_meta(a, meta_like) for a in args]
    mkwargs = {
        k: empty_meta(v) if k in out_names else _to_meta(v, meta_like) for k, v in kwargs.items()
    }
    try:
        func(*margs, **mkwargs)
    except NotImplementedError:
        return False
    except RuntimeError as error:
        text = str(error)
        if "meta" in text.lower() or "data-dependent" in text:
            return False
        raise RuntimeError(f"{text} (in aten::{func._opname}.{func._overloadname})") from None
    except (TypeError, ValueError, IndexError):
        return False
    return True


def exact_integer_outputs(func, n_outputs: int) -> bool:
    """Whether integer outputs of ``func`` must have exactly the result's dtype."""
    return n_outputs > 1 or func._opname in _INDEX_VALUED


def dtype_name(dt) -> str:
    """torch's C++ type name in its "Expected out tensor" messages (``long int``)."""
    return {
        torch.float32: "float",
        torch.float64: "double",
        torch.float16: "c10::Half",
        torch.bfloat16: "c10::BFloat16",
        torch.int64: "long int",
        torch.int32: "int",
        torch.int16: "short int",
        torch.int8: "signed char",
        torch.uint8: "unsigned char",
        torch.bool: "bool",
        torch.complex64: "c10::complex<float>",
        torch.complex128: "c10::complex<double>",
    }.get(dt, str(dt).removeprefix("torch."))


def exact_dtype_error(func, expected, got) -> RuntimeError:
    if func._opname == "nonzero":
        # nonzero's own check, word for word (torch's text has no space after "type").
        want, have = dtypes.aten_type_name(expected), dtypes.aten_type_name(got)
        return RuntimeError(
            f"nonzero: Expected out tensor to have scalar type {want} but got scalar type"
            f"{have} (in aten::nonzero.out; pass an out tensor of dtype {expected})"
        )
    return RuntimeError(
        f"Expected out tensor to have dtype {dtype_name(expected)}, but got "
        f"{dtype_name(got)} instead (in aten::{func._opname}.{func._overloadname}; pass an "
        f"out tensor of dtype {expected})"
    )
