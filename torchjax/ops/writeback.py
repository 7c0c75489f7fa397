"""Writing a result into ``out=`` tensors or ``self`` (in-place), through the storage so
that views see the write, after the checks torch does first.

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
import warnings

import jax.numpy as jnp
import torch

from torchjax.ops import fused, out_refusals
from torchjax.ops.functional import device_error
from torchjax.ops.promotion import astype
from torchjax.ops.schema import out_names
from torchjax.ops.views import meta_like
from torchjax.tensor import dtypes
from torchjax.tensor._addresses import root_of
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
    if root_of(a._storage) is not root_of(b._storage):
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
        root = root_of(w._storage)
        for x in (*args, *kwargs.values()):
            for t in _tensors(x):
                if root_of(t._storage) is not root or (t is w and "full" not in refused):
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
    checks raise with torch's message (CPU's where a Python meta kernel words it
    otherwise: Note [out= refusals in CPU's words] in torchjax/ops/out_refusals.py). True
    when meta accepted the call (or CPU's kernel takes what meta refused), False when
    meta cannot tell (no meta kernel, or one that needs data).

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
        if out_refusals.is_reference_text(text):
            # Note [out= refusals in CPU's words]
            cpu = out_refusals.cpu_answer(func, args, kwargs, out_names)
            if cpu is out_refusals.ACCEPTS:
                return True  # the dtypes are checked: CPU's kernel takes them
            if cpu is not None:
                raise out_refusals.in_cpus_words(cpu, func) from None
        raise RuntimeError(f"{text} (in aten::{func._opname}.{func._overloadname})") from None
    except (TypeError, ValueError, IndexError):
        return False
    return True


_SCALAR_TYPES = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.int64: "Long",
    torch.int32: "Int",
    torch.int16: "Short",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}


def _scalar_type(dt) -> str:
    """c10's ScalarType name ('Float', 'Long', 'BFloat16'), as ATen's kernels print it."""
    return _SCALAR_TYPES.get(dt, str(dt).removeprefix("torch."))


def check_kernel_out_dtype_first(func, args, outs) -> None:
    """Out dtype checks CPU's kernels make before anything their meta functions check:
    mode's values must have the input's dtype and its indices int64; complex and polar
    exactly their parts' complex dtype; multinomial's
    samples are int64, checked after its input's rank and dtype, before its weights."""
    if func._opname in ("complex", "polar") and len(args) == 2:
        _check_complex_out(args, outs[0])
    if func._opname == "multinomial" and args and outs[0].dtype != torch.long:
        self = args[0]
        if self.dim() in (1, 2) and self.is_floating_point():
            raise RuntimeError(
                f"multinomial expects Long tensor out, got: "
                f"{dtypes.aten_type_name(outs[0].dtype)} (in aten::multinomial.out; "
                f"pass an out tensor of dtype torch.int64)"
            )
    if func._opname == "mode" and args and len(outs) == 2:
        for out, want, what in (
            (outs[0], args[0].dtype, "values"),
            (outs[1], torch.long, "indices"),
        ):
            if out.dtype != want:
                raise RuntimeError(
                    f"expected scalar type '{_scalar_type(want)}' but got "
                    f"'{_scalar_type(out.dtype)}' for {what} output"
                )


def _check_complex_out(parts, out) -> None:
    """complex and polar write exactly the complex dtype of their parts' (after CPU's
    own checks that the parts are floating and of one dtype, which the call makes)."""
    a, b = parts
    if not (a.is_floating_point() and b.is_floating_point()) or a.dtype != b.dtype:
        return
    want = {torch.float16: torch.complex32, torch.float32: torch.complex64}.get(
        a.dtype, torch.complex128
    )
    if out.dtype != want:
        raise RuntimeError(
            f"Expected object of scalar type {dtypes.aten_type_name(want)} but got scalar "
            f"type {dtypes.aten_type_name(out.dtype)} for argument 'out'"
        )


def check_kernel_out_dtype(func, args, outs) -> None:
    """The out dtype checks CPU's kernels make that their meta functions do not: amax and
    amin write only their input's dtype; any and all a bool (or uint8) result."""
    name = func._opname
    if name in ("amax", "amin") and args and outs[0].dtype != args[0].dtype:
        have, want = dtypes.aten_type_name(args[0].dtype), dtypes.aten_type_name(outs[0].dtype)
        raise RuntimeError(
            f"Expected the dtype for input and out to match, but got {have} for input's "
            f"dtype and {want} for out's dtype. (in aten::{name}.{func._overloadname})"
        )
    if name in ("any", "all") and outs[0].dtype not in (torch.bool, torch.uint8):
        raise RuntimeError(
            f"{name} only supports bool tensor for result, got: "
            f"{dtypes.aten_type_name(outs[0].dtype)} (in aten::{name}.{func._overloadname})"
        )


