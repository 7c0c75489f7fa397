"""Binning ops: searchsorted, bucketize, bincount, histc.

``searchsorted``/``bucketize`` run torch's own binary search (ATen/native/Bucketization.cpp,
``cus_lower_bound``/``cus_upper_bound``) vectorized over all values: the same predicates
(``!(seq[mid] >= v)`` left, ``!(seq[mid] > v)`` right), so NaN values and NaN-padded
sequences land where torch puts them, in O(log n) gathers per value.

``bincount`` has a data-dependent output length (``max(self) + 1``): it reads that value
eagerly and raises a RuntimeError naming the op under jit/trace, where it is not concrete
(pass ``minlength`` and compute on CPU, or use ``scatter_add`` with a static length).
``histc`` has a static length (``bins``) and works under jit; with ``min == max`` it takes
the data's range, as torch does.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax.device import _checks
from torchjax.ops.indexing import require_in_range
from torchjax.ops.registry import lowering, precheck
from torchjax.tensor import _errors

aten = torch.ops.aten


def _binary_search(seq, values, right: bool):
    """Positions of ``values`` (B, M) in the sorted rows of ``seq`` (B, N), as int64."""
    n = seq.shape[-1]
    start = jnp.zeros(values.shape, dtype=jnp.int64)
    end = jnp.full(values.shape, n, dtype=jnp.int64)
    for _ in range(n.bit_length() + 1):
        active = start < end
        mid = (start + end) // 2
        mid_val = jnp.take_along_axis(seq, jnp.clip(mid, 0, max(n - 1, 0)), axis=-1)
        go_right = ~(mid_val > values) if right else ~(mid_val >= values)
        start = jnp.where(active & go_right, mid + 1, start)
        end = jnp.where(active & ~go_right, mid, end)
    return start


_WARNED_NON_CONTIGUOUS: set[str] = set()


@precheck(aten.searchsorted)
def _non_contiguous_warnings(args, kwargs):
    """ATen's once-per-program performance warnings for non-contiguous operands (its
    kernel copies them; the jax program reads any layout, but the warning is torch's)."""
    for what, t in (("boundary", args[0]), ("input value", args[1] if len(args) > 1 else None)):
        if isinstance(t, torch.Tensor) and not t.is_contiguous():
            if what in _WARNED_NON_CONTIGUOUS:
                continue
            _WARNED_NON_CONTIGUOUS.add(what)
            warnings.warn(
                f"torch.searchsorted(): {what} tensor is non-contiguous, this will lower the "
                "performance due to extra data copy when converting non-contiguous tensor to "
                f"contiguous, please use contiguous {what} tensor if possible. This message "
                "will only appear once per program.",
                UserWarning,
                stacklevel=4,
            )


@lowering(aten.searchsorted)
def searchsorted(sorted_sequence, self, *, out_int32=False, right=False, side=None, sorter=None):
    """aten::searchsorted - index where each value of ``self`` would be inserted into the
    innermost dimension of ``sorted_sequence`` to keep it sorted.

    Shapes: ``sorted_sequence`` (N,) with any ``self``, or (*B, N) with ``self`` (*B, M);
    result has ``self``'s shape. ``sorter`` (same shape as ``sorted_sequence``) gives the
    order that sorts it. Dtypes: both inputs compared in their promoted dtype; result int64
    (int32 with ``out_int32``). ``side="right"`` or ``right=True`` gives the upper bound.
    Reference: torch.searchsorted; ATen/native/Bucketization.cpp.
    """
    seq = sorted_sequence
    scalar = not isinstance(self, jax.Array)
    if side is not None:
        torch._check(
            side in ("left", "right"),
            lambda: f"aten::searchsorted: side can only be 'left' or 'right' but got {side}",
        )
        torch._check(
            not (right and side == "left"),
            lambda: (
                "aten::searchsorted: side and right can't be set to opposites, got side "
                "of left while right was True"
            ),
        )
        right = side == "right"
    torch._check(
        seq.ndim == 1 or not (scalar or self.ndim == 0),
        lambda: (
            "aten::searchsorted: torch.searchsorted(): input value can be a scalar only when "
            f"boundaries tensor dimension is 1, but we got boundaries tensor dim({seq.ndim}) "
            "and input value's dim(0) numel(1)"
        ),
    )
    torch._check(
        seq.ndim == 1 or (not scalar and seq.shape[:-1] == self.shape[:-1]),
        lambda: (
            "aten::searchsorted: torch.searchsorted(): boundaries tensor should be 1 dimension "
            "or the first N-1 "
            "dimensions of boundaries tensor and input value tensor must match, but we got "
            f"boundaries tensor {list(seq.shape)} and input value tensor "
            f"{[] if scalar else list(self.shape)}"
        ),
    )
    if sorter is not None:
        torch._check(
            sorter.shape == seq.shape,
            lambda: (
                "aten::searchsorted: boundary and sorter must have the same size, but got "
                f"boundary tensor {list(seq.shape)} and sorter tensor {list(sorter.shape)}"
            ),
        )
        if sorter.size:
            # ATen's searchsorted_pre_check reads sorter's min and max back on CPU and
            # CUDA alike (BucketizationUtils.h): a check at the op, with its text.
            text = "torch.searchsorted(): sorter index out of range"
            require_in_range(sorter, 0, seq.shape[-1], RuntimeError, text, deferred=False)
        seq = jnp.take_along_axis(seq, sorter.astype(jnp.int64), axis=-1)
    # Only the comparison dtype: the result is an index, so no promote= (it would cast it).
    values = jnp.asarray(self, dtype=jnp.result_type(seq, self)) if scalar else self
    common = jnp.promote_types(seq.dtype, values.dtype)
    seq, values = seq.astype(common), values.astype(common)
    shape = values.shape
    if seq.ndim == 1:
        rows, vals = seq.reshape(1, -1), values.reshape(1, -1)
    else:
        # Sizes spelled out: with an empty boundary or batch, -1 has nothing to infer from.
        batch = math.prod(seq.shape[:-1])
        rows = seq.reshape(batch, seq.shape[-1])
        vals = values.reshape(batch, values.shape[-1])
    pos = _binary_search(rows, vals, right).reshape(shape)
    return pos.astype(jnp.int32 if out_int32 else jnp.int64)


