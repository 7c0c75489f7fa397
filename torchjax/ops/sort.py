"""Sorting and selection: sort, topk, kthvalue, median, nanmedian, mode, unique.

Every op here is built on one stable ``lax.sort`` with torch's order (``_sort_keys``):
NaN sorts as the largest value (whatever its sign bit), -0.0 and 0.0 are equal, and
equal elements keep their input order, ascending or descending. Indices are int64.
``argsort`` and ``msort`` are torch composites of ``sort``.

Tie-breaking: torch documents the indices of tied elements as unspecified for topk,
kthvalue, median and mode; we return the stable-sort choice (mode: the last
occurrence, as torch's CPU kernel). The unique family has data-dependent output shapes:
it runs in eager only and raises a RuntimeError under a jax trace (``torchjax.jit``).

Note [topk ties]
CPU's ``topk`` (``topk_impl_loop``, aten/src/ATen/native/TopKImpl.h) runs libstdc++'s
``std::nth_element`` then ``std::sort`` of the first k - 1 (``std::partial_sort`` when
``k * 64 <= n``) on (value, index) pairs compared by value. Those are unstable: which of
several equal elements is returned follows from the whole row's sequence of swaps
(median-of-three pivots, Hoare partitions, heap moves), so no rule on indices matches
it: lower-first and higher-first each agree with CPU on 45-50% of random 4-wide rows of
a few distinct values, and on at most 4% of such rows of 32 elements or more (but for
top-1 of 64 or more, where heap selection keeps the first maximum, as we do). It matters
for bfloat16 MoE routers, whose probabilities tie often. A transcription of those
algorithms matched CPU on 4,000 random tie-heavy rows of 1 to 2,000 elements, but
replayed in jax inside the op (under ``lax.cond``, for rows with ties only) it added
0.35-1.2 s of XLA compile per topk shape on CPU (0.04 s without), once per router in a
compiled model, and its loops would run on every decode step whose router ties. The
stable choice is as close to float32 as CPU's: a tie hides which probability float32
ranks first.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.ops.reduction import wrap_dim
from torchjax.ops.registry import lowering

aten = torch.ops.aten
_LONG = np.dtype(np.int64)


def _sort_keys(x, descending: bool) -> tuple:
    """lax.sort keys (compared lexicographically) giving torch's order of ``x``."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        nan = jnp.isnan(x)
        zero = jnp.zeros((), x.dtype)
        # -0.0 -> 0.0 (torch compares them equal; lax.sort's total order does not), and
        # the NaN flag is a key of its own so NaN payloads and signs do not matter.
        v = jnp.where(nan | (x == 0), zero, x)
        return (~nan, -v) if descending else (nan, v)
    # ~x reverses the order of ints (it is -x - 1: no overflow at the minimum) and bools.
    return (~x,) if descending else (x,)


def _check_real(op: str, x) -> None:
    if jnp.iscomplexobj(x):
        raise RuntimeError(
            f"{op}(): complex dtypes are not supported, as in torch (in aten::{op}; got {x.dtype})"
        )


def _no_bool(op: str, x) -> None:
    # CPU's selection kernels have no bool instantiation.
    if x.dtype == np.bool_:
        raise NotImplementedError(f"\"{op}\" not implemented for 'Bool'")


def _sorted(x, axis: int, descending: bool = False):
    """(values, int64 indices) of ``x`` sorted stably along ``axis`` in torch's order."""
    keys = _sort_keys(x, descending)
    idx = lax.broadcasted_iota(_LONG, x.shape, axis)
    out = lax.sort((*keys, x, idx), dimension=axis, is_stable=True, num_keys=len(keys))
    return out[-2], out[-1]


@lowering(aten.sort.default, aten.sort.stable)
def sort(self, dim=-1, descending=False, *, stable=False):
    """aten::sort - (values, indices) of ``self`` sorted along ``dim``.

    Always stable (``stable=False`` allows any order, so the stable one is valid). NaN is
    the largest value: last ascending, first descending. Complex raises, as torch on CPU.
    Reference: torch.sort; jax.lax.sort.
    """
    _check_real("sort", self)
    axis = wrap_dim(dim, self.ndim)
    if self.ndim == 0:
        return self, jnp.zeros((), _LONG)
    return _sorted(self, axis, descending)


