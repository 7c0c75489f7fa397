"""Comparisons: elementwise (``eq``/``lt``/..., ``maximum``/``minimum``, ``fmax``/``fmin``,
``heaviside``, ``clamp``, ``where``) and whole-tensor (``equal``, ``isclose``,
``allclose``).

``equal`` and ``allclose`` return a Python ``bool``, not a tensor: the registry passes a
non-array result through unwrapped, so they are ordinary lowerings that end in one
device-to-host read (as torch's own CUDA kernels do with ``.item()``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.ops import registry, writeback
from torchjax.ops.pointwise_binary import bcast, kind_of, lax2, type_name
from torchjax.ops.registry import Kind, lowering, precheck
from torchjax.ops.schema import arg
from torchjax.tensor import _errors, dtypes

aten = torch.ops.aten


@lowering(aten.equal, promote=Kind.DEFAULT)
def equal(self, other):
    """aten::equal - True when self and other have the same shape and equal elements.

    Shapes: different shapes give False (no broadcasting). Dtypes: mixed dtypes are
    compared in their promoted dtype, as torch's CPU kernel does. NaN != NaN, so a tensor
    holding NaN is not equal to itself. Returns a Python bool.
    Reference: torch.equal; torch/_refs ``equal``."""
    if jnp.shape(self) != jnp.shape(other):
        return False
    return bool(jnp.all(self == other))


def _check_close_args(op, self, other, rtol, atol, equal_nan):
    if self.dtype != other.dtype:
        raise RuntimeError(
            f"aten::{op}: {dtypes.to_torch_dtype(self.dtype)} did not match "
            f"{dtypes.to_torch_dtype(other.dtype)} (both inputs must have the same dtype)"
        )
    if equal_nan and jnp.issubdtype(self.dtype, jnp.complexfloating):
        raise RuntimeError(
            f"aten::{op}: isclose with equal_nan=True is not supported for complex inputs."
        )
    if rtol < 0:
        raise RuntimeError(
            f"aten::{op}: rtol must be greater than or equal to zero, but got {rtol}"
        )
    if atol < 0:
        raise RuntimeError(
            f"aten::{op}: atol must be greater than or equal to zero, but got {atol}"
        )


def _isclose(op, self, other, rtol, atol, equal_nan):
    _check_close_args(op, self, other, rtol, atol, equal_nan)
    try:
        shape = jnp.broadcast_shapes(jnp.shape(self), jnp.shape(other))
    except ValueError:
        raise RuntimeError(
            f"aten::{op}: The size of tensor a {tuple(jnp.shape(self))} must match the size "
            f"of tensor b {tuple(jnp.shape(other))} (shapes must be broadcastable)"
        ) from None
    a, b = jnp.broadcast_to(self, shape), jnp.broadcast_to(other, shape)
    close = a == b
    floating = jnp.issubdtype(a.dtype, jnp.inexact)
    if equal_nan and floating:
        close = close | (jnp.isnan(a) & jnp.isnan(b))
    # zero tolerances degenerate to equality; skipping the error path also keeps inf == inf
    if rtol == 0 and atol == 0:
        return close
    # Errors are computed in a float dtype: an integer difference could wrap (torch casts
    # integers and bool to the default dtype here too).
    if not floating:
        ftype = dtypes.to_jax_dtype(torch.get_default_dtype())
        a, b = a.astype(ftype), b.astype(ftype)
    real = np.dtype(jnp.real(a).dtype)
    allowed = np.asarray(atol, real) + jnp.abs(b * np.asarray(rtol, real))
    actual = jnp.abs(a - b)
    return close | (jnp.isfinite(actual) & (actual <= allowed))


@lowering(aten.isclose)
def isclose(self, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    """aten::isclose - ``|self - other| <= atol + |rtol * other|`` elementwise, or equal.

    Shapes: broadcast. Dtypes: self and other must match (RuntimeError otherwise, as in
    torch); ints/bool are compared in the default float dtype; the result is bool. NaN is
    close to NaN only with equal_nan (floats; complex raises). Infinities are close only
    when equal. Reference: torch.isclose; torch/_refs ``isclose``."""
    return _isclose("isclose", self, other, rtol, atol, equal_nan)


@lowering(aten.allclose)
def allclose(self, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    """aten::allclose - True when every element of ``isclose(self, other, ...)`` is True.

    Shapes: broadcast (non-broadcastable shapes raise). Dtypes: as isclose. Returns a
    Python bool. Reference: torch.allclose; torch/_refs ``allclose``."""
    return bool(jnp.all(_isclose("allclose", self, other, rtol, atol, equal_nan)))


# ---------------------------------------------------------------------------------------
# elementwise: comparisons, min/max, clamp, where


for _op, _fn in [
    (aten.eq, lax.eq),
    (aten.ne, lax.ne),
    (aten.lt, lax.lt),
    (aten.le, lax.le),
    (aten.gt, lax.gt),
    (aten.ge, lax.ge),
]:
    registry.register_pointwise(_op, lax2(_fn), promote=Kind.ALWAYS_BOOL)


def _no_complex(name, *xs):
    # torch has no order on complex numbers (jax's max would compare lexicographically).
    if any(kind_of(x) == "complex" for x in xs):
        raise RuntimeError(f"{name} not implemented for complex tensors.")


@lowering(aten.maximum, promote=Kind.DEFAULT)
def maximum(self, other):
    """aten::maximum - elementwise max; NaN propagates (as torch, unlike fmax)."""
    _no_complex("maximum", self, other)
    return lax2(lax.max)(self, other)


@lowering(aten.minimum, promote=Kind.DEFAULT)
def minimum(self, other):
    """aten::minimum - elementwise min; NaN propagates (as torch, unlike fmin)."""
    _no_complex("minimum", self, other)
    return lax2(lax.min)(self, other)


@lowering(aten.fmax, promote=Kind.DEFAULT)
def fmax(self, other):
    """aten::fmax - elementwise max ignoring NaN (NaN only if both are NaN)."""
    _no_complex("fmax", self, other)
    return jnp.fmax(*bcast(self, other))


@lowering(aten.fmin, promote=Kind.DEFAULT)
def fmin(self, other):
    """aten::fmin - elementwise min ignoring NaN (NaN only if both are NaN)."""
    _no_complex("fmin", self, other)
    return jnp.fmin(*bcast(self, other))


@lowering(aten.heaviside)
def heaviside(self, values):
    """aten::heaviside - ``values`` where self == 0, else ``self > 0`` (0 for NaN); both
    of one dtype, as torch requires (no promotion)."""
    if jnp.asarray(self).dtype != jnp.asarray(values).dtype:
        raise RuntimeError("heaviside is not yet implemented for tensors with different dtypes.")
    a, b = bcast(self, values)
    return jnp.where(a == 0, b, (a > 0).astype(a.dtype))


def at_least(x, lo):
    # A number bound keeps ``x`` where they are equal (CPU's scalar kernel), so
    # clamp(0.0, min=-0.0) is 0.0; XLA's max would pick +0.0 over -0.0 by sign.
    x, lo = bcast(x, lo)
    return jnp.where((x < lo) | (lo != lo), lo, x)


def at_most(x, hi):
    x, hi = bcast(x, hi)
    return jnp.where((x > hi) | (hi != hi), hi, x)


def at_least_bound(x, lo):
    # A tensor bound wins where they are equal, as in CPU's vector loop.
    x, lo = bcast(x, lo)
    return jnp.where((x <= lo) | (lo != lo), lo, x)


def at_most_bound(x, hi):
    x, hi = bcast(x, hi)
    return jnp.where((x >= hi) | (hi != hi), hi, x)


def _no_complex_clamp(*xs):
    if any(x is not None and kind_of(x) == "complex" for x in xs):
        raise NotImplementedError("clamp is not supported for complex types")


def _no_complex_bound(name, self, bound):
    # clamp_min/clamp_max with a tensor bound reach ATen's maximum/minimum kernels.
    for x in (self, bound):
        if kind_of(x) == "complex":
            raise NotImplementedError(f"\"{name}\" not implemented for '{type_name(x)}'")


@precheck(aten.clamp, aten.clamp_)
def _clamp_bound_given(args, kwargs) -> None:
    """CPU's first check of clamp, before any dtype's (a complex ``self`` included)."""
    if arg(args, kwargs, 1, "min") is None and arg(args, kwargs, 2, "max") is None:
        raise _errors.verbatim(
            RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
        )


def _clamp(self, min, max, low, high):
    # no bound at all is refused before (``_clamp_bound_given``)
    _no_complex_clamp(self, min, max)
    out = self
    if min is not None:
        out = low(out, min)
    if max is not None:
        out = high(out, max)
    return out


_CLAMP_POLICY = dict(promote=Kind.DEFAULT, checked_scalars=("min", "max"))

_NUMBER_KINDS = {bool: True, int: 1, float: 0.5, complex: 1j, torch.SymFloat: 0.5}


def _clamp_scalar_output_check(ov):
    """The output checks of CPU's clamp, clamp_min and clamp_max with number bounds
    (TensorCompare.cpp's meta functions), in its order and words: an integer or bool
    ``self`` promoted by a bound (``int_t.clamp_(0.5)``) cannot be clamped in place,
    named by its C++ type (``long int``); an ``out=`` tensor must have the result type
    exactly (a unary TensorIterator), where a cast would do for other ops. The bounds'
    other refusals (none given, a complex one) are the lowering's."""
    inplace = ov._schema.is_mutable and "out" not in [a.name for a in ov._schema.arguments]
    names = {"clamp": ("min", "max"), "clamp_min": ("min",), "clamp_max": ("max",)}[
        ov._opname.rstrip("_")
    ]

    def check(args, kwargs) -> None:
        self = arg(args, kwargs, 0, "self")
        bounds = [arg(args, kwargs, 1 + i, n) for i, n in enumerate(names)]
        bounds = [b for b in bounds if b is not None]
        if not bounds or self.dtype.is_complex:
            return
        if len(names) == 1 and isinstance(bounds[0], complex):
            return
        result = self.dtype
        if not result.is_floating_point:
            for b in bounds:
                result = torch.result_type(
                    torch.empty(0, dtype=result), _NUMBER_KINDS.get(type(b), b)
                )
            if inplace and result != self.dtype:
                raise _errors.verbatim(
                    RuntimeError(
                        f"result type {dtypes.aten_type_name(result)} can't be cast to the "
                        f"desired output type {writeback.dtype_name(self.dtype)}"
                    )
                )
        out = None if inplace else kwargs.get("out")
        if out is not None and not result.is_complex and out.dtype != result:
            raise _errors.verbatim(
                RuntimeError(
                    f"Found dtype {dtypes.aten_type_name(out.dtype)} but expected "
                    f"{dtypes.aten_type_name(result)}"
                )
            )

    return check


for _ov in (
    aten.clamp_.default,
    aten.clamp.out,
    aten.clamp_min_.default,
    aten.clamp_min.out,
    aten.clamp_max_.default,
    aten.clamp_max.out,
):
    precheck(_ov)(_clamp_scalar_output_check(_ov))


@lowering(aten.clamp.default, **_CLAMP_POLICY)
def clamp(self, min=None, max=None):
    """aten::clamp (number bounds) - ``min(max(self, min), max)``, ``self`` kept where
    it equals a bound (the sign of a zero); NaN in self or a bound propagates; min > max
    gives max, as in torch. Dtypes: DEFAULT promotion over self and the bounds."""
    return _clamp(self, min, max, at_least, at_most)


@lowering(aten.clamp.Tensor, **_CLAMP_POLICY)
def clamp_tensor(self, min=None, max=None):
    """aten::clamp.Tensor - as clamp, with the bound kept where it equals ``self`` (the
    sign of a zero), as CPU's vector loop."""
    return _clamp(self, min, max, at_least_bound, at_most_bound)


@lowering(aten.clamp_min.default, **_CLAMP_POLICY)
def clamp_min(self, min):
    """aten::clamp_min - ``max(self, min)``, NaN propagating, ``self`` kept on ties."""
    _no_complex_clamp(self, min)
    return at_least(self, min)


@lowering(aten.clamp_min.Tensor, **_CLAMP_POLICY)
def clamp_min_tensor(self, min):
    """aten::clamp_min.Tensor - ``max(self, min)``, NaN propagating."""
    _no_complex_bound("maximum", self, min)
    return at_least_bound(self, min)


@lowering(aten.clamp_max.default, **_CLAMP_POLICY)
def clamp_max(self, max):
    """aten::clamp_max - ``min(self, max)``, NaN propagating, ``self`` kept on ties."""
    _no_complex_clamp(self, max)
    return at_most(self, max)


@lowering(aten.clamp_max.Tensor, **_CLAMP_POLICY)
def clamp_max_tensor(self, max):
    """aten::clamp_max.Tensor - ``min(self, max)``, NaN propagating."""
    _no_complex_bound("minimum", self, max)
    return at_most_bound(self, max)


@lowering(
    aten.where.self,
    aten.where.ScalarOther,
    aten.where.ScalarSelf,
    aten.where.Scalar,
    promote=Kind.NO_OPMATH,
    promote_args=("self", "other"),
    checked_scalars=("self", "other"),
    checked_half=False,
)
def where(condition, self, other):
    """aten::where(condition, self, other) - pick self where condition, else other.

    Shapes: all three broadcast. Dtypes: result_type(self, other); condition must be
    bool (uint8 accepted, as torch does with a deprecation warning)."""
    if condition.dtype not in (jnp.bool_, jnp.uint8):
        raise RuntimeError(
            f"aten::where: where expected condition to be a boolean tensor, "
            f"but got a tensor with dtype {type_name(condition)}"
        )
    c, a, b = bcast(condition, self, other)
    return lax.select(c.astype(jnp.bool_), a, b)


@lowering(aten.isin.Tensor_Tensor, aten.isin.Tensor_Tensor_out, promote=Kind.ALWAYS_BOOL)
def isin(elements, test_elements, *, assume_unique=False, invert=False):
    """aten::isin(elements, test_elements) - whether each element occurs in test_elements.

    Shapes: the result has elements' shape; test_elements is flattened. Dtypes: both in
    their promoted dtype (``uint8`` 1 is not in ``[257]``), bool result; bool and complex
    are refused (``isin_types``). A few test elements are compared with every element; many
    are sorted and searched, the choice torch's decomposition makes
    (``test.numel() < 10 * elements.numel() ** 0.145``). Both give equality's answer (NaN
    is in nothing, ``-0.0`` in ``[0.0]``), so ``assume_unique`` changes nothing. One
    program where the decomposition was several: ``generate``'s end-of-sequence check
    (``isin(ids[:, -1:], eos)``) then reads its view of the growing ids with the same
    program as the next step's input (Note [Views in keys whose shapes vary] in
    torchjax/ops/view_signatures.py).
    Reference: torch.isin; torch/_decomp ``isin``."""
    del assume_unique
    test = jnp.ravel(test_elements)
    n = test.shape[0]
    if n == 0 or n < 10.0 * pow(max(elements.size, 1), 0.145):
        found = jnp.any(elements[..., None] == test, axis=-1)
    else:
        ordered = jnp.sort(test)
        at = jnp.clip(jnp.searchsorted(ordered, elements), 0, n - 1)
        found = ordered[at] == elements
    return ~found if invert else found


@precheck(aten.isin)
def isin_types(args, kwargs) -> None:
    """CPU's kernel refuses bool and complex elements or test elements (tensors or
    numbers), with this text; the lowering and the decompositions of the Scalar overloads
    would take them."""
    for i, name in ((0, "elements"), (1, "test_elements")):
        # The Scalar overloads name the number in the singular ("element").
        x = arg(args, kwargs, i, name, kwargs.get(name.removesuffix("s")))
        if isinstance(x, torch.Tensor):
            dtype = x.dtype
        elif isinstance(x, (bool, complex)):
            dtype = torch.bool if isinstance(x, bool) else torch.complex128
        else:
            continue
        if dtype == torch.bool or dtype.is_complex:
            raise RuntimeError(
                f"Unsupported input type encountered for isin(): {dtypes.aten_type_name(dtype)}"
            )