@lowering(aten.bucketize)
def bucketize(self, boundaries, *, out_int32=False, right=False):
    """aten::bucketize - bucket index of each value of ``self`` given sorted 1-D
    ``boundaries``: ``searchsorted(boundaries, self, right=right)``.

    Shapes: result has ``self``'s shape (0-d for a Scalar ``self``). Dtypes: int64 (int32
    with ``out_int32``). Reference: torch.bucketize.
    """
    torch._check(
        boundaries.ndim == 1,
        lambda: (
            "aten::bucketize: boundaries tensor must be 1 dimension, but got dim("
            f"{boundaries.ndim})"
        ),
    )
    return searchsorted(boundaries, self, out_int32=out_int32, right=right)


def _concrete_int(op: str, x) -> int:
    # Under a trace jax refuses to read the value; the error layer turns that into
    # DataDependentError naming the op (Note [One error layer]).
    return int(x)


@lowering(aten.bincount)
def bincount(self, weights=None, minlength=0):
    """aten::bincount - count (or sum ``weights`` of) occurrences of each value in ``self``.

    Shapes: ``self`` 1-D non-negative integers; result (max(max(self) + 1, minlength),).
    Dtypes: int64 without weights; float32 weights give float32, other weights float64
    (torch's CPU rule). Eager only: the length is data-dependent (module docstring).
    Reference: torch.bincount; ATen/native/SummaryOps.cpp.
    """
    torch._check(minlength >= 0, lambda: "aten::bincount: minlength should be >= 0")
    torch._check(
        self.ndim == 1,
        lambda: (
            "aten::bincount: bincount only supports 1-d non-negative integral inputs, got "
            f"{self.ndim}-d input"
        ),
    )
    if not jnp.issubdtype(self.dtype, jnp.integer):
        raise NotImplementedError(f'aten::bincount: "bincount" not implemented for {self.dtype}')
    if weights is not None:
        torch._check(
            weights.ndim == 1 and weights.shape[0] == self.shape[0],
            lambda: (
                "aten::bincount: weights should be 1-d and have the same length as input, "
                f"got {list(weights.shape)} for input {list(self.shape)}"
            ),
        )
    if self.shape[0] == 0:
        length = minlength
    else:
        torch._check(
            _concrete_int("bincount", self.min()) >= 0,
            lambda: "aten::bincount: bincount only supports 1-d non-negative integral inputs.",
        )
        length = max(_concrete_int("bincount", self.max()) + 1, minlength)
    if weights is None:
        return jnp.zeros((length,), dtype=jnp.int64).at[self].add(1)
    dtype = jnp.float32 if weights.dtype == jnp.float32 else jnp.float64
    return jnp.zeros((length,), dtype=dtype).at[self].add(weights.astype(dtype))


