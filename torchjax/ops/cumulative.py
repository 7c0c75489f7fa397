"""Scans along one dim: cumsum, cumprod, cummax/cummin (values and indices), logcumsumexp.

Dtypes follow the reductions (torchjax/ops/reduction.py): ``dtype=`` casts first,
cumsum/cumprod of int/bool accumulate in int64, f16/bf16 accumulate in float32, and
float32/complex64 in 64 bits, as ATen's CPU kernels (``acc_type<float>`` is double
there): a float32 running sum of [3e7, 1, 1, 1, 1, -3e7] ends at 4, not 0.
A 0-d input is scanned as one element (dims 0 and -1 are valid), as torch.
Backward ops reach us as ordinary ops: cumsum's backward is a flipped cumsum,
``cumprod_backward`` and ``cummaxmin_backward`` are torch composites.
Integer cumsum/cumprod are scanned by the form :data:`INT_SCAN_BY_PLATFORM` names for
the platform the program is lowered for (Note [Integer scans by platform]).

Note [Integer scans by platform]
jax lowers ``lax.cumsum``/``lax.cumprod`` to a ``reduce_window`` on every platform,
which XLA:TPU compiles more slowly than ``lax.associative_scan``'s slices and adds.
Measured on a TPU v5e (jax 0.10.2, x64 on), one jitted op on a (1, n) array,
``lax.cumsum`` against ``lax.associative_scan(jnp.add, a, axis=1)``:

    dtype    n      compile: cumsum  assoc_scan    run: cumsum  assoc_scan
    int64    128             3.13 s      0.52 s       200.2 us    192.1 us
    int64    2048            1.41 s      0.92 s       194.1 us    250.8 us
    int32    128             0.82 s      0.19 s       199.7 us    219.4 us
    int32    2048            0.74 s      0.33 s       178.0 us    183.4 us
    float32  128             0.78 s      0.17 s       146.0 us    220.3 us
    float32  2048            0.28 s      0.33 s       171.2 us    191.0 us

Every integer row compiles faster as an associative scan: by 0.4-0.6 s below the first
row. The first row's 3.13 s may also hold the process's first XLA compile, if it ran
first: a cold first ``generate`` of a 1.1B Llama on the chip spent 3.5 s of its 30.4 s
start compiling the eager ``aten::cumsum`` of its position ids (transformers'
``mask.long().cumsum(-1)``, int64), and "On the chip, main at 46129f5" in
docs/performance.md found that op's 3.3 s there to be the process's first compile (an
int64 cumsum alone took 0.26-0.84 s). So the saving to expect is some tenths of a second
per integer scan program, not all of those seconds.

Integer sums and products are exact modulo 2**bits (a ring), so any association gives
the sequential loop's result, wrap-around included: an associative scan in the integer
compute dtype equals torch's CPU kernel bit for bit. A float scan's result depends on
the association, and float32 at 2048 compiles no faster, so float and complex scans keep
``lax.cumsum``/``lax.cumprod`` everywhere. The integer choice trades run time for
compile time: up to 57 us more a call (int64, 2048), the better side for bookkeeping
scans that run a few times a program. cumprod was not measured: it takes the same form
by the same reasoning (its lowering is the same reduce_window, with a product). The
choice is made when the program is lowered (``lax.platform_dependent``: both forms are
traced, XLA compiles one), from the table as it is when the op is traced; a platform the
table does not name takes "lax". CI has no TPU: tests read the TPU lowering on CPU and
run the TPU entry under the CPU key (tests/ops/test_cumulative.py).
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


#: How an integer cumsum/cumprod is scanned, by the platform the program is lowered for
#: (Note [Integer scans by platform]): "associative" is ``lax.associative_scan``, "lax"
#: is ``lax.cumsum``/``lax.cumprod`` (reduce_window), the form of platforms not named.
INT_SCAN_BY_PLATFORM = {"tpu": "associative"}
_INT_SCANS = {
    "lax": {"sum": lax.cumsum, "prod": lax.cumprod},
    "associative": {
        "sum": lambda x, axis: lax.associative_scan(lax.add, x, axis=axis),
        "prod": lambda x, axis: lax.associative_scan(lax.mul, x, axis=axis),
    },
}


def _int_scan(kind: str):
    """``fn(x, axis)``: the integer running ``kind`` ("sum"/"prod") each platform's
    entry of :data:`INT_SCAN_BY_PLATFORM` names, chosen when the program is lowered."""
    by_platform = {p: _INT_SCANS[form][kind] for p, form in INT_SCAN_BY_PLATFORM.items()}
    default = _INT_SCANS["lax"][kind]

    def scan(x, axis):
        fns = {p: (lambda v, f=f: f(v, axis)) for p, f in by_platform.items()}
        return lax.platform_dependent(x, default=lambda v: default(v, axis), **fns)

    return scan


def _scan_dtypes(self, dtype):
    """(input cast to ``dtype=``, accumulation dtype, result dtype) of cumsum/cumprod."""
    self = cast_first(self, dtype)
    compute, result = _reduction_dtypes(
        self, REDUCTION_OUTPUT_TYPE_KIND.SAME, dtype, ints_to_long=True
    )
    if compute in (np.float32, np.complex64):
        compute = jnp.promote_types(compute, np.float64)
    return self, compute, result


def _running(kind: str, float_scan, self, dim, dtype):
    """cumsum/cumprod: integer compute dtypes scan by the platform's form (Note [Integer
    scans by platform]), float and complex ones by ``float_scan``; a bool compute dtype
    (``dtype=torch.bool``) has no CPU kernel unless there is nothing to scan."""
    self, compute, result = _scan_dtypes(self, dtype)
    x = self.astype(compute)
    if compute == np.bool_:
        if x.ndim > 0 and x.size > 0:
            raise NotImplementedError(f"\"cum{kind}_out_cpu\" not implemented for 'Bool'")
        return x
    fn = _int_scan(kind) if jnp.issubdtype(compute, jnp.integer) else float_scan
    return _scan(fn, x, dim).astype(result)


@lowering(aten.cumsum.default)
def cumsum(self, dim, *, dtype=None):
    """aten::cumsum - running sum along ``dim``; int/bool -> int64, f16/bf16 in float32,
    float32/complex64 in 64 bits (module docstring). Integers scan by the platform's form
    (Note [Integer scans by platform]).

    Reference: torch.cumsum; jax.lax.cumsum, jax.lax.associative_scan."""
    return _running("sum", lambda x, a: lax.cumsum(x, axis=a), self, dim, dtype)


@lowering(aten.cumprod.default)
def cumprod(self, dim, *, dtype=None):
    """aten::cumprod - running product along ``dim``; dtypes and forms as ``cumsum``.

    Reference: torch.cumprod; jax.lax.cumprod, jax.lax.associative_scan."""
    return _running("prod", lambda x, a: lax.cumprod(x, axis=a), self, dim, dtype)


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
