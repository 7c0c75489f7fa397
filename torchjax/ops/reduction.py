"""Reductions: sum, mean, prod, amax/amin, max/min over a dim, arg-reductions, var/std,
any/all, _is_all_true/_is_any_true, count_nonzero, logsumexp, vector norms.

Dtypes follow torch's reduction rules, read from ``torch._prims_common.reduction_dtypes``
(through ``_reduction_dtypes`` below): a ``dtype=`` argument casts the input first;
sum/prod/nansum of integers or bools accumulate in int64; f16/bf16 accumulate in float32
and are cast back. ``dim=None`` (and, except for any/all, ``dim=[]``) reduces every dim.

Empty reductions: sum/prod/count have identities; amax/amin/max/min/arg-reductions of an
empty dim raise like torch (``IndexError`` for a named dim, ``RuntimeError`` for a full
reduction). Shapes are static, so these checks hold under ``jax.jit`` too.
NaN: max/min/amax/amin propagate NaN and arg-reductions pick the first NaN, as torch.
"""

from __future__ import annotations

import builtins
import functools
import math
import warnings

import jax.numpy as jnp
import numpy as np
import torch

from torchjax._compat.torch import REDUCTION_OUTPUT_TYPE_KIND, reduction_dtypes
from torchjax.ops.registry import Kind, lowering
from torchjax.tensor import dtypes
from torchjax.tensor.dtypes import aten_type_name as _type_name

aten = torch.ops.aten
_R = REDUCTION_OUTPUT_TYPE_KIND
_LONG = np.dtype(np.int64)

__all__ = ["reduce_dims", "wrap_dim"]


# ---------------------------------------------------------------------------------------
# helpers shared by the reduction, cumulative and sort modules


def wrap_dim(dim: int, ndim: int) -> int:
    """``dim`` made non-negative, with torch's rule that a 0-d tensor has dims 0 and -1."""
    rank = builtins.max(ndim, 1)
    if not -rank <= dim < rank:
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-rank}, {rank - 1}], "
            f"but got {dim})"
        )
    return dim % rank


def check_rank(ndim: int) -> None:
    """torch's limit for reductions over given dims (a 64-bit mask of dims)."""
    if ndim > 64:
        raise RuntimeError("only tensors with up to 64 dims are supported")


def reduce_dims(ndim: int, dim, *, empty_is_all: bool = True) -> tuple[int, ...]:
    """The axes a reduction over ``dim`` (None, an int or a list) runs over.

    ``dim=[]`` means every axis unless ``empty_is_all`` is False (any/all). On a 0-d
    tensor every valid dim reduces nothing.
    """
    if dim is None or (empty_is_all and isinstance(dim, (list, tuple)) and not dim):
        return tuple(range(ndim))  # a full reduction has no limit, as on CPU
    check_rank(ndim)
    dims = [dim] if isinstance(dim, int) else list(dim)
    axes = [wrap_dim(d, ndim) for d in dims]
    seen = set()
    for a in axes:
        if a in seen:
            raise RuntimeError(f"dim {a} appears multiple times in the list of dims")
        seen.add(a)
    return tuple(axes) if ndim else ()


@functools.lru_cache(maxsize=None)
def _dtypes_cached(in_dtype, kind, dtype, ints_to_long):
    t_in = dtypes.to_torch_dtype(in_dtype)
    if dtype is None and ints_to_long and not (t_in.is_floating_point or t_in.is_complex):
        dtype = torch.int64
    compute, result = reduction_dtypes(None, kind, dtype if dtype is not None else t_in)
    return dtypes.to_jax_dtype(compute), dtypes.to_jax_dtype(result) if result else None


def _reduction_dtypes(x, kind, dtype=None, *, ints_to_long=False):
    """(computation, result) jax dtypes of a reduction of ``x``, torch's rule.

    ``ints_to_long`` is the sum/prod rule: integer and bool inputs without ``dtype=``
    reduce in int64. ``result`` is None for ``KEEP_PROMOTED_TYPE``.
    """
    return _dtypes_cached(np.dtype(x.dtype), kind, dtype, ints_to_long)


def cast_first(x, dtype):
    """``x`` in ``dtype=`` (a torch dtype or None) before it is reduced: CPU converts the
    input to the requested type first, so ``sum(x, dtype=torch.bfloat16)`` adds values
    already rounded to bfloat16 (in float32), not ``x``'s own."""
    if dtype is None:
        return x
    jdt = dtypes.to_jax_dtype(dtype)
    return x if x.dtype == jdt else x.astype(jdt)