def _cpp_double(v: float) -> str:
    """``v`` as C++'s ``operator<<`` prints a double (6 significant digits, glibc's
    ``-nan`` for a NaN with its sign bit set): torch's messages quote values so."""
    if math.isnan(v):
        return "-nan" if math.copysign(1.0, v) < 0 else "nan"
    return "%g" % v


def _not_finite(lo: float, hi: float) -> str:
    # CPU's text (ATen's histc_select_outer_bin_edges).
    return f"torch.histc: range of [{_cpp_double(lo)}, {_cpp_double(hi)}] is not finite"


def _widened(lo, hi, dtype, xp):
    """The histogram's edges (float64 scalars of ``xp``, NumPy or jax.numpy) with an empty
    range (``lo == hi``) widened as ATen's ``bins_edges_correction`` does: for float32 and
    float64 inputs to one step of the input's type or 1 further, whichever is wider
    (``1e10`` cannot move by 1 in float32), else by 1."""
    if dtype in (np.float32, np.float64):
        info = np.finfo(dtype)
        down = xp.nextafter(lo.astype(dtype), xp.asarray(info.min, dtype)).astype(np.float64)
        up = xp.nextafter(hi.astype(dtype), xp.asarray(info.max, dtype)).astype(np.float64)
        # std::min(down, lo - 1) and std::max(up, hi + 1), NaN handling included.
        new_lo = xp.where(lo - 1 < down, lo - 1, down)
        new_hi = xp.where(up < hi + 1, hi + 1, up)
    else:
        new_lo, new_hi = lo - 1, hi + 1
    same = lo == hi
    return xp.where(same, new_lo, lo), xp.where(same, new_hi, hi)


@lowering(aten.histc)
def histc(self, bins=100, min=0, max=0):
    """aten::histc - histogram of ``self`` with ``bins`` equal-width bins over [min, max].

    Shapes: any input; result (bins,). Dtypes: floating, and integers as on CUDA; result
    in the input dtype.
    Elements outside [min, max] (and NaN) are ignored; ``max`` falls in the last bin. With
    ``min == max`` the range is the data's min/max, widened if still equal (``_widened``).
    The bin of x is ``floor((x - min) * bins / (max - min))`` in the input dtype, the CPU
    kernel's linear interpolation. A range that is not finite raises CPU's error at the
    op: every torch backend reads the data's range back there (Note [Device-side checks]
    in torchjax/device/_checks.py). Reference: torch.histc; ATen/native/Histogram.cpp and
    cpu/HistogramKernel.cpp.
    """
    out_dtype = self.dtype
    if jnp.issubdtype(self.dtype, jnp.integer):
        # CUDA's histc takes integers (CPU's does not); "tpu" follows CUDA, as transformers'
        # grouped_mm MoE path expects off CPU. Bins computed in float64, counts as the input.
        self = self.astype(jnp.float64)
    elif not jnp.issubdtype(self.dtype, jnp.floating):
        raise NotImplementedError(f'aten::histc: "histogram" not implemented for {self.dtype}')
    torch._check(bins > 0, lambda: f"aten::histc: bins must be > 0, but got {bins}")
    x = self.reshape(-1)
    if min == max and x.size > 0:
        # The data's range, on the device: a check at the op (Note [Device-side checks]).
        lo, hi = _widened(x.min().astype(jnp.float64), x.max().astype(jnp.float64), out_dtype, jnp)
        _checks.require(
            ~(jnp.isfinite(lo) & jnp.isfinite(hi)),
            (lo, hi),
            RuntimeError,
            _not_finite,
            deferred=False,
        )
    else:
        # A given range: Python numbers, checked now as ATen checks them.
        lo, hi = (float(v) for v in _widened(np.float64(min), np.float64(max), out_dtype, np))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise _errors.verbatim(RuntimeError(_not_finite(lo, hi)))
        if not lo < hi:
            raise _errors.verbatim(RuntimeError("torch.histc: max must be larger than min"))
        lo, hi = jnp.asarray(lo, jnp.float64), jnp.asarray(hi, jnp.float64)
    lo, hi = lo.astype(self.dtype), hi.astype(self.dtype)
    pos = jnp.floor((x - lo) * np.asarray(bins, dtype=self.dtype) / (hi - lo)).astype(jnp.int64)
    pos = jnp.where(pos == bins, bins - 1, pos)
    keep = (x >= lo) & (x <= hi)
    pos = jnp.where(keep, pos, bins)
    return (
        jnp.zeros((bins,), dtype=self.dtype)
        .at[pos]
        .add(jnp.ones(x.shape, dtype=self.dtype), mode="drop")
        .astype(out_dtype)
    )