@lowering(aten.topk.default)
def topk(self, k, dim=-1, largest=True, sorted=True):
    """aten::topk - the ``k`` largest (or smallest) elements along ``dim`` and indices.

    Results are always in sorted order (valid for ``sorted=False`` too); NaN counts as
    the largest value. ``k`` outside [0, size] raises like torch. Reference: torch.topk.
    """
    _check_real("topk", self)
    if self.dtype == np.bool_:
        raise RuntimeError("topk does not support bool dtypes (in aten::topk)")
    axis = wrap_dim(dim, self.ndim)
    size = self.shape[axis] if self.ndim else 1
    if not 0 <= k <= size:
        raise RuntimeError(
            f"selected index k out of range (in aten::topk: k={k}, size of dim {axis} is {size})"
        )
    if self.ndim == 0:  # torch returns the element for k=0 too
        return self, jnp.zeros((), _LONG)
    values, indices = _sorted(self, axis, descending=largest)
    return (lax.slice_in_dim(values, 0, k, axis=axis), lax.slice_in_dim(indices, 0, k, axis=axis))


def _select(values, indices, pos, axis, keepdim):
    """Pick sorted position ``pos`` (an int, or an array broadcastable to the reduced
    shape with keepdims) along ``axis`` from both sorted arrays."""
    if isinstance(pos, int):
        v = lax.index_in_dim(values, pos, axis, keepdims=True)
        i = lax.index_in_dim(indices, pos, axis, keepdims=True)
    else:
        v = jnp.take_along_axis(values, pos, axis=axis)
        i = jnp.take_along_axis(indices, pos, axis=axis)
    if not keepdim:
        v, i = jnp.squeeze(v, axis), jnp.squeeze(i, axis)
    return v, i


def _reduced_dim(op: str, self, dim):
    axis = wrap_dim(dim, self.ndim)
    if self.ndim and self.shape[axis] == 0:
        raise IndexError(
            f"{op}(): Expected reduction dim {axis} to have non-zero size. (in aten::{op})"
        )
    return axis


@lowering(aten.kthvalue.default)
def kthvalue(self, k, dim=-1, keepdim=False):
    """aten::kthvalue - the ``k``-th smallest element (1-based) along ``dim`` and its index.

    NaN counts as the largest value. ``k`` outside [1, size] raises like torch.
    Reference: torch.kthvalue.
    """
    _no_bool("kthvalue", self)
    axis = _reduced_dim("kthvalue", self, dim)
    size = self.shape[axis] if self.ndim else 1
    if not 1 <= k <= size:
        raise RuntimeError(
            f"kthvalue(): selected number k out of range for dimension "
            f"{axis} (in aten::kthvalue: k={k}, size {size})"
        )
    if self.ndim == 0:  # CPU returns a 0-d tensor itself, complex included
        return self, jnp.zeros((), _LONG)
    if jnp.iscomplexobj(self):  # CPU's kernel has no complex path (the dtype table's text)
        name = "ComplexFloat" if self.dtype == jnp.complex64 else "ComplexDouble"
        raise NotImplementedError(f"\"kthvalue_cpu\" not implemented for '{name}'")
    values, indices = _sorted(self, axis)
    return _select(values, indices, k - 1, axis, keepdim)


