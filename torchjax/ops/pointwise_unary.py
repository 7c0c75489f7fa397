"""Elementwise unary math: exp/log/trig families, rounding, predicates (isnan ...), sign.

Most ops are 1:1 with a ``jax.lax`` primitive once promoted; they are one table and one
generic registration (``register_pointwise``). The rest are short lowerings below.
In-place (``exp_``) and ``out=`` overloads are derived by the registry.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.ops import complex_math
from torchjax.ops.pointwise_binary import exact_div
from torchjax.ops.registry import Kind, handler, lowering, register_pointwise
from torchjax.tensor._tensor import view_of
from torchjax.tensor.dtypes import aten_type_name

aten = torch.ops.aten


def _is_int(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.integer)


def _is_bool(x) -> bool:
    return x.dtype == jnp.bool_


def _not_implemented(op: str, x) -> NotImplementedError:
    return NotImplementedError(
        f"aten::{op}: \"{op}\" not implemented for '{aten_type_name(x.dtype)}'"
    )


def _reciprocal(x):
    return lax.div(jnp.ones((), dtype=x.dtype), x)


# Note [Unary table]: ops whose torch semantics equal the lax primitive after torch's
# INT_TO_FLOAT promotion (ints/bool -> default float, f16/bf16 computed in f32).
_INT_TO_FLOAT = {
    aten.exp: lax.exp,
    aten.exp2: lax.exp2,
    aten.expm1: lax.expm1,
    aten.log: lax.log,
    aten.log2: jnp.log2,
    aten.log10: jnp.log10,
    aten.log1p: lax.log1p,
    aten.sqrt: lax.sqrt,
    aten.rsqrt: lax.rsqrt,
    aten.reciprocal: _reciprocal,
    aten.sin: lax.sin,
    aten.cos: lax.cos,
    aten.tan: lax.tan,
    aten.asin: lax.asin,
    aten.acos: lax.acos,
    aten.atan: lax.atan,
    aten.sinh: lax.sinh,
    aten.cosh: lax.cosh,
    aten.tanh: lax.tanh,
    aten.asinh: lax.asinh,
    aten.acosh: lax.acosh,
    aten.atanh: lax.atanh,
    aten.erf: lax.erf,
    aten.erfc: lax.erfc,
    aten.erfinv: lax.erf_inv,
    aten.sigmoid: lax.logistic,
    aten.lgamma: lax.lgamma,
    aten.i0: jax.scipy.special.i0,
    aten.special_i0e: jax.scipy.special.i0e,
    aten.special_i1: jax.scipy.special.i1,
    aten.special_i1e: jax.scipy.special.i1e,
    aten.special_ndtri: jax.scipy.special.ndtri,
    aten.special_erfcx: jax.scipy.special.erfcx
    if hasattr(jax.scipy.special, "erfcx")
    else (lambda x: lax.exp(x * x) * lax.erfc(x)),
}

# Complex inputs take complex_math's functions: Note [Complex special values].
_COMPLEX = {
    aten.exp: complex_math.exp,
    aten.exp2: complex_math.exp2,
    aten.expm1: complex_math.expm1,
    aten.log: complex_math.log,
    aten.log2: lambda z: complex_math.log_scaled(z, 2),
    aten.log10: lambda z: complex_math.log_scaled(z, 10),
    aten.log1p: complex_math.log1p,
    aten.sqrt: complex_math.sqrt,
    aten.rsqrt: complex_math.rsqrt,
    aten.reciprocal: complex_math.reciprocal,
    aten.sin: complex_math.sin,
    aten.cos: complex_math.cos,
    aten.tan: complex_math.tan,
    aten.asin: complex_math.asin,
    aten.acos: complex_math.acos,
    aten.atan: complex_math.atan,
    aten.sinh: complex_math.sinh,
    aten.cosh: complex_math.cosh,
    aten.tanh: complex_math.tanh,
    aten.asinh: complex_math.asinh,
    aten.acosh: complex_math.acosh,
    aten.atanh: complex_math.atanh,
    aten.sigmoid: complex_math.sigmoid,
}


def _exact_rsqrt(x):
    # Behind a barrier: XLA rewrites 1 / sqrt(x) into its own rsqrt.
    return _reciprocal(lax.optimization_barrier(lax.sqrt(x)))


def _rsqrt(x):
    """ATen's rsqrt: ``1 / sqrt(x)``, two correctly rounded steps (its vectorised kernel
    divides by a hardware square root). XLA's rsqrt differed from CPU in the last bit of
    a third of float32 and float64 results; every transformer's RMSNorm calls it. On CPU
    the division is kept from being rewritten; TPU and GPU keep their rsqrt (torch on
    CUDA uses an approximate one too). Complex inputs take complex_math.rsqrt."""
    return lax.platform_dependent(x, cpu=_exact_rsqrt, default=lax.rsqrt)


def _real_or_complex(real_fn, complex_fn):
    def lowered(x):
        return complex_fn(x) if jnp.iscomplexobj(x) else real_fn(x)

    return lowered


_INT_TO_FLOAT[aten.rsqrt] = _rsqrt
for _op, _fn in _INT_TO_FLOAT.items():
    if _op in _COMPLEX:
        _fn = _real_or_complex(_fn, _COMPLEX[_op])
    register_pointwise(_op, _fn, promote=Kind.INT_TO_FLOAT)


def _rounding(fn):
    # torch returns integer inputs unchanged (a copy) from floor/ceil/trunc/round.
    return lambda x: x if _is_int(x) else fn(x)


for _op, _fn, _name in [
    (aten.floor, lax.floor, "floor"),
    (aten.ceil, lax.ceil, "ceil"),
    (aten.trunc, jnp.trunc, "trunc"),
]:

    def _lower(self, _fn=_fn, _name=_name):
        if _is_bool(self):
            raise _not_implemented(_name, self)
        return _rounding(_fn)(self)

    _lower.__doc__ = f"aten::{_name} - elementwise {_name}; int inputs returned unchanged."
    register_pointwise(_op, _lower, promote=Kind.DEFAULT)


@lowering(aten.round, promote=Kind.DEFAULT, promote_args=("self",))
def round(self, *, decimals=0):
    """aten::round / round.decimals - round half to even, at ``decimals`` digits.

    Shapes: same. Dtypes: float kept (f16/bf16 computed in f32); ints unchanged.
    torch scales by 10**decimals (dividing by 10**-decimals when negative) and rounds;
    we do the same so results match bit for bit. Reference: torch.round.
    """
    if _is_bool(self):
        raise _not_implemented("round", self)
    if _is_int(self):
        return self
    if decimals == 0:
        return lax.round(self, lax.RoundingMethod.TO_NEAREST_EVEN)
    if decimals > 0:
        scale = np.asarray(10.0**decimals, dtype=self.dtype)
        return exact_div(lax.round(self * scale, lax.RoundingMethod.TO_NEAREST_EVEN), scale)
    scale = np.asarray(10.0**-decimals, dtype=self.dtype)
    return lax.round(exact_div(self, scale), lax.RoundingMethod.TO_NEAREST_EVEN) * scale


@lowering(aten.frac, promote=Kind.DEFAULT)
def frac(self):
    """aten::frac - ``self - trunc(self)``; floats only (torch raises for ints/bool)."""
    if not jnp.issubdtype(self.dtype, jnp.inexact):
        raise _not_implemented("frac", self)
    return self - jnp.trunc(self)


@lowering(aten.neg, promote=Kind.DEFAULT)
def neg(self):
    """aten::neg - ``-self``; bool raises as in torch."""
    if _is_bool(self):
        raise RuntimeError(
            "aten::neg: Negation, the `-` operator, on a bool tensor is not supported. If "
            "you are trying to invert a mask, use the `~` or `logical_not()` operator instead."
        )
    return lax.neg(self)


@lowering(aten.abs, promote=Kind.COMPLEX_TO_FLOAT)
def abs(self):
    """aten::abs - ``|self|``; complex -> real magnitude; bool raises as in torch."""
    if _is_bool(self):
        raise _not_implemented("abs", self)
    if jnp.issubdtype(self.dtype, jnp.unsignedinteger):
        return self  # unsigned: itself, as ATen's kernel returns it (lax.abs refuses)
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        # hypot's rule (C99 Annex G, std::abs): an infinite part makes the magnitude
        # infinite even beside a NaN; XLA's complex abs gives NaN there.
        inf_part = jnp.isinf(lax.real(self)) | jnp.isinf(lax.imag(self))
        magnitude = lax.abs(self)
        return jnp.where(inf_part, jnp.asarray(np.inf, magnitude.dtype), magnitude)
    return lax.abs(self)


@lowering(aten.abs_, promote=Kind.COMPLEX_TO_FLOAT)
def abs_(self):
    """aten::abs_ - in-place ``|self|``; complex raises (the result would be real)."""
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        raise RuntimeError("aten::abs_: In-place abs is not supported for complex tensors.")
    return abs(self)


@lowering(aten.sign, promote=Kind.DEFAULT)
def sign(self):
    """aten::sign - ``(0 < x) - (x < 0)`` as ATen computes it: 0 for NaN and +0 for
    -0.0 (``jnp.sign`` gives NaN and -0.0); bool returned unchanged, complex raises."""
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        raise RuntimeError(
            "aten::sign: Unlike NumPy, torch.sign is not intended to support "
            "complex numbers. Please use torch.sgn instead."
        )
    if _is_bool(self):
        return self
    return (self > 0).astype(self.dtype) - (self < 0).astype(self.dtype)


@lowering(aten.sgn, promote=Kind.DEFAULT)
def sgn(self):
    """aten::sgn - ``self / |self|`` for complex (0 at 0), ``sign`` for real.

    Complex: each part divided by the magnitude, as CPU's vector kernel does (a zero
    part keeps its sign; ``sgn(inf + 1j)`` is ``nan + 0j``). CPU's scalar loop, which
    only runs a tensor's last few elements, divides by ``complex(|z|, 0)`` instead
    (Note [Complex special values])."""
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        mag = abs(self)
        safe = jnp.where(mag == 0, jnp.ones((), mag.dtype), mag)
        out = lax.complex(lax.real(self) / safe, lax.imag(self) / safe)
        return jnp.where(mag == 0, jnp.zeros((), self.dtype), out)
    return sign(self)


@lowering(aten.signbit)
def signbit(self):
    """aten::signbit - True where the sign bit is set (-0.0 and -NaN included); bool out."""
    if _is_bool(self):
        return jnp.zeros(self.shape, dtype=jnp.bool_)
    if _is_int(self):
        return self < 0
    return jnp.signbit(self)


@lowering(aten.logit, promote=Kind.INT_TO_FLOAT, promote_args=("self",))
def logit(self, eps=None):
    """aten::logit - ``log(x / (1 - x))``, x clamped to [eps, 1 - eps] when eps is given."""
    if eps is not None:
        lo = np.asarray(eps, dtype=self.dtype)
        hi = np.asarray(1 - eps, dtype=self.dtype)
        self = jnp.minimum(jnp.maximum(self, lo), hi)
    return lax.log(self / (1 - self))


@lowering(aten.logit_backward, promote=Kind.DEFAULT, promote_args=("grad_output", "self"))
def logit_backward(grad_output, self, eps=None):
    """aten::logit_backward - ``g / (x (1 - x))``; 0 outside [eps, 1 - eps] if eps given."""
    grad = grad_output / (self * (1 - self))
    if eps is None:
        return grad
    inside = (self >= eps) & (self <= 1 - eps)
    return jnp.where(inside, grad, jnp.zeros((), grad.dtype))


def _predicate(fn):
    def lower(self):
        if not jnp.issubdtype(self.dtype, jnp.inexact):
            return (
                jnp.zeros(self.shape, dtype=jnp.bool_)
                if fn is not jnp.isfinite
                else jnp.ones(self.shape, dtype=jnp.bool_)
            )
        return fn(self)

    return lower


for _op, _fn in [
    (aten.isnan, jnp.isnan),
    (aten.isinf, jnp.isinf),
    (aten.isfinite, jnp.isfinite),
    (aten.isposinf, jnp.isposinf),
    (aten.isneginf, jnp.isneginf),
]:
    lowering(_op)(_predicate(_fn))


@lowering(aten.nan_to_num)
def nan_to_num(self, nan=None, posinf=None, neginf=None):
    """aten::nan_to_num - NaN -> ``nan`` (0), +inf -> ``posinf`` (dtype max),
    -inf -> ``neginf`` (dtype lowest). Integer/bool inputs returned unchanged."""
    if not jnp.issubdtype(self.dtype, jnp.floating):
        if jnp.issubdtype(self.dtype, jnp.complexfloating):
            return lax.complex(
                nan_to_num(self.real, nan, posinf, neginf),
                nan_to_num(self.imag, nan, posinf, neginf),
            )
        return self
    info = jnp.finfo(self.dtype)
    nan = np.asarray(0.0 if nan is None else nan, dtype=self.dtype)
    posinf = np.asarray(info.max if posinf is None else posinf, dtype=self.dtype)
    neginf = np.asarray(info.min if neginf is None else neginf, dtype=self.dtype)
    out = jnp.where(jnp.isnan(self), nan, self)
    out = jnp.where(self == np.inf, posinf, out)
    return jnp.where(self == -np.inf, neginf, out)


@lowering(aten.bitwise_not, promote=Kind.DEFAULT)
def bitwise_not(self):
    """aten::bitwise_not - ``~self`` for ints, logical not for bool; floats raise."""
    if not (_is_int(self) or _is_bool(self)):
        raise _not_implemented("bitwise_not", self)
    return lax.bitwise_not(self)


@lowering(aten.logical_not)
def logical_not(self):
    """aten::logical_not - ``self == 0`` as bool (any input dtype)."""
    return self == jnp.zeros((), dtype=self.dtype)


@lowering(aten.digamma, promote=Kind.INT_TO_FLOAT)
def digamma(self):
    """aten::digamma - d/dx log(gamma(x)). torch returns -inf at +0.0 and +inf at -0.0
    (jax gives NaN there); NaN at negative integers as both do."""
    inf = jnp.full((), np.inf, dtype=self.dtype)
    return jnp.where(self == 0, jnp.copysign(inf, -self), lax.digamma(self))


def _polygamma_positive_n(n: int, x):
    # jax's polygamma is the Hurwitz-zeta formula, valid for x > 0 only. Shift x up with
    # the recurrence psi_n(x) = psi_n(x + 1) + (-1)**(n + 1) n! / x**(n + 1) until it is
    # >= 1 (a while_loop, so it traces under jit); inputs below -1e4 are left to jax.
    shift = jnp.isfinite(x) & (x < 1) & (x > -1e4)
    p = np.asarray(n + 1, dtype=x.dtype)

    def cond(state):
        y, _ = state
        return jnp.any(shift & (y < 1))

    def body(state):
        y, acc = state
        move = shift & (y < 1)
        safe = jnp.where(move, y, jnp.ones((), x.dtype))
        acc = jnp.where(move, acc + 1 / safe**p, acc)
        return jnp.where(move, y + 1, y), acc

    y, acc = lax.while_loop(cond, body, (x, jnp.zeros_like(x)))
    coef = np.asarray((-1) ** (n + 1) * math.factorial(n), dtype=x.dtype)
    nn = np.asarray(n, dtype=np.int32)
    return jax.scipy.special.polygamma(nn, y).astype(x.dtype) + coef * acc


@lowering(aten.polygamma, promote=Kind.INT_TO_FLOAT, promote_args=("self",))
def polygamma(n, self):
    """aten::polygamma - the n-th derivative of digamma (n = 0 is digamma itself).

    Dtypes: INT_TO_FLOAT, f16/bf16 in f32. x < 0 handled by the recurrence (jax's
    formula is for x > 0). At the poles (0, negative integers) we give inf where torch's
    series gives a huge finite value. Reference: torch.polygamma."""
    if n < 0:
        raise RuntimeError(
            f"aten::polygamma: polygamma(n, x) does not support negative n (got n={n})."
        )
    if n == 0:
        return digamma(self)
    return _polygamma_positive_n(n, self)


@lowering(aten.polygamma_, promote=Kind.INT_TO_FLOAT, promote_args=("self",))
def polygamma_(self, n):
    """aten::polygamma_ - in-place polygamma (``self`` comes first in this schema)."""
    return polygamma(n, self)


@lowering(aten.deg2rad, promote=Kind.INT_TO_FLOAT)
def deg2rad(self):
    """aten::deg2rad - ``self * pi / 180``."""
    return self * np.asarray(np.pi / 180, dtype=self.dtype)


@lowering(aten.rad2deg, promote=Kind.INT_TO_FLOAT)
def rad2deg(self):
    """aten::rad2deg - ``self * 180 / pi``."""
    return self * np.asarray(180 / np.pi, dtype=self.dtype)


@handler(aten._conj.default)
def _conj(args, kwargs):
    """aten::_conj - the lazy conjugate view: same storage, conj bit flipped.

    As in ATen the result aliases ``self`` and carries torch's conj bit; its value is
    read (and written) conjugated through the storage's interpretation (Note [Views
    across dtypes] in torchjax/tensor/_reinterpret.py). torch only calls _conj for
    complex tensors. Reference: torch.conj, torch.Tensor.is_conj.
    """
    self = args[0]
    return view_of(self, self._size, self._stride, self._offset, conj=not self.is_conj())


@handler(aten._neg_view.default)
def _neg_view(args, kwargs):
    """aten::_neg_view - the lazy negation view (torch's neg bit), as ``_conj``.

    torch makes it for ``conj().imag``; writes through it store the negated value.
    """
    self = args[0]
    return view_of(self, self._size, self._stride, self._offset, neg=not self.is_neg())


@lowering(aten.conj_physical, aten.conj_physical_, aten._conj_physical)
def conj_physical(self):
    """aten::conj_physical - materialised complex conjugate (identity for real dtypes)."""
    return jnp.conj(self) if jnp.iscomplexobj(self) else self
