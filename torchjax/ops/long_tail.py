"""The long tail: ops no other family covers and that torch's decompositions miss or get
wrong on tpu (most of the long tail, copies, conversions, windows, quantile, rot90, ...,
decomposes fine and needs no lowering).

- ``complex``/``angle``/``frexp``: pointwise ops without a usable decomposition (ATen's
  ``complex`` ref writes through ``result.real``, a view tpu storage cannot alias).
- ``index_reduce``, ``segment_reduce`` (+ its backward): scatter-style reductions.
- ``histogram``/``histogramdd`` (``_histogramdd_*``): static bin counts, work under jit.
- ``nonzero_static``, ``hash_tensor``, functional ``resize``, ``resize_as_``.
- Sparse layouts: tpu has none; the ops that would create or need one raise
  ``NotImplementedError`` naming the op.

Data-dependent checks (index out of range in ``index_reduce``, bad segment lengths) run
in eager only; under a trace they are skipped and jax's scatter semantics apply.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.device import _checks
from torchjax.device._layouts import unsupported_layout
from torchjax.ops import reduction
from torchjax.ops.indexing import require_in_range
from torchjax.ops.promotion import astype
from torchjax.ops.registry import describe_args, handler, lowering
from torchjax.tensor import dtypes

aten = torch.ops.aten
prims = torch.ops.prims


def _concrete(*xs) -> bool:
    # Inside an eager op's trace a value check sends the call op by op (NeedsValues).
    return all(_checks.concrete(x) for x in xs)


def _default_float():
    return dtypes.to_jax_dtype(torch.get_default_dtype())


# ---------------------------------------------------------------------------------------
# pointwise


@lowering(aten.complex)
def complex(real, imag):
    """aten::complex - ``real + 1j * imag``, elementwise.

    Shapes: broadcast. Dtypes: both float16/float32/float64 and equal (torch's check);
    result the matching complex dtype. float16 (ComplexHalf) has no jax dtype: raises
    NotImplementedError (``dtypes.complex32_error``).
    Reference: torch.complex; torch/_refs complex."""
    if real.dtype != imag.dtype or not jnp.issubdtype(real.dtype, jnp.floating):
        raise RuntimeError(
            f"aten::complex: expected both inputs to be Half, Float or Double tensors of one "
            f"dtype, got {real.dtype} and {imag.dtype}"
        )
    if real.dtype not in (np.float32, np.float64):
        raise dtypes.complex32_error(f"two torch.{real.dtype} tensors")
    real, imag = jnp.broadcast_arrays(real, imag)
    return lax.complex(real, imag)


@lowering(aten.polar)
def polar(abs, angle):
    """aten::polar - ``abs * (cos(angle) + 1j * sin(angle))``, elementwise.

    Dtypes as ``complex``. The decomposition assigns ``result.real``/``.imag``, which
    cannot write through tpu storage (see torchjax/ops/view_ops.py), so it is lowered here.
    Reference: torch.polar."""
    floats = (jnp.float16, jnp.float32, jnp.float64)
    if abs.dtype not in floats or angle.dtype not in floats:
        names = (dtypes.aten_type_name(dtypes.to_torch_dtype(a.dtype)) for a in (abs, angle))
        raise RuntimeError(
            "Expected both inputs to be Half, Float or Double tensors but got {} and {}".format(
                *names
            )
        )
    return complex(abs * jnp.cos(angle), abs * jnp.sin(angle))


@lowering(aten.angle)
def angle(self):
    """aten::angle - the argument of a complex number; for reals pi where x < 0, else 0
    (NaN stays NaN). Dtypes: complex -> its real dtype; int/bool -> default float; floats
    kept. Reference: torch.angle; torch/_refs angle."""
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        return jnp.angle(self)
    if not jnp.issubdtype(self.dtype, jnp.floating):
        self = self.astype(_default_float())
    pi = jnp.asarray(np.pi, dtype=self.dtype)
    zero = jnp.zeros((), dtype=self.dtype)
    return jnp.where(jnp.isnan(self), self, jnp.where(self < 0, pi, zero))


@lowering(aten.frexp)
def frexp(self):
    """aten::frexp - ``self = mantissa * 2 ** exponent`` with |mantissa| in [0.5, 1).

    Dtypes: floats only; mantissa keeps the dtype, exponent is int32 (torch's). At 0,
    +-inf and NaN the mantissa is the input and the exponent 0, as C's frexp. Computed on
    the bit pattern: XLA on CPU flushes subnormals to zero, so ``jnp.frexp`` (and any
    scaling) loses them. Reference: torch.frexp; C frexp."""
    if not jnp.issubdtype(self.dtype, jnp.floating):
        raise RuntimeError(
            f"aten::frexp: torch.frexp() only supports floating-point dtypes, got {self.dtype}"
        )
    fi = jnp.finfo(self.dtype)
    nbits, nmant, bias = fi.bits, fi.nmant, 2 ** (fi.nexp - 1) - 1
    ut = np.dtype(f"uint{nbits}")
    bits = lax.bitcast_convert_type(self, ut)
    sign = bits & np.asarray(1 << (nbits - 1), ut)
    frac_mask = np.asarray((1 << nmant) - 1, ut)
    field = ((bits >> np.asarray(nmant, ut)) & np.asarray((1 << fi.nexp) - 1, ut)).astype(jnp.int32)
    frac = bits & frac_mask
    # subnormal: the value is frac * 2**(1 - bias - nmant); normalize frac's top bit p
    top = nbits - 1 - lax.clz(frac).astype(jnp.int32)
    shift = jnp.clip(nmant - top, 0, nmant).astype(ut)
    subnormal = field == 0
    frac = jnp.where(subnormal, (frac << shift) & frac_mask, frac)
    exponent = jnp.where(subnormal, top + 2 - bias - nmant, field - (bias - 1))
    mantissa = lax.bitcast_convert_type(
        sign | np.asarray((bias - 1) << nmant, ut) | frac, self.dtype
    )
    # From the exponent field and clz, never a float compare: XLA compares bfloat16
    # through float32 with subnormals flushed (``self == 0`` is true for a bfloat16
    # subnormal), and simplifies a masked-bits test back into that float compare.
    zero = (field == 0) & (lax.clz(bits & frac_mask) == nbits)
    special = (field == (1 << fi.nexp) - 1) | zero
    mantissa = jnp.where(special, self, mantissa)
    exponent = jnp.where(special, 0, exponent).astype(jnp.int32)
    return mantissa, exponent


@lowering(prims.convert_element_type)
def convert_element_type(a, dtype):
    """prims::convert_element_type - ``a`` cast to ``dtype`` (used by torch/_refs, e.g.
    renorm's float16 path). Reference: torch/_prims convert_element_type."""
    return astype(a, dtypes.to_jax_dtype(dtype))


# ---------------------------------------------------------------------------------------
# scatter-style reductions


def _check_index(index, n, op):
    # On the device, raised at the next sync (Note [Device-side checks]).
    require_in_range(
        index,
        0,
        n,
        IndexError,
        f"aten::{op}: index out of range in self: index {{value}} for a dimension of size {n}",
    )


def _reduce_identity(reduce, dtype):
    if reduce in ("sum", "mean"):
        return np.zeros((), dtype)
    if reduce == "prod":
        return np.ones((), dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return np.asarray(-np.inf if reduce in ("amax", "max") else np.inf, dtype)
    info = jnp.iinfo(dtype) if dtype != np.bool_ else None
    if info is None:
        return np.asarray(reduce in ("amin", "min"), dtype)
    return np.asarray(info.min if reduce in ("amax", "max") else info.max, dtype)


def _check_bool_index_reduce(self, reduce, include_self):
    # CPU's kernels: no bool path without self, nor for one dimension; 2-D and up run
    # prod/amax/amin and stop at mean's floor division.
    if not include_self:
        missing = "index_reduce_func_exclude_input_init"
    elif self.ndim == 1:
        missing = "index_func_"
    elif reduce == "mean":
        missing = "div_floor_cpu"
    else:
        return
    raise NotImplementedError(f"aten::index_reduce: \"{missing}\" not implemented for 'Bool'")


@lowering(aten.index_reduce, cpu_tensors=True)
def index_reduce(self, dim, index, source, reduce, *, include_self=True):
    """aten::index_reduce - ``self`` with ``source``'s slices reduced into the positions
    ``index`` names along ``dim`` ("prod", "mean", "amax", "amin").

    Shapes: index (M,) (or 0-d), source = self with size M at dim. ``include_self=False``
    replaces every indexed position's value by the reduction identity first. "mean" divides
    by the count of contributions (floor division for integer dtypes, as ATen).
    Reference: torch.Tensor.index_reduce_; ATen index_reduce_func_impl."""
    if reduce not in ("prod", "mean", "amax", "amin"):
        raise RuntimeError(
            f"aten::index_reduce: reduce argument must be either prod, mean, amax or amin, "
            f"got {reduce}"
        )
    if self.ndim == 0:
        self, source = self.reshape(1), source.reshape(1)
        out = index_reduce(self, 0, index.reshape(-1), source, reduce, include_self=include_self)
        return out.reshape(())
    dim = dim % self.ndim
    if self.dtype == jnp.bool_:
        _check_bool_index_reduce(self, reduce, include_self)
    index = index.reshape(-1)
    n = self.shape[dim]
    _check_index(index, n, "index_reduce")
    x = jnp.moveaxis(self, dim, 0)
    src = jnp.moveaxis(source, dim, 0)
    hit = jnp.zeros((n,), bool).at[index].set(True).reshape((n,) + (1,) * (x.ndim - 1))
    ident = _reduce_identity(reduce, x.dtype)
    init = x if include_self else jnp.where(hit, ident, x)
    at = init.at[index]
    if reduce == "prod":
        out = at.min(src) if x.dtype == jnp.bool_ else at.multiply(src)  # bool: logical and
    elif reduce == "amax":
        out = at.max(src)
    elif reduce == "amin":
        out = at.min(src)
    else:
        out = at.add(src)
        # Counted at full shape: a divisor broadcast along the other dims is rewritten by
        # XLA into a product with its reciprocal (one unit in the last place off CPU).
        count = jnp.zeros(x.shape, x.dtype).at[index].add(jnp.ones_like(src))
        if include_self:
            count = count + 1
        count = jnp.where(count == 0, jnp.ones((), x.dtype), count)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            out = out / count
        else:
            out = jnp.floor_divide(out, count)
    return jnp.moveaxis(out, 0, dim)


def _segment_bounds(lengths, offsets, op):
    """(starts, ends) of each segment, shape (..., S), from lengths or offsets."""
    if lengths is not None:
        if _concrete(lengths) and lengths.size and bool((lengths < 0).any()):
            raise RuntimeError(f"aten::{op}: lengths contains negative value!")
        ends = jnp.cumsum(lengths, axis=-1)
        return ends - lengths, ends
    if offsets is None:
        raise RuntimeError(f"aten::{op}: Either lengths or offsets must be defined")
    return offsets[..., :-1], offsets[..., 1:]


def _segment_reduce(data, reduce, lengths, offsets, axis, initial):
    starts, ends = _segment_bounds(lengths, offsets, "segment_reduce")
    axis = axis % data.ndim
    k = data.shape[axis]
    pos = jnp.arange(k)
    # mask (..., S, K) over data's leading dims, the segments and the reduced axis
    mask = (pos >= starts[..., None]) & (pos < ends[..., None])
    mask = mask.reshape(mask.shape + (1,) * (data.ndim - axis - 1))
    x = jnp.expand_dims(data, axis)  # (..., 1, K, rest)
    name = {"sum": "sum", "mean": "sum", "max": "max", "min": "min", "prod": "prod"}[reduce]
    ident = _reduce_identity(name, data.dtype)
    masked = jnp.where(mask, x, ident)
    out = getattr(jnp, name)(masked, axis=axis + 1)
    count = (ends - starts).reshape(starts.shape + (1,) * (data.ndim - axis - 1))
    if initial is not None:
        init = np.asarray(initial, data.dtype)
        out = {"max": jnp.maximum, "min": jnp.minimum, "prod": jnp.multiply}.get(reduce, jnp.add)(
            out, init
        )
    if reduce == "mean":
        empty = jnp.asarray(np.nan if initial is None else initial, data.dtype)
        out = jnp.where(count == 0, empty, out / jnp.where(count == 0, 1, count).astype(out.dtype))
    return out


@lowering(aten.segment_reduce)
def segment_reduce(
    data,
    reduce,
    *,
    lengths=None,
    indices=None,
    offsets=None,
    axis=0,
    unsafe=False,
    initial=None,
):
    """aten::segment_reduce - reduce consecutive segments of ``data`` along ``axis``.

    Shapes: ``lengths`` (..., S) or ``offsets`` (..., S + 1), leading dims = data's dims
    before ``axis``; result has S at ``axis``. reduce: sum, mean, max, min, prod; empty
    segments give ``initial`` or the identity (NaN for mean). Computed as a dense masked
    reduction, O(S * K) per row. Reference: torch.segment_reduce (ATen SegmentReduce.cpp)."""
    if indices is not None:
        raise RuntimeError("aten::segment_reduce: indices based reduction is not supported yet")
    return _segment_reduce(data, reduce, lengths, offsets, axis, initial)


@lowering(aten._segment_reduce_backward)
def _segment_reduce_backward(
    grad, output, data, reduce, *, lengths=None, offsets=None, axis=0, initial=None
):
    """aten::_segment_reduce_backward - the gradient of ``segment_reduce`` w.r.t. ``data``:
    the vjp of the same jnp computation (max/min split the gradient among ties, as ATen).
    Reference: ATen _segment_reduce_backward_kernel."""

    def fwd(d):
        return _segment_reduce(d, reduce, lengths, offsets, axis, initial)

    _, vjp = jax.vjp(fwd, data)
    return vjp(grad.astype(data.dtype))[0]


# ---------------------------------------------------------------------------------------
# histograms


def _outer_edges(x, bins, range_, op):
    """Per-dimension (left, right) edges: ``range`` or the data's min/max, widened by 0.5
    each side when equal (ATen select_outer_bin_edges)."""
    d = x.shape[-1]
    if range_ is not None:
        if len(range_) != 2 * d:
            raise RuntimeError(
                f"aten::{op}: expected {2 * d} values for range (2 per dimension), "
                f"got {len(range_)}"
            )
        left = jnp.asarray(range_[0::2], dtype=x.dtype)
        right = jnp.asarray(range_[1::2], dtype=x.dtype)
    elif x.shape[0] == 0:
        left, right = jnp.zeros((d,), x.dtype), jnp.ones((d,), x.dtype)
    else:
        left, right = x.min(axis=0), x.max(axis=0)
    same = left == right
    return jnp.where(same, left - 0.5, left), jnp.where(same, right + 0.5, right)


def _bin_edges(x, bins, range_, op):
    left, right = _outer_edges(x, bins, range_, op)
    return [jnp.linspace(left[i], right[i], b + 1, dtype=x.dtype) for i, b in enumerate(bins)]


def _histogramdd(x, edges, weight, density):
    """Counts of the rows of ``x`` (N, D) in the bins ``edges`` (list of D sorted arrays).

    A value lands in bin i when edges[i] <= v < edges[i + 1]; the last bin also takes
    v == edges[-1]; values outside (and NaN) are dropped. ``weight`` (N,) weights rows."""
    n, d = x.shape
    flat = jnp.zeros((n,), jnp.int64)
    inside = jnp.ones((n,), bool)
    shape = []
    for i, e in enumerate(edges):
        nb = e.shape[0] - 1
        v = x[:, i]
        pos = jnp.searchsorted(e, v, side="right") - 1
        pos = jnp.where(v == e[-1], nb - 1, pos)
        inside &= (v >= e[0]) & (v <= e[-1])
        flat = flat * nb + jnp.clip(pos, 0, max(nb - 1, 0))
        shape.append(nb)
    w = jnp.ones((n,), x.dtype) if weight is None else weight.reshape(n).astype(x.dtype)
    w = jnp.where(inside, w, jnp.zeros((), x.dtype))
    hist = jnp.zeros((math.prod(shape),), x.dtype).at[flat].add(w).reshape(shape)
    if density:
        widths = jnp.ones(shape, x.dtype)
        for i, e in enumerate(edges):
            bshape = [1] * d
            bshape[i] = shape[i]
            widths = widths * jnp.diff(e).reshape(bshape)
        hist = hist / (hist.sum() * widths)
    return hist


def _rows(self):
    return self.reshape(-1, self.shape[-1]) if self.ndim else self.reshape(1, 1)


def _check_float(self, op):
    if not jnp.issubdtype(self.dtype, jnp.floating):
        raise RuntimeError(
            f"aten::{op}: torch.{op}: input tensor and bins tensors should have a floating "
            f"dtype, got {self.dtype}"
        )


@lowering(aten.histogram.bin_ct, aten.histogram.bin_ct_out)
def histogram_bin_ct(self, bins=100, *, range=None, weight=None, density=False):
    """aten::histogram.bin_ct - counts of ``self``'s values in ``bins`` equal-width bins
    over ``range`` (default: the data's min and max) and the bin edges.

    Shapes: any input (flattened); weight like self. Dtypes: floats; hist and edges in
    self's dtype. Static bin count: works under jit. Reference: torch.histogram."""
    _check_float(self, "histogram")
    x = self.reshape(-1, 1)
    (edges,) = _bin_edges(x, [bins], range, "histogram")
    w = None if weight is None else weight.reshape(-1)
    return _histogramdd(x, [edges], w, density), edges


@lowering(aten.histogram.bins_tensor, aten.histogram.bins_tensor_out)
def histogram_bins_tensor(self, bins, *, weight=None, density=False):
    """aten::histogram.bins_tensor - counts of ``self``'s values in the bins given by the
    sorted edge tensor ``bins``; returns (hist, bins). Reference: torch.histogram."""
    _check_float(self, "histogram")
    w = None if weight is None else weight.reshape(-1)
    return _histogramdd(self.reshape(-1, 1), [bins], w, density), bins


def _check_bins_count(self, bins):
    if len(bins) != self.shape[-1]:
        raise RuntimeError(
            "histogramdd: The size of bins must be equal to the innermost dimension of the "
            "input. (in aten::histogramdd)"
        )


@lowering(aten._histogramdd_bin_edges)
def _histogramdd_bin_edges(self, bins, *, range=None, weight=None, density=False):
    """aten::_histogramdd_bin_edges - per-dimension equal-width bin edges for the rows of
    ``self`` (..., D): a list of D tensors of ``bins[i] + 1`` edges.
    Reference: torch.histogramdd."""
    _check_float(self, "histogramdd")
    _check_bins_count(self, bins)
    return _bin_edges(_rows(self), list(bins), range, "histogramdd")


@lowering(aten._histogramdd_from_bin_cts)
def _histogramdd_from_bin_cts(self, bins, *, range=None, weight=None, density=False):
    """aten::_histogramdd_from_bin_cts - the D-dimensional histogram of the rows of
    ``self`` (..., D) with ``bins[i]`` equal-width bins per dimension.
    Reference: torch.histogramdd."""
    _check_float(self, "histogramdd")
    _check_bins_count(self, bins)
    x = _rows(self)
    edges = _bin_edges(x, list(bins), range, "histogramdd")
    return _histogramdd(x, edges, weight, density)


@lowering(aten._histogramdd_from_bin_tensors)
def _histogramdd_from_bin_tensors(self, bins, *, weight=None, density=False):
    """aten::_histogramdd_from_bin_tensors - the D-dimensional histogram of the rows of
    ``self`` (..., D) over the given sorted edge tensors. Reference: torch.histogramdd."""
    _check_float(self, "histogramdd")
    return _histogramdd(_rows(self), list(bins), weight, density)


# ---------------------------------------------------------------------------------------
# shape-level odds and ends


@lowering(aten.nonzero_static)
def nonzero_static(self, *, size, fill_value=-1):
    """aten::nonzero_static - the first ``size`` indices of nonzero elements, (size, ndim)
    int64, padded with ``fill_value``. Static shape: works under jit.
    Reference: torch.nonzero_static."""
    if self.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    if self.size == 0:
        return jnp.full((size, self.ndim), fill_value, jnp.int64)
    idx = jnp.nonzero(self, size=size, fill_value=fill_value)
    return jnp.stack(idx, axis=1).astype(jnp.int64)


@lowering(aten.hash_tensor)
def hash_tensor(self, dim=(), *, keepdim=False, mode=0):
    """aten::hash_tensor - XOR of the elements' 64-bit patterns over ``dim`` (all if
    empty), as uint64: floats widened to float64, integers and bool to int64 first.

    Reference: torch.hash_tensor (mode 0, the only one)."""
    if mode != 0:
        raise RuntimeError(f"aten::hash_tensor: only mode=0 (xor_sum) is supported, got {mode}")
    if self.size == 0 and not dim:
        raise RuntimeError(
            "aten::hash_tensor: Expected reduction dim to be specified for input.numel() == 0. "
            "Specify the reduction dim with the 'dim' argument."
        )
    if dim:
        reduction.check_rank(self.ndim)
    for d in dim if self.ndim else ():
        if self.shape[d] == 0:
            raise IndexError(
                f"aten::hash_tensor: Expected reduction dim {d} to have non-zero size."
            )
    wide = np.float64 if jnp.issubdtype(self.dtype, jnp.floating) else np.int64
    bits = lax.bitcast_convert_type(self.astype(wide), jnp.uint64)
    axes = tuple(d % max(self.ndim, 1) for d in dim) if dim else None
    if self.ndim == 0:
        return bits
    out = lax.reduce(bits, np.uint64(0), lax.bitwise_xor, axes or tuple(range(self.ndim)))
    if keepdim:
        out = jnp.expand_dims(out, axes or tuple(range(self.ndim)))
    return out


@lowering(aten.resize)
def resize(self, size, *, memory_format=None):
    """aten::resize - functional ``resize_``: the first elements in row-major order,
    zeros after them where the tensor grows (ATen leaves them uninitialized).
    Reference: torch.Tensor.resize_."""
    n = math.prod(size)
    flat = self.reshape(-1)[:n]
    if flat.shape[0] < n:
        flat = jnp.concatenate([flat, jnp.zeros((n - flat.shape[0],), flat.dtype)])
    return flat.reshape(tuple(size))


@handler(aten.resize_as_.default)
def resize_as_(args, kwargs):
    """aten::resize_as_ - ``self.resize_(the_template.shape)``; with a ``memory_format``,
    that format's strides (``preserve_format``: the template's suggested one), as ATen
    restrides."""
    self, template = args[0], args[1]
    memory_format = kwargs.get("memory_format", args[2] if len(args) > 2 else None)
    if memory_format is None:
        return aten.resize_.default(self, list(template.shape))
    # ATen's own restride, on meta tensors of the same layouts.
    meta = torch.empty_strided(template.shape, template.stride(), device="meta")
    stride = torch.empty(0, device="meta").resize_as_(meta, memory_format=memory_format).stride()
    size = tuple(template.shape)
    if size != self._size or stride != self._stride:
        self._resize(size, stride)
    return self


# ---------------------------------------------------------------------------------------
# sparse layouts: none on tpu

_SPARSE_OPS = (
    aten._to_sparse,
    aten._to_sparse_csr,
    aten._to_sparse_csc,
    aten._to_sparse_bsr,
    aten._to_sparse_bsc,
    aten.sparse_sampled_addmm,
    aten._sparse_mm_reduce_impl,
)


def _sparse_unsupported(op):
    def raise_(args, kwargs):
        raise NotImplementedError(
            f"torchjax: sparse tensors are not supported on tpu (aten::{op._qualified_op_name[6:]} "
            f"called with {describe_args(args, kwargs)}). Keep sparse work on CPU, or use "
            "dense tensors (e.g. torch.mm on .to_dense())."
        )

    return raise_


for _packet in _SPARSE_OPS:
    handler(_packet)(_sparse_unsupported(_packet))


@handler(aten.sparse_dim.default)
def sparse_dim(args, kwargs):
    """aten::sparse_dim - 0 for a dense (strided) tensor, the only layout on tpu."""
    return 0


@handler(aten.dense_dim.default)
def dense_dim(args, kwargs):
    """aten::dense_dim - every dim of a dense (strided) tensor."""
    return args[0].dim()


@handler(aten._nested_view_from_jagged)
def _nested_view_from_jagged(args, kwargs):
    # The jagged layout's constructor (Note [Unsupported layouts]).
    raise unsupported_layout("aten::_nested_view_from_jagged (a jagged nested tensor)")
