"""Scans along one dim: cumsum, cumprod, cummax/cummin (values and indices), logcumsumexp.

Dtypes follow the reductions (torchjax/ops/reduction.py): ``dtype=`` casts first,
cumsum/cumprod of int/bool accumulate in int64, f16/bf16 accumulate in float32, and
float32/complex64 in 64 bits, as ATen's CPU kernels (``acc_type<float>`` is double
there): a float32 running sum of [3e7, 1, 1, 1, 1, -3e7] ends at 4, not 0.
A 0-d input is scanned as one element (dims 0 and -1 are valid), as torch.
Backward ops reach us as ordinary ops: cumsum's backward is a flipped cumsum,
``cumprod_backward`` and ``cummaxmin_backward`` are torch composites.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax._compat.torch import REDUCTION_OUTPUT_TYPE_KIND
from torchjax.ops import writeback
from torchjax.ops.reduction import _reduction_dtypes, cast_first, wrap_dim
from torchjax.ops.registry import handler, lowering
from torchjax.ops.writeback import write_into
from torchjax.tensor import dtypes

aten = torch.ops.aten
_LONG = np.dtype(np.int64)


def _scan(fn, x, dim):
    """``fn(x, axis)`` along ``dim``, a 0-d ``x`` handled as shape (1,)."""
    axis = wrap_dim(dim, x.ndim)
    if x.ndim == 0:
        out = fn(x.reshape(1), 0)
        return type(out)(o.reshape(()) for o in out) if isinstance(out, tuple) else out.reshape(())
    return fn(x, axis)


def _scan_dtypes(self, dtype):
    """(input cast to ``dtype=``, accumulation dtype, result dtype) of cumsum/cumprod."""
    self = cast_first(self, dtype)
    compute, result = _reduction_dtypes(
        self, REDUCTION_OUTPUT_TYPE_KIND.SAME, dtype, ints_to_long=True
    )
    if compute in (np.float32, np.complex64):
        compute = jnp.promote_types(compute, np.float64)
    return self, compute, result


@lowering(aten.cumsum.default)
def cumsum(self, dim, *, dtype=None):
    """aten::cumsum - running sum along ``dim``; int/bool -> int64, f16/bf16 in float32,
    float32/complex64 in 64 bits (module docstring).

    Reference: torch.cumsum; jax.lax.cumsum."""
    self, compute, result = _scan_dtypes(self, dtype)
    return _scan(lambda x, a: lax.cumsum(x, axis=a), self.astype(compute), dim).astype(result)


@lowering(aten.cumprod.default)
def cumprod(self, dim, *, dtype=None):
    """aten::cumprod - running product along ``dim``; dtypes as ``cumsum``.

    Reference: torch.cumprod; jax.lax.cumprod."""
    self, compute, result = _scan_dtypes(self, dtype)
    return _scan(lambda x, a: lax.cumprod(x, axis=a), self.astype(compute), dim).astype(result)


def _inplace_scan(func, functional, kernel: str):
    """``cumsum_``/``cumprod_`` as CPU: ``dtype=`` must be self's, and bool has no
    kernel (NotImplementedError) unless there is nothing to scan (0-d or empty); the
    functional op would give int64, which cannot be written back into bool."""
    name = func._schema.name

    def run(args, kwargs):
        self, dim = args[0], args[1]
        dtype = kwargs.get("dtype", args[2] if len(args) > 2 else None)
        if dtype is not None and dtype != self.dtype:
            raise RuntimeError(
                f"{name}: Bad in-place call: input tensor dtype "
                f"{writeback.dtype_name(self.dtype)} and output tensor dtype "
                f"{writeback.dtype_name(dtype)} should match"
            )
        if self.dtype == torch.bool:
            if self.dim() > 0 and self.numel() > 0:
                raise NotImplementedError(f"{name}: \"{kernel}\" not implemented for 'Bool'")
            return self
        return write_into(func, self, functional(self, dim))

    handler(func)(run)


_inplace_scan(aten.cumsum_.default, aten.cumsum.default, "cumsum_out_cpu")
_inplace_scan(aten.cumprod_.default, aten.cumprod.default, "cumprod_out_cpu")


def _cum_extreme(x, axis, later_wins):
    """(values, indices) of a running max/min: the pair (value, index) is scanned with
    ``later_wins(earlier, later)``, a total order (NaN above everything, ties going to
    the later index), so the combine is associative."""
    idx = lax.broadcasted_iota(_LONG, x.shape, axis)

    def combine(a, b):
        (va, ia), (vb, ib) = a, b
        take_b = later_wins(va, vb)
        return jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia)

    return lax.associative_scan(combine, (x, idx), axis=axis)


def _nan_or(pred, vb):
    if jnp.issubdtype(vb.dtype, jnp.inexact):
        return pred | jnp.isnan(vb)
    return pred


@lowering(aten.cummax.default)
def cummax(self, dim):
    """aten::cummax - (values, indices) of the running maximum along ``dim``.

    Indices int64. As torch on CPU: a tie moves the index to the later element; a NaN
    becomes the running maximum from where it appears (and a later NaN takes the index).
    """
    return _scan(lambda x, a: _cum_extreme(x, a, lambda va, vb: _nan_or(vb >= va, vb)), self, dim)


@lowering(aten.cummin.default)
def cummin(self, dim):
    """aten::cummin - (values, indices) of the running minimum; ties and NaN as cummax."""
    return _scan(lambda x, a: _cum_extreme(x, a, lambda va, vb: _nan_or(vb <= va, vb)), self, dim)


def _complex_logaddexp(a, b):
    # As ATen's complex _log_add_exp_helper: the operand with the larger real part keeps
    # its imaginary part unwrapped (jnp.log would fold it into (-pi, pi]).
    b_larger = b.real > a.real
    hi, lo = jnp.where(b_larger, b, a), jnp.where(b_larger, a, b)
    out = jnp.log1p(jnp.exp(lo - hi)) + hi
    both_inf = jnp.isinf(lo.real) & (lo.real == hi.real)
    out = jnp.where(both_inf & (lo.real < 0), lo, out)
    return jnp.where(both_inf & (lo.real > 0), jnp.log(jnp.exp(lo) + jnp.exp(hi)), out)


@lowering(aten.logcumsumexp.default)
def logcumsumexp(self, dim):
    """aten::logcumsumexp - log(cumsum(exp(x))) along ``dim``, computed stably.

    Dtypes: float/complex only (torch has no integer kernel); f16/bf16 in float32, and
    float32/complex64 accumulate in 64 bits, as ATen's CPU kernel (``acc_type<float>`` is
    double there): its backward is ill-conditioned for large |x| and amplifies 1-ulp
    differences of the forward. Reference: torch.logcumsumexp; jax.lax.cumlogsumexp.
    """
    t = dtypes.to_torch_dtype(self.dtype)
    if not (t.is_floating_point or t.is_complex):
        raise NotImplementedError(
            f"aten::logcumsumexp is not implemented for {t} input (torch has no integer "
            "kernel either); cast to a floating dtype first"
        )
    compute, result = _reduction_dtypes(self, REDUCTION_OUTPUT_TYPE_KIND.SAME)
    x = self.astype(jnp.promote_types(compute, np.float64))
    if jnp.iscomplexobj(x):
        fn = lambda v, a: lax.associative_scan(_complex_logaddexp, v, axis=a)
    else:
        fn = lambda v, a: lax.cumlogsumexp(v, axis=a)
    return _scan(fn, x, dim).astype(result)