def _complex_abs_out(func, self, out) -> bool:
    """CPU's abs.out of a complex tensor, which its meta function refuses outright: into
    a complex out of exactly self's dtype the values are written with a zero imaginary
    part; into a real out, as torch casts (True: the dtype is checked already)."""
    if not out.is_complex():
        return False
    if out.dtype != self.dtype:
        have, want = dtypes.aten_type_name(out.dtype), dtypes.aten_type_name(self.dtype)
        raise RuntimeError(
            f"Found dtype {have} but expected {want} (in aten::{func._opname}."
            f"{func._overloadname}; pass an out tensor of dtype {self.dtype})"
        )
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
    if func._opname in ("searchsorted", "bucketize"):
        # Bucketization.cpp's check, shared by both ops, word for word.
        flag = "True" if expected == torch.int32 else "False"
        return RuntimeError(
            "torch.searchsorted(): output tensor's dtype is wrong, it can only be Int(int32) "
            "or Long(int64) depending on whether out_int32 flag is True, but we got output "
            f"tensor's dtype {dtypes.aten_type_name(got)} and out_int32 flag is {flag}"
        )
    return RuntimeError(
        f"Expected out tensor to have dtype {dtype_name(expected)}, but got "
        f"{dtype_name(got)} instead (in aten::{func._opname}.{func._overloadname}; pass an "
        f"out tensor of dtype {expected})"
    )


# ---------------------------------------------------------------------------------------
# writing


def check_castable(func, result_dtype, out_dtype):
    if not torch.can_cast(result_dtype, out_dtype):
        raise RuntimeError(
            f"result type {dtypes.aten_type_name(result_dtype)} can't be cast to the desired "
            f"output type {dtypes.aten_type_name(out_dtype)} (in aten::{func._opname}."
            f"{func._overloadname})"
        )


# Ops whose out= tensors, when resized, take the strides of the functional result
# (Note [LAPACK's column-major results] in torchjax/ops/linalg_results.py); filled by the ops'
# registration.
RESIZED_AS_RESULT: set[str] = set()


def write_into(func, dst: torch.Tensor, src: JaxTensor, *, check_cast=True, resize=False):
    """Write ``src`` into ``dst`` with torch's out=/in-place rules (cast, shape)."""
    if not isinstance(dst, JaxTensor):
        raise device_error(func, dst)
    if check_cast:
        check_castable(func, src.dtype, dst.dtype)
    pending = fused.pending_of(src) if fused.ACTIVE[0] else None
    if pending is not None and fused.write(dst, pending):
        return dst  # recorded: the write happens at the flush (Note [Fused eager])
    arr = astype(src._value(), dtypes.to_jax_dtype(dst.dtype))
    if tuple(arr.shape) != dst._size:
        if resize:
            if dst.numel() != 0:
                warnings.warn(
                    f"An output with one or more elements was resized since it had shape "
                    f"{list(dst._size)}, which does not match the required output shape "
                    f"{list(arr.shape)}. This behavior is deprecated, and in a future PyTorch "
                    "release outputs will not be resized unless they have zero elements. You "
                    "can explicitly reuse an out tensor t by resizing it, inplace, to zero "
                    "elements with t.resize_(0).",
                    UserWarning,
                    stacklevel=4,
                )
            # In its storage, as CPU: a view's base sees the write. nonzero's CPU kernel
            # lays a resized out= in Fortran order (strides (1, n)), as its own result;
            # the LAPACK ops theirs at their result's strides.
            stride = None
            if func._opname == "nonzero":
                stride = (1, arr.shape[0])
            elif func._opname in RESIZED_AS_RESULT:
                stride = src._stride
            dst._resize(arr.shape, stride)
            dst._write(arr)
            return dst
        try:
            shape = jnp.broadcast_shapes(tuple(arr.shape), dst._size)
        except ValueError:
            shape = None
        if shape != dst._size:
            raise RuntimeError(
                f"output with shape {list(dst._size)} doesn't match the broadcast shape "
                f"{list(arr.shape) if shape is None else list(shape)} "
                f"(in aten::{func._opname}.{func._overloadname})"
            )
        arr = jnp.broadcast_to(arr, dst._size)
    dst._write(arr)
    return dst


def inplace_handler(func, functional):
    overlap = checks_overlap(func)

    def inplace(args, kwargs):
        if overlap and len(args) > 1:
            check_no_partial_overlap(func, args[:1], args[1:], kwargs)
        try:
            result = functional(args, kwargs)
        except NotImplementedError as error:
            if dtypes.is_complex32_error(error):
                # ``f16.mul_(1j)``: CPU computes in complex32, then refuses to write it
                # into self; no tpu tensor holds complex32, but self never could either.
                check_castable(func, torch.complex32, args[0].dtype)
            raise
        if isinstance(result, (list, tuple)):
            result = result[0]
        return write_into(func, args[0], result)

    return inplace