def _median(self, axis, keepdim, ignore_nan: bool):
    values, indices = _sorted(self, axis)
    n = self.shape[axis]
    if not jnp.issubdtype(self.dtype, jnp.floating):
        return _select(values, indices, (n - 1) // 2, axis, keepdim)
    nans = jnp.sum(jnp.isnan(self), axis=axis, keepdims=True, dtype=_LONG)
    if ignore_nan:
        # all-NaN rows give position 0: a NaN, with its index, as torch.
        pos = jnp.maximum((n - nans - 1) // 2, 0)
    else:
        # any NaN makes the median NaN: the first NaN in sorted order, as torch.
        pos = jnp.where(nans > 0, n - nans, (n - 1) // 2)
    return _select(values, indices, pos, axis, keepdim)


@lowering(aten.median.default)
def median(self):
    """aten::median - the lower median of all elements (0-d); NaN if any is NaN or the
    tensor is empty, as torch."""
    _check_real("median", self)
    _no_bool("median", self)
    if self.size == 0:
        return jnp.full((), jnp.nan, dtype=self.dtype)
    return _median(self.reshape(-1), 0, False, ignore_nan=False)[0]


@lowering(aten.median.dim)
def median_dim(self, dim, keepdim=False):
    """aten::median.dim - (lower median, its index) along ``dim``; NaN propagates (the
    first NaN's index); an empty dim raises IndexError, as torch."""
    _check_real("median", self)
    _no_bool("median", self)
    axis = _reduced_dim("median", self, dim)
    if self.ndim == 0:
        return self, jnp.zeros((), _LONG)
    return _median(self, axis, keepdim, ignore_nan=False)


@lowering(aten.nanmedian.default)
def nanmedian(self):
    """aten::nanmedian - the lower median of the non-NaN elements (NaN if none)."""
    _check_real("nanmedian", self)
    _no_bool("median", self)
    if self.size == 0:
        return jnp.full((), jnp.nan, dtype=self.dtype)
    return _median(self.reshape(-1), 0, False, ignore_nan=True)[0]


@lowering(aten.nanmedian.dim)
def nanmedian_dim(self, dim, keepdim=False):
    """aten::nanmedian.dim - (lower median ignoring NaN, its index) along ``dim``."""
    _check_real("nanmedian", self)
    _no_bool("median", self)
    axis = _reduced_dim("nanmedian", self, dim)
    if self.ndim == 0:
        return self, jnp.zeros((), _LONG)
    return _median(self, axis, keepdim, ignore_nan=True)


@lowering(aten.mode.default)
def mode(self, dim=-1, keepdim=False):
    """aten::mode - (most frequent value, index of its last occurrence) along ``dim``.

    Ties between values pick the smallest value, as torch. Built from the stable sort:
    run lengths of equal sorted values, the longest run's end. Reference: torch.mode.
    """
    _check_real("mode", self)
    axis = _reduced_dim("mode", self, dim)
    if self.ndim == 0:
        return self, jnp.zeros((), _LONG)
    values, indices = _sorted(self, axis)
    n = self.shape[axis]
    pos = lax.broadcasted_iota(_LONG, values.shape, axis)
    first = lax.slice_in_dim(values, 0, n - 1, axis=axis)
    rest = lax.slice_in_dim(values, 1, n, axis=axis)
    differs = first != rest
    true = jnp.ones_like(lax.index_in_dim(differs if n > 1 else values, 0, axis), bool)
    starts = jnp.concatenate([true, differs], axis=axis)
    ends = jnp.concatenate([differs, true], axis=axis)
    run_start = lax.cummax(jnp.where(starts, pos, 0), axis=axis)
    run_len = jnp.where(ends, pos - run_start + 1, 0)
    # argmax takes the first longest run: the smallest value among equally frequent ones.
    best = jnp.argmax(run_len, axis=axis, keepdims=True)
    return _select(values, indices, best, axis, keepdim)


# ---------------------------------------------------------------------------------------
# unique: data-dependent shapes, eager only


def _concrete(op: str, fn):
    # Under a trace jax refuses to read the values; the error layer turns that into
    # DataDependentError naming the op (Note [One error layer]).
    return fn()


def _empty_long():
    return jnp.zeros((0,), _LONG)


def _unique_flat(op, self, return_inverse, return_counts):
    _check_real(op, self)

    def run():
        return jnp.unique(
            self.reshape(-1), return_inverse=True, return_counts=True, equal_nan=False
        )

    values, inverse, counts = _concrete(op, run)
    inverse = inverse.reshape(self.shape).astype(_LONG) if return_inverse else _empty_long()
    counts = counts.astype(_LONG) if return_counts else _empty_long()
    return values, inverse, counts


@lowering(aten._unique2.default)
def _unique2(self, sorted=True, return_inverse=False, return_counts=False):
    """aten::_unique2 - (sorted unique elements, inverse, counts) of the flattened input.

    Output is sorted even for ``sorted=False`` (as torch on CPU); NaNs are all distinct,
    as torch. inverse/counts are empty int64 tensors unless requested. Eager only.
    """
    return _unique_flat("_unique2", self, return_inverse, return_counts)


@lowering(aten._unique.default)
def _unique(self, sorted=True, return_inverse=False):
    """aten::_unique - (sorted unique elements, inverse); as ``_unique2``. Eager only."""
    values, inverse, _ = _unique_flat("_unique", self, return_inverse, False)
    return values, inverse


@lowering(aten.unique_dim.default)
def unique_dim(self, dim, sorted=True, return_inverse=False, return_counts=False):
    """aten::unique_dim - unique slices along ``dim`` (sorted lexicographically), inverse
    (one index per slice) and counts. Eager only."""
    _check_real("unique_dim", self)
    axis = wrap_dim(dim, self.ndim)
    if _empty_along(self, axis, "unique_dim"):  # no slices: empty inverse and counts
        return self, _empty_long(), _empty_long()

    def run():
        return jnp.unique(self, axis=axis, return_inverse=True, return_counts=True, equal_nan=False)

    values, inverse, counts = _concrete("unique_dim", run)
    inverse = inverse.reshape(-1).astype(_LONG) if return_inverse else _empty_long()
    counts = counts.astype(_LONG) if return_counts else _empty_long()
    return values, inverse, counts


def _empty_along(self, axis, op) -> bool:
    """True when ``self`` is empty along ``axis``; torch's error when it is empty only
    along another dimension (the slices would have no length to compare)."""
    if any(n == 0 for i, n in enumerate(self.shape) if i != axis):
        raise RuntimeError(
            f"aten::{op}: There are 0 sized dimensions, and they aren't selected, so unique "
            "cannot be applied"
        )
    return self.shape[axis] == 0


def _consecutive(op, self, axis, return_inverse, return_counts):
    if axis is not None:
        _empty_along(self, axis, op)
    x = self.reshape(-1) if axis is None else self
    ax = 0 if axis is None else axis
    n = x.shape[ax]
    if n == 0:
        inverse = jnp.zeros(self.shape if axis is None else (0,), _LONG)
        return x, inverse if return_inverse else _empty_long(), _empty_long()
    first = lax.slice_in_dim(x, 0, n - 1, axis=ax)
    rest = lax.slice_in_dim(x, 1, n, axis=ax)
    differs = first != rest
    if x.ndim > 1:
        differs = jnp.any(differs, axis=tuple(d for d in range(x.ndim) if d != ax))
    starts = jnp.concatenate([jnp.ones((1,), bool), differs])
    positions = _concrete(op, lambda: np.flatnonzero(np.asarray(starts)))
    values = jnp.take(x, jnp.asarray(positions, _LONG), axis=ax)
    inverse = jnp.cumsum(starts, dtype=_LONG) - 1
    if axis is None:
        inverse = inverse.reshape(self.shape)
    counts = jnp.diff(jnp.asarray(np.append(positions, n), _LONG))
    return (
        values,
        inverse if return_inverse else _empty_long(),
        counts if return_counts else _empty_long(),
    )


@lowering(aten.unique_consecutive.default)
def unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    """aten::unique_consecutive - collapse runs of equal elements (or slices along
    ``dim``): (values, inverse, counts). NaNs never compare equal. Eager only."""
    axis = None if dim is None else wrap_dim(dim, self.ndim)
    return _consecutive("unique_consecutive", self, axis, return_inverse, return_counts)


@lowering(aten.unique_dim_consecutive.default)
def unique_dim_consecutive(self, dim, return_inverse=False, return_counts=False):
    """aten::unique_dim_consecutive - ``unique_consecutive`` along ``dim``. Eager only."""
    return _consecutive(
        "unique_dim_consecutive", self, wrap_dim(dim, self.ndim), return_inverse, return_counts
    )