def _is_inexact(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _count(x, axes) -> int:
    return math.prod(x.shape[a] for a in axes)


def _check_nonempty(op: str, x, axes, dim_given: bool, exc=IndexError) -> None:
    """torch's error for a reduction without identity (max, argmax...) over no elements."""
    if not dim_given:
        if x.size == 0:
            raise RuntimeError(
                f"{op}(): Expected reduction dim to be specified for input.numel() == 0. "
                f"Specify the reduction dim with the 'dim' argument. (in aten::{op})"
            )
        return
    for a in axes:
        if x.shape[a] == 0:
            raise exc(f"{op}(): Expected reduction dim {a} to have non-zero size. (in aten::{op})")


def _dim_given(dim) -> bool:
    return dim is not None and not (isinstance(dim, (list, tuple)) and not dim)


# ---------------------------------------------------------------------------------------
# sums and products


@lowering(aten.sum.default, aten.sum.dim_IntList)
def sum(self, dim=None, keepdim=False, *, dtype=None):
    """aten::sum - sum over ``dim`` (all dims if None or []).

    Dtypes: ``dtype=`` casts the input first (``cast_first``); int/bool -> int64; f16/bf16
    accumulate in float32. Empty dims sum to 0. Reference: torch/_refs ``sum``; jnp.sum.
    """
    self = cast_first(self, dtype)
    compute, result = _reduction_dtypes(self, _R.SAME, dtype, ints_to_long=True)
    axes = reduce_dims(self.ndim, dim)
    return jnp.sum(self.astype(compute), axis=axes, keepdims=keepdim).astype(result)


@lowering(aten.nansum.default)
def nansum(self, dim=None, keepdim=False, *, dtype=None):
    """aten::nansum - sum over ``dim`` treating NaN as 0. Dtypes as ``sum``."""
    self = cast_first(self, dtype)
    compute, result = _reduction_dtypes(self, _R.SAME, dtype, ints_to_long=True)
    x = self.astype(compute)
    if _is_inexact(x):
        x = jnp.where(jnp.isnan(x), jnp.zeros((), compute), x)
    axes = reduce_dims(self.ndim, dim)
    return jnp.sum(x, axis=axes, keepdims=keepdim).astype(result)


@lowering(aten.prod.default, aten.prod.dim_int)
def prod(self, dim=None, keepdim=False, *, dtype=None):
    """aten::prod - product over one ``dim`` (or all). Dtypes as ``sum``; empty -> 1."""
    self = cast_first(self, dtype)
    compute, result = _reduction_dtypes(self, _R.SAME, dtype, ints_to_long=True)
    axes = reduce_dims(self.ndim, dim)
    return jnp.prod(self.astype(compute), axis=axes, keepdims=keepdim).astype(result)


def _float_result_check(op: str, x, dtype) -> None:
    t = dtype if dtype is not None else dtypes.to_torch_dtype(x.dtype)
    if not (t.is_floating_point or t.is_complex):
        raise RuntimeError(
            f"{op}(): could not infer output dtype. Input dtype must be either a floating "
            f"point or complex dtype. Got: {_type_name(t)} (in aten::{op})"
        )


@lowering(aten.mean.default, aten.mean.dim)
def mean(self, dim=None, keepdim=False, *, dtype=None):
    """aten::mean - arithmetic mean over ``dim`` (all dims if None or []).

    Dtypes: float/complex only (torch raises for integer input without ``dtype=``);
    f16/bf16 computed in float32. Empty -> NaN (0/0), as torch. Reference: _refs.mean.
    """
    _float_result_check("mean", self, dtype)
    compute, _ = _reduction_dtypes(self, _R.KEEP_PROMOTED_TYPE, dtype)
    result = dtypes.to_jax_dtype(dtype) if dtype is not None else self.dtype
    axes = reduce_dims(self.ndim, dim)
    total = jnp.sum(self.astype(compute), axis=axes, keepdims=keepdim)
    return (total / jnp.asarray(_count(self, axes), dtype=compute)).astype(result)


# ---------------------------------------------------------------------------------------
# max / min and arg-reductions


def _extreme(op: str, jfn, self, dim, keepdim):
    axes = reduce_dims(self.ndim, dim)
    _check_nonempty(op, self, axes, _dim_given(dim))
    return jfn(self, axis=axes, keepdims=keepdim)


@lowering(aten.amax.default)
def amax(self, dim=(), keepdim=False):
    """aten::amax - maximum over ``dim`` (all if []); NaN propagates; empty dim raises."""
    return _extreme("amax", jnp.max, self, dim, keepdim)


@lowering(aten.amin.default)
def amin(self, dim=(), keepdim=False):
    """aten::amin - minimum over ``dim`` (all if []); NaN propagates; empty dim raises."""
    return _extreme("amin", jnp.min, self, dim, keepdim)


def _arg_extreme(op: str, jfn, self, dim, keepdim):
    if self.dtype == np.bool_:
        raise RuntimeError(f"{op}(): does not support bool input (in aten::{op})")
    if dim is None:
        if self.size == 0:
            raise IndexError(
                f"{op}(): Expected reduction dim to be specified for "
                f"input.numel() == 0. (in aten::{op})"
            )
        idx = jfn(self.reshape(-1))
        return (idx.reshape((1,) * self.ndim) if keepdim else idx).astype(_LONG)
    check_rank(self.ndim)
    axis = wrap_dim(dim, self.ndim)
    if self.ndim == 0:
        return jnp.zeros((), _LONG)
    _check_nonempty(op, self, (axis,), True)
    return jfn(self, axis=axis, keepdims=keepdim).astype(_LONG)


@lowering(aten.argmax.default)
def argmax(self, dim=None, keepdim=False):
    """aten::argmax - index (int64) of the maximum over ``dim`` or the flattened tensor.

    Ties pick the first index; a NaN counts as the maximum (first NaN wins), as torch.
    """
    return _arg_extreme("argmax", jnp.argmax, self, dim, keepdim)


@lowering(aten.argmin.default)
def argmin(self, dim=None, keepdim=False):
    """aten::argmin - index (int64) of the minimum; ties and NaN as ``argmax``."""
    return _arg_extreme("argmin", jnp.argmin, self, dim, keepdim)


def _full_extreme(op, jfn, self):
    _check_nonempty(op, self, (), False)
    return jfn(self)


def _dim_extreme(op, vfn, ifn, self, dim, keepdim):
    check_rank(self.ndim)
    axis = wrap_dim(dim, self.ndim)
    if self.ndim == 0:
        return self, jnp.zeros((), _LONG)
    _check_nonempty(op, self, (axis,), True)
    return (
        vfn(self, axis=axis, keepdims=keepdim),
        ifn(self, axis=axis, keepdims=keepdim).astype(_LONG),
    )


@lowering(aten.max.default)
def max(self):
    """aten::max - maximum of all elements (0-d); NaN propagates; empty raises."""
    return _full_extreme("max", jnp.max, self)


@lowering(aten.min.default)
def min(self):
    """aten::min - minimum of all elements (0-d); NaN propagates; empty raises."""
    return _full_extreme("min", jnp.min, self)


@lowering(aten.max.dim)
def max_dim(self, dim, keepdim=False):
    """aten::max.dim - (values, indices) of the maximum over ``dim``; indices int64.

    Ties pick the first index; NaN is the maximum (first NaN), as torch on CPU.
    """
    return _dim_extreme("max", jnp.max, jnp.argmax, self, dim, keepdim)


@lowering(aten.min.dim)
def min_dim(self, dim, keepdim=False):
    """aten::min.dim - (values, indices) of the minimum over ``dim``; as ``max.dim``."""
    return _dim_extreme("min", jnp.min, jnp.argmin, self, dim, keepdim)


@lowering(aten.aminmax.default)
def aminmax(self, *, dim=None, keepdim=False):
    """aten::aminmax - (min, max) over ``dim`` (all if None); empty raises."""
    if dim is None:
        if self.size == 0:
            raise RuntimeError(
                "aminmax(): cannot compute aminmax over an empty dimension as "
                "the operation has no identity. (in aten::aminmax)"
            )
        lo, hi = jnp.min(self), jnp.max(self)
        if keepdim:
            lo, hi = lo.reshape((1,) * self.ndim), hi.reshape((1,) * self.ndim)
        return lo, hi
    axes = reduce_dims(self.ndim, dim)
    if builtins.any(self.shape[a] == 0 for a in axes):
        raise IndexError(
            f"aminmax(): Expected reduction dim {axes[0]} to have non-zero size. (in aten::aminmax)"
        )
    return (jnp.min(self, axis=axes, keepdims=keepdim), jnp.max(self, axis=axes, keepdims=keepdim))


# ---------------------------------------------------------------------------------------
# variance and standard deviation


def _var_parts(self, dim, correction, keepdim, op):
    t = dtypes.to_torch_dtype(self.dtype)
    if not (t.is_floating_point or t.is_complex):
        raise RuntimeError(
            f"std and var only support floating point and complex dtypes "
            f"(in aten::{op}, got {_type_name(t)})"
        )
    compute, result = _reduction_dtypes(self, _R.COMPLEX_TO_FLOAT)
    axes = reduce_dims(self.ndim, dim)
    n = _count(self, axes)
    c = 1 if correction is None else correction
    if n - c <= 0:
        warnings.warn(
            f"{op}(): degrees of freedom is <= 0. Correction should be strictly less than the "
            "reduction factor (input numel divided by output numel).",
            UserWarning,
            stacklevel=5,
        )
    x = self.astype(compute)
    mean = jnp.sum(x, axis=axes, keepdims=True) / jnp.asarray(n, dtype=compute)
    d = x - mean
    sq = (d.real * d.real + d.imag * d.imag) if jnp.iscomplexobj(d) else d * d
    dof = jnp.asarray(builtins.max(0, n - c), dtype=sq.dtype)
    var = jnp.sum(sq, axis=axes, keepdims=keepdim) / dof
    if not keepdim:
        mean = jnp.squeeze(mean, axis=axes)
    return var, mean.astype(self.dtype), result


@lowering(aten.var.correction)
def var(self, dim=None, *, correction=None, keepdim=False):
    """aten::var.correction - sum(|x - mean|^2) / max(0, N - correction) over ``dim``.

    Dtypes: float/complex only; complex -> real result; f16/bf16 in float32. ``correction``
    defaults to 1. N <= correction gives inf/NaN with torch's warning. Reference: _refs.var.
    """
    v, _, result = _var_parts(self, dim, correction, keepdim, "var")
    return v.astype(result)


@lowering(aten.std.correction)
def std(self, dim=None, *, correction=None, keepdim=False):
    """aten::std.correction - square root of ``var.correction``; same dtypes."""
    v, _, result = _var_parts(self, dim, correction, keepdim, "std")
    return jnp.sqrt(v).astype(result)


@lowering(aten.var_mean.correction)
def var_mean(self, dim=None, *, correction=None, keepdim=False):
    """aten::var_mean.correction - (var, mean); mean keeps the input dtype (complex too)."""
    v, m, result = _var_parts(self, dim, correction, keepdim, "var_mean")
    return v.astype(result), m


@lowering(aten.std_mean.correction)
def std_mean(self, dim=None, *, correction=None, keepdim=False):
    """aten::std_mean.correction - (std, mean); as ``var_mean``."""
    v, m, result = _var_parts(self, dim, correction, keepdim, "std_mean")
    return jnp.sqrt(v).astype(result), m


# ---------------------------------------------------------------------------------------
# logical reductions and counts


def _logical(jfn, self, dim, keepdim):
    # torch keeps uint8 for uint8 input (a legacy rule); every other dtype gives bool.
    axes = reduce_dims(self.ndim, dim, empty_is_all=False)
    out = jfn(self != 0, axis=axes, keepdims=keepdim)
    return out.astype(self.dtype) if self.dtype == np.uint8 else out


@lowering(aten.any.default, aten.any.dim, aten.any.dims)
def any(self, dim=None, keepdim=False):
    """aten::any - whether any element over ``dim`` is nonzero (None: all dims; []: none).

    Dtypes: bool result (uint8 for uint8 input, as torch)."""
    return _logical(jnp.any, self, dim, keepdim)


@lowering(aten.all.default, aten.all.dim, aten.all.dims)
def all(self, dim=None, keepdim=False):
    """aten::all - whether every element over ``dim`` is nonzero; as ``any``."""
    return _logical(jnp.all, self, dim, keepdim)


def _is_true(jfn, op, self):
    name = jfn.__name__  # "all" / "any"
    # torch asserts a bool input (a RuntimeError); these back torch.all/any of 0-d results
    # in torch._refs and Tensor.__bool__ of comparisons under tracing.
    if self.dtype != np.bool_:
        raise RuntimeError(
            f"aten::{op}: expected a bool tensor, got "
            f"{_type_name(dtypes.to_torch_dtype(self.dtype))}; compare it first (t != 0) or "
            f"call torch.{name}(t)"
        )
    return jfn(self)


@lowering(aten._is_all_true.default)
def _is_all_true(self):
    """aten::_is_all_true - 0-d bool: every element of a bool tensor is True (True if
    empty)."""
    return _is_true(jnp.all, "_is_all_true", self)


@lowering(aten._is_any_true.default)
def _is_any_true(self):
    """aten::_is_any_true - 0-d bool: some element of a bool tensor is True (False if
    empty)."""
    return _is_true(jnp.any, "_is_any_true", self)


@lowering(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def count_nonzero(self, dim=None):
    """aten::count_nonzero - number of nonzero elements over ``dim`` (all if None/[]);
    int64."""
    axes = reduce_dims(self.ndim, dim)
    return jnp.sum(self != 0, axis=axes, dtype=_LONG)


# ---------------------------------------------------------------------------------------
# logsumexp and norms


@lowering(aten.logsumexp.default, promote=Kind.INT_TO_FLOAT, promote_args=("self",))
def logsumexp(self, dim, keepdim=False):
    """aten::logsumexp - log(sum(exp(x))) over ``dim``, stable (max subtracted).

    Dtypes: int/bool -> default float; f16/bf16 computed in float32. +-inf handled as
    torch (all -inf -> -inf, any +inf -> +inf); empty -> -inf. Reference: _refs.logsumexp.
    """
    axes = reduce_dims(self.ndim, dim)
    if self.size == 0:
        shape = (
            tuple(1 if i in axes else s for i, s in enumerate(self.shape))
            if keepdim
            else tuple(s for i, s in enumerate(self.shape) if i not in axes)
        )
        return jnp.full(shape, -jnp.inf, dtype=self.dtype)
    m = jnp.max(self.real if jnp.iscomplexobj(self) else self, axis=axes, keepdims=True)
    m = jnp.where(jnp.isinf(m), jnp.zeros((), m.dtype), m)
    out = jnp.log(jnp.sum(jnp.exp(self - m), axis=axes, keepdims=True)) + m
    return out if keepdim else jnp.squeeze(out, axis=axes)


@lowering(aten.linalg_vector_norm.default)
def linalg_vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None):
    """aten::linalg_vector_norm - (sum |x|^ord)^(1/ord) over ``dim`` (all if None/[]).

    ord: 0 counts nonzeros, inf/-inf are max/min of |x|, 1 and 2 take direct forms.
    Dtypes: float/complex only; ``dtype=`` casts first; complex -> real; f16/bf16 in
    float32. inf/negative ord over no elements raises (no identity), as torch.
    Reference: torch.linalg.vector_norm; _refs.linalg.vector_norm.
    """
    t = dtype if dtype is not None else dtypes.to_torch_dtype(self.dtype)
    if not (t.is_floating_point or t.is_complex):
        raise RuntimeError(
            "linalg.vector_norm: Expected a floating point or complex tensor "
            f"as input. Got {_type_name(t)} (in aten::linalg_vector_norm)"
        )
    compute, result = _reduction_dtypes(self, _R.COMPLEX_TO_FLOAT, dtype)
    axes = reduce_dims(self.ndim, dim)
    ord = float(ord)
    if (ord < 0 or math.isinf(ord)) and (_count(self, axes) == 0):
        raise RuntimeError(
            f"linalg.vector_norm cannot compute the {ord:g} norm on an empty tensor because "
            "the operation does not have an identity (in aten::linalg_vector_norm)"
        )
    a = jnp.abs(self.astype(compute))
    if ord == 0:
        out = jnp.sum((a != 0).astype(a.dtype), axis=axes, keepdims=keepdim)
    elif ord == math.inf:
        out = jnp.max(a, axis=axes, keepdims=keepdim)
    elif ord == -math.inf:
        out = jnp.min(a, axis=axes, keepdims=keepdim)
    elif ord == 1:
        out = jnp.sum(a, axis=axes, keepdims=keepdim)
    elif ord == 2:
        out = jnp.sqrt(jnp.sum(a * a, axis=axes, keepdims=keepdim))
    else:
        p = jnp.asarray(ord, dtype=a.dtype)
        out = jnp.sum(a**p, axis=axes, keepdims=keepdim) ** (1 / p)
    return out.astype(result)