def inplace_view_handler(functional_view):
    def inplace_view(args, kwargs):
        self = args[0]
        v = functional_view(args, kwargs)
        self._rebind(self._storage, v._size, v._stride, v._offset)
        return self

    return inplace_view


# Note [An out= dtype is the reduction's dtype]
# sum, nansum, prod, mean, cumsum and cumprod read the out tensor's dtype as ``dtype=``
# when none is given (ATen's ``infer_dtype_from_optional``): ``torch.sum(x, 1, out=o)``
# with an int64 ``o`` truncates each float element and adds integers, with a float64
# ``o`` adds a float32 ``x`` in float64. Not for a complex input into a real out, nor for
# mean and nansum into an integer out (CPU refuses those).
_OUT_DTYPE_IS_DTYPE = frozenset({"sum", "nansum", "prod", "mean", "cumsum", "cumprod"})


def _out_dtype_as_dtype(func, args, rest, outs) -> dict:
    if func._opname not in _OUT_DTYPE_IS_DTYPE or rest.get("dtype") is not None:
        return rest
    out, src = outs[0].dtype, args[0] if args else None
    values = out.is_floating_point or out.is_complex
    if not isinstance(src, torch.Tensor) or (src.is_complex() and not out.is_complex):
        return rest
    if not values and func._opname == "nansum" and src.is_floating_point():
        # CPU runs its nansum kernel in the out's integer type, which has none.
        raise NotImplementedError(
            f"\"nansum\" not implemented for '{dtypes.aten_type_name(out)}' "
            f"(in aten::nansum.{func._overloadname}; pass a floating out tensor)"
        )
    if not values and func._opname in ("mean", "nansum"):
        return rest
    return {**rest, "dtype": out}


def out_handler(func, functional):
    """out= overloads: torch's checks (Note [out= checks] in torchjax/ops/py),
    the functional result, then a write into each out tensor (resized if needed)."""
    names = out_names(func._schema)
    overlap = checks_overlap(func)

    # ``Tensor(a!)[] out`` (split_with_sizes_copy, unbind_copy...): one argument holding
    # a list of tensors, one per result; such overloads return nothing.
    list_out = len(names) == 1 and not func._schema.returns
    by_out_dtype = func._opname in _OUT_DTYPE_IS_DTYPE and any(
        a.name == "dtype" for a in func._schema.arguments
    )

    def out(args, kwargs):
        outs = list(kwargs[names[0]]) if list_out else [kwargs[n] for n in names]
        for o in outs:
            if not isinstance(o, JaxTensor):
                raise device_error(func, o)
        rest = {k: v for k, v in kwargs.items() if k not in names}
        if overlap:
            check_no_internal_overlap(func, outs)
            check_no_partial_overlap(func, outs, args, rest)
        if by_out_dtype:
            rest = _out_dtype_as_dtype(func, args, rest, outs)
        if func._opname in ("isposinf", "isneginf") and outs[0].dtype != torch.bool:
            # The kernel's own check, ahead of the meta function's generic one.
            raise RuntimeError(
                f"{func._opname} does not support non-boolean outputs. "
                f"(in aten::{func._opname}.{func._overloadname})"
            )
        check_kernel_out_dtype_first(func, args, outs)
        if func._opname == "abs" and args[0].is_complex():
            meta_ok = _complex_abs_out(func, args[0], outs[0])
        else:
            meta_ok = check_out_on_meta(func, args, kwargs, names, meta_like)
        result = functional(args, rest)
        results = result if isinstance(result, (list, tuple)) else (result,)
        check_kernel_out_dtype(func, args, outs)
        exact = exact_integer_outputs(func, len(outs))
        for o, r in zip(outs, results):
            values = r.dtype.is_floating_point or r.dtype.is_complex
            # Every output of a multi-output op has exactly its result's dtype, values
            # included (sort, max.dim, aminmax, slogdet, qr...); a one-output op only its
            # integer index results.
            integer = not values and r.dtype != torch.bool
            if exact and o.dtype != r.dtype and (len(outs) > 1 or integer):
                raise exact_dtype_error(func, r.dtype, o.dtype)
            # Asked of CPU where the meta function accepted too: some meta functions take
            # an out their CPU kernel refuses (``angle`` into an integer out).
            if values and not torch.can_cast(r.dtype, o.dtype):
                # Note [out= refusals in CPU's words]
                cpu = out_refusals.cpu_answer(func, args, kwargs, names)
                if isinstance(cpu, Exception):
                    raise out_refusals.in_cpus_words(cpu, func)
            write_into(func, o, r, check_cast=values and not meta_ok, resize=True)
        if list_out:
            return None
        return outs[0] if len(outs) == 1 else tuple(outs)

    return out
