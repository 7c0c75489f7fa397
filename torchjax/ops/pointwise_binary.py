"""Elementwise binary math: arithmetic, division modes, float binary math, bitwise/logical
ops, gcd/lcm/nextafter, and the broadcasting and dtype-kind helpers the pointwise families
share. ``lerp``, ``addcmul``, ``addcdiv`` are in pointwise_ternary.py; ``pow`` in
power.py; comparisons, min/max, clamp and where in comparison.py.

Inputs arrive promoted to torch's computation dtype (``promote=``); lax wants equal
shapes, so binary lowerings broadcast first (``bcast``, as ``torch/_refs``'
``_maybe_broadcast``). Integer division by zero raises ``RuntimeError: ZeroDivisionError``
at the op, as torch's CPU kernels do (a device check made at the op; under
``torchjax.jit`` it is raised by the call: Note [Device checks of compiled programs] in
torchjax/device/_checks.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.device import _checks
from torchjax.ops import complex_math, functional, registry
from torchjax.ops.registry import Kind, functional_handler, handler, lowering, precheck
from torchjax.ops.schema import arg
from torchjax.tensor import _errors, dtypes
from torchjax.tensor._tensor import JaxTensor
from torchjax.tensor.dtypes import aten_type_name

aten = torch.ops.aten


def bcast(*xs):
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in xs))
    return [jnp.broadcast_to(x, shape) for x in xs]


def lax2(fn):
    return lambda a, b: fn(*bcast(a, b))


def kind_of(x) -> str:
    dt = np.dtype(x.dtype)
    if dt == np.bool_:
        return "bool"
    if np.issubdtype(dt, np.integer):
        return "int"
    if np.issubdtype(dt, np.complexfloating):
        return "complex"
    return "float"


def type_name(x) -> str:
    return aten_type_name(x.dtype)


# One executable; inlined into the program when traced.
_any_zero = jax.jit(lambda x: jnp.any(x == 0))
_ZERO_DIVISION = "ZeroDivisionError"


def integral(x) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return isinstance(x, (bool, int))
    return not (dtype.is_floating_point or dtype.is_complex)


@precheck(aten.floor_divide, aten.remainder, aten.fmod)
def zero_divisor(args, kwargs) -> None:
    """CPU's integer kernels raise ``RuntimeError: ZeroDivisionError`` for a zero divisor;
    XLA returns garbage, CUDA checks nothing. So it is checked at the op, with CPU's text
    (Note [Device-side checks]), before the division: a divisor on the host (a Python
    number, a CPU tensor) is read there, a tpu tensor's is a device check read at once."""
    self = args[0] if args else kwargs["self"]
    other = args[1] if len(args) > 1 else kwargs["other"]
    if not (integral(self) and integral(other)):
        return
    if torch.result_type(self, other) == torch.bool:
        return  # no kernel for bool at all: the dtype refusal answers, as on CPU
    if isinstance(other, JaxTensor):
        found = _any_zero(other._value())
        _checks.require(found, 0, RuntimeError, _ZERO_DIVISION, deferred=False)
    elif bool((other == 0).any()) if isinstance(other, torch.Tensor) else other == 0:
        raise _errors.verbatim(RuntimeError(_ZERO_DIVISION))


def require_kind(op: str, x, kinds) -> None:
    if kind_of(x) not in kinds:
        raise NotImplementedError(f"aten::{op}: \"{op}\" not implemented for '{type_name(x)}'")


# ---------------------------------------------------------------------------------------
# add / sub / mul / div


def scale_by(op: str, x, alpha, *, value_check=False):
    """``alpha * x``. add/sub/rsub's alpha is checked against the result type before
    (``_alpha_check``); addcmul/addcdiv read ``value`` as the result type with c10's
    conversion (``value_check=True``): a complex value into a real type overflows."""
    kind = kind_of(x)
    if value_check and isinstance(alpha, complex) and kind != "complex":
        dtypes.check_scalar_fits(alpha, x.dtype, op)
    if kind == "complex" and not isinstance(alpha, bool):
        # Note [Complex special values]: CPU multiplies by alpha (1 included).
        return complex_math.scale(x, complex(alpha))
    if isinstance(alpha, jax.Array):  # a traced Python float (Note [Traced Python floats])
        return mul_values(x, alpha.astype(x.dtype))
    if alpha is True or (not isinstance(alpha, bool) and alpha == 1):
        return x
    return mul_values(x, np.asarray(alpha, dtype=x.dtype))


def _negated(x, alpha):
    """``-alpha`` for sub and rsub of complex tensors, which CPU computes as an add of
    ``-alpha * other`` (a bool alpha stays, for scale_by's check)."""
    return -alpha if kind_of(x) == "complex" and not isinstance(alpha, bool) else alpha


def add_values(a, b):
    a, b = bcast(a, b)
    return lax.bitwise_or(a, b) if a.dtype == jnp.bool_ else lax.add(a, b)


def mul_values(a, b):
    a, b = bcast(a, b)
    return lax.bitwise_and(a, b) if a.dtype == jnp.bool_ else lax.mul(a, b)


def fma(x, y, z):
    """``x * y + z`` rounded once, as CPU's vectorised loops compute it with an FMA: on
    CPU through float64 (the float32 product is exact there), elsewhere as XLA fuses it.
    float64 has no wider type: XLA:CPU contracts its multiply-add inside one program
    when LLVM optimises, not at optimisation level 0 nor primitive by primitive."""

    def exact(x, y, z):
        wide = jnp.float64
        return (x.astype(wide) * y.astype(wide) + z.astype(wide)).astype(x.dtype)

    return lax.platform_dependent(x, y, z, cpu=exact, default=lambda x, y, z: x * y + z)


# Note [A scaled add rounds once]
# CPU's float32 add and sub kernels compute ``self + alpha * other`` (sub: ``-alpha``)
# with one FMA (``vec::fmadd``), one rounding. XLA contracts that multiply and add into
# an FMA only where LLVM optimises (not at optimisation level 0, the suite's), so a
# float32 computation with an ``alpha`` states it (``fma``): SGD's ``p.add_(grad,
# alpha=-lr)``, weight decay's ``grad.add(p, alpha=wd)`` and the foreach forms of both
# give CPU's bits at every level. Half-precision inputs compute in float32 with alpha
# rounded to their type first (Note [Half-precision inputs are rounded first] in
# torchjax/ops/promotion.py): their products are exact in float32, FMA or not. float64
# has no wider type to state it with.
def _scaled_add(self, other, alpha, negate):
    """``self + alpha * other`` (``- alpha`` when ``negate``) in one rounding where the
    computation is float32 and alpha is not 1 (Note [A scaled add rounds once]); None
    elsewhere."""
    if other.dtype != jnp.float32 or self.dtype != jnp.float32 or isinstance(alpha, bool):
        return None
    if isinstance(alpha, jax.Array):  # a traced Python float (Note [Traced Python floats])
        scale = alpha.astype(jnp.float32)
    elif alpha == 1:
        return None
    else:
        scale = np.asarray(alpha, dtype=np.float32)
    return fma(*bcast(other, -scale if negate else scale, self))


# add / sub / rsub: promotion over self and other; alpha read as CPU's kernels read it.
_ALPHA_POLICY = dict(
    promote=Kind.DEFAULT,
    promote_args=("self", "other"),
    round_scalars=("alpha",),
    checked_scalars=("alpha",),  # CPU's kernels read alpha as the result type, checked
)


@lowering(aten.add.Tensor, aten.add.Scalar, **_ALPHA_POLICY)
def add(self, other, alpha=1):
    """aten::add - ``self + alpha * other``. Shapes: broadcast. Dtypes: torch's DEFAULT
    promotion (f16/bf16 in f32); bool + bool is logical or. alpha checked as torch does
    (no float alpha for ints, bool alpha only for bool); float32 with an alpha in one
    rounding (Note [A scaled add rounds once]). Reference: torch.add."""
    out = _scaled_add(self, other, alpha, negate=False)
    return add_values(self, scale_by("add", other, alpha)) if out is None else out


def sub(self, other, alpha=1):
    """aten::sub - ``self - alpha * other``; a bool operand is refused before (``_sub_check``).
    float32 with an alpha in one rounding (Note [A scaled add rounds once]). Reference:
    torch.sub."""
    out = _scaled_add(self, other, alpha, negate=True)
    if out is not None:
        return out
    if kind_of(other) == "complex":
        return add_values(self, scale_by("sub", other, _negated(other, alpha)))
    return lax2(lax.sub)(self, scale_by("sub", other, alpha))


_sub = {
    ov: functional_handler(ov, sub, **_ALPHA_POLICY) for ov in (aten.sub.Tensor, aten.sub.Scalar)
}


def _is_bool(x) -> bool:
    return isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool)


_TWO_BOOLS = (
    "Subtraction, the `-` operator, with two bool tensors is not supported. Use the `^` or "
    "`logical_xor()` operator instead."
)
_ONE_BOOL = (
    "Subtraction, the `-` operator, with a bool tensor is not supported. If you are trying "
    "to invert a mask, use the `~` or `logical_not()` operator instead."
)


def _sub_check(self, other) -> None:
    """torch's sub_check, on the operands as given: a bool operand (a tensor or a Python
    bool) is refused, which promotion would hide from the lowering (``1.0 - mask``
    computes in float). CPU's text, word for word."""
    if _is_bool(self) and _is_bool(other):
        raise _errors.verbatim(RuntimeError(_TWO_BOOLS))
    if _is_bool(self) or _is_bool(other):
        raise _errors.verbatim(RuntimeError(_ONE_BOOL))


_SYMBOLIC_KINDS = {torch.SymFloat: 0.5, torch.SymInt: 1, torch.SymBool: True}


def _number_kind(x):
    """``x``, or a number of its kind for a symbolic one (a traced Python float: Note
    [Traced Python floats] in torchjax/ops/traced_scalars.py), for ``torch.result_type``."""
    return _SYMBOLIC_KINDS.get(type(x), x)


def _alpha_check(ov):
    """The checks CPU's add/sub/rsub make before computing, in its order (``sub_check``,
    then TensorIterator's cast of the result type to ``out=`` or ``self``, then
    ``alpha_check`` on the result type), word for word: made on torch dtypes, before
    promotion reads alpha as the result type (a complex alpha would overflow there)."""
    names = [a.name for a in ov._schema.arguments]
    has_out = "out" in names
    inplace = ov._schema.is_mutable and not has_out
    is_sub = ov._opname in ("sub", "rsub", "sub_")

    def check(args, kwargs) -> None:
        alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
        if type(alpha) is int and not is_sub:
            return  # passes every result type's check; the write-back checks the cast
        self = arg(args, kwargs, 0, "self")
        other = arg(args, kwargs, 1, "other")
        if is_sub:
            _sub_check(self, other)
        if type(alpha) is int:
            return
        out = kwargs.get("out") if has_out else self if inplace else None
        result = torch.result_type(self, _number_kind(other))
        if out is not None and not torch.can_cast(result, out.dtype):
            raise _errors.verbatim(
                RuntimeError(
                    f"result type {aten_type_name(result)} can't be cast to the desired "
                    f"output type {aten_type_name(out.dtype)}"
                )
            )
        alpha = _number_kind(alpha)
        if isinstance(alpha, bool):
            if result != torch.bool:
                raise _errors.verbatim(
                    RuntimeError("Boolean alpha only supported for Boolean results.")
                )
        elif isinstance(alpha, (float, complex)) and not (
            result.is_floating_point or result.is_complex
        ):
            raise _errors.verbatim(
                RuntimeError(
                    "For integral input tensors, argument alpha must not be a floating "
                    "point number."
                )
            )
        elif isinstance(alpha, complex) and not result.is_complex:
            raise _errors.verbatim(
                RuntimeError(
                    "For non-complex input tensors, argument alpha must not be a complex number."
                )
            )

    return check


for _packet in (aten.add, aten.sub, aten.rsub, aten.add_, aten.sub_):
    for _name in _packet.overloads():
        _ov = getattr(_packet, _name)
        if str(_ov._schema.arguments[0].type) == "Tensor":  # not TorchScript's list/str adds
            precheck(_ov)(_alpha_check(_ov))


@handler(aten.sub.Tensor, aten.sub.Scalar)
def sub_handler(args, kwargs, _ops=(aten.sub.Tensor, aten.sub.Scalar)):
    """aten::sub at the torch level: a Python number as ``other`` lowers as sub.Scalar."""
    op = aten.sub.Scalar if not isinstance(args[1], torch.Tensor) else aten.sub.Tensor
    return _sub[op](args, kwargs)


@lowering(aten.rsub.Tensor, aten.rsub.Scalar, **_ALPHA_POLICY)
def rsub(self, other, alpha=1):
    """aten::rsub - ``other - alpha * self``; a bool operand is refused before
    (``_sub_check``); float32 with an alpha in one rounding (Note [A scaled add rounds
    once]). Reference: torch.rsub."""
    out = _scaled_add(other, self, alpha, negate=True)
    if out is not None:
        return out
    if kind_of(self) == "complex":
        return add_values(other, scale_by("rsub", self, _negated(self, alpha)))
    return lax2(lax.sub)(other, scale_by("rsub", self, alpha))


@lowering(aten.mul.Tensor, aten.mul.Scalar, promote=Kind.DEFAULT, exact_scalars=("other",))
def mul(self, other):
    """aten::mul - ``self * other``; bool * bool is logical and. Shapes: broadcast."""
    return mul_values(self, other)


@lowering(aten.div.Tensor, aten.div.Scalar, promote=Kind.INT_TO_FLOAT, exact_scalars=("other",))
def div(self, other):
    """aten::div (rounding_mode=None) - true division; ints/bool -> default float."""
    return exact_div(self, other)


def exact_div(self, other):
    """``self / other`` correctly rounded on CPU also where ``other`` is broadcast (Note
    [Division by a broadcast divisor])."""
    a, b = bcast(self, other)
    if kind_of(a) == "complex":
        # CPU divides with c10's complex division (Note [Complex special values]).
        parts = complex_math.c10_div(lax.real(a), lax.imag(a), lax.real(b), lax.imag(b))
        return lax.complex(*parts)
    if np.shape(other) == a.shape or kind_of(a) != "float":
        return lax.div(a, b)
    return lax.platform_dependent(a, b, cpu=_div_by_broadcast, default=lax.div)


# Note [Division by a broadcast divisor]
# XLA rewrites ``a / broadcast(b)`` as ``a * broadcast(1 / b)``: one division instead of
# many, but not correctly rounded (``x / 0.3`` differed from torch in the last bit of
# about a quarter of float32 elements, and a float16/bfloat16 quotient at a rounding tie
# by one step). torch's CPU kernels divide every element; torch on CUDA multiplies by the
# reciprocal too. So on CPU the divisor is made a full array behind an optimization
# barrier, which the rewrite cannot see through; TPU and GPU keep the multiplication.
def _div_by_broadcast(a, b):
    return lax.div(a, lax.optimization_barrier(b))


def _floor_div_float(a, b):
    # torch's div_floor_floating (ATen/native/BinaryOps.h): floor of the exact quotient,
    # computed from fmod so that it agrees with remainder; a / b when b == 0.
    a, b = bcast(a, b)
    zero = jnp.zeros((), a.dtype)
    one = jnp.ones((), a.dtype)
    mod = lax.rem(a, b)
    q = lax.div(a - mod, b)
    q = jnp.where((mod != zero) & ((b < zero) != (mod < zero)), q - one, q)
    fq = lax.floor(q)
    fq = jnp.where(q - fq > np.asarray(0.5, a.dtype), fq + one, fq)
    true = lax.div(a, b)
    fq = jnp.where(q == zero, jnp.copysign(zero, true), fq)
    return jnp.where(b == zero, true, fq)


@lowering(aten.floor_divide, promote=Kind.DEFAULT, exact_scalars=("other",))
def floor_divide(self, other):
    """aten::floor_divide (and div rounding_mode='floor') - quotient rounded toward -inf.

    Ints: exact integer floor division; a zero divisor raises ZeroDivisionError as in
    torch (``zero_divisor``; jax would return a value). Floats: torch's fmod-based
    algorithm (inf/NaN for a zero divisor). Reference: torch.floor_divide; ATen
    div_floor_floating."""
    require_kind("floor_divide", self, ("int", "float", "bool"))
    if kind_of(self) in ("int", "bool"):
        if kind_of(self) == "bool":
            return self
        return lax2(jnp.floor_divide)(self, other)
    return _floor_div_float(self, other)


def _div_trunc(self, other, *, rounding_mode="trunc"):
    if kind_of(self) in ("int", "bool"):
        if kind_of(self) == "bool":
            return self
        return lax2(lax.div)(self, other)  # C integer division truncates
    return jnp.trunc(lax2(lax.div)(self, other))


# NO_OPMATH: torch rounds the f16/bf16 quotient to its dtype before truncating
# (2.999 -> 3.0 in bf16 -> 3), so the division runs in the input dtype.
_DIV_TRUNC = {
    ov: functional.make_handler(
        ov, registry.Lowering(_div_trunc, Kind.NO_OPMATH, ("self", "other"))
    )
    for ov in (aten.div.Tensor_mode, aten.div.Scalar_mode)
}


@handler(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(args, kwargs):
    """aten::div(rounding_mode=...) - None: true division (INT_TO_FLOAT promotion);
    'trunc': C-style truncation, 'floor': floor_divide (both DEFAULT promotion, so ints
    stay ints). A handler because the promotion kind depends on the argument."""
    self, other = args[0], args[1]
    mode = kwargs.get("rounding_mode", args[2] if len(args) > 2 else None)
    scalar = not isinstance(other, torch.Tensor)
    if mode is None:
        return (aten.div.Scalar if scalar else aten.div.Tensor)(self, other)
    if mode == "floor":
        return (aten.floor_divide.Scalar if scalar else aten.floor_divide.default)(self, other)
    if mode == "trunc":
        zero_divisor((self, other), {})
        ov = aten.div.Scalar_mode if scalar else aten.div.Tensor_mode
        return _DIV_TRUNC[ov]((self, other), {})
    raise _errors.verbatim(
        RuntimeError(
            f"div expected rounding_mode to be one of None, 'trunc', or 'floor' but found '{mode}'"
        )
    )


@lowering(aten.remainder, promote=Kind.DEFAULT)
def remainder(self, other):
    """aten::remainder - Python-style modulus: the sign follows the divisor.

    Ints: zero divisor raises ZeroDivisionError (``zero_divisor``). Floats: ``fmod``
    then shifted by the divisor when signs differ (torch's algorithm), NaN for a zero
    divisor."""
    require_kind("remainder", self, ("int", "float"))
    if kind_of(self) == "int":
        return lax2(jnp.remainder)(self, other)
    a, b = bcast(self, other)
    zero = jnp.zeros((), a.dtype)
    mod = lax.rem(a, b)
    return jnp.where((mod != zero) & ((b < zero) != (mod < zero)), mod + b, mod)


@lowering(aten.fmod, promote=Kind.DEFAULT)
def fmod(self, other):
    """aten::fmod - C ``fmod``: the sign follows the dividend; an int zero divisor
    raises (``zero_divisor``)."""
    require_kind("fmod", self, ("int", "float"))
    return lax2(lax.rem)(self, other)


# ---------------------------------------------------------------------------------------
# float binary math


@lowering(aten.atan2, promote=Kind.INT_TO_FLOAT)
def atan2(self, other):
    """aten::atan2 - quadrant-aware arctangent of self / other. Reference: jax.lax.atan2."""
    return lax2(lax.atan2)(self, other)


@lowering(aten.hypot, promote=Kind.DEFAULT)
def hypot(self, other):
    """aten::hypot - ``sqrt(self**2 + other**2)`` without overflow (floats only)."""
    return jnp.hypot(*bcast(self, other))


@lowering(aten.copysign, promote=Kind.INT_TO_FLOAT)
def copysign(self, other):
    """aten::copysign - ``|self|`` with the sign bit of ``other`` (-0.0 counts)."""
    return jnp.copysign(*bcast(self, other))


def _xlog(fn):
    def lower(self, other):
        x, y = bcast(self, other)
        zero = jnp.zeros((), x.dtype)
        out = jnp.where(x == zero, zero, x * fn(y))
        return jnp.where(jnp.isnan(y), y, out)

    return lower


@lowering(aten.xlogy, promote=Kind.INT_TO_FLOAT)
def xlogy(self, other):
    """aten::xlogy - ``self * log(other)``, 0 where self == 0, NaN where other is NaN."""
    return _xlog(lax.log)(self, other)


@lowering(aten.special_xlog1py, promote=Kind.INT_TO_FLOAT)
def special_xlog1py(self, other):
    """aten::special_xlog1py - ``self * log1p(other)``, 0 where self == 0, NaN propagates."""
    return _xlog(lax.log1p)(self, other)


@lowering(aten.logaddexp, promote=Kind.DEFAULT)
def logaddexp(self, other):
    """aten::logaddexp - ``log(exp(self) + exp(other))`` computed stably. Complex: as
    torch, ``big + log1p(exp(small - big))`` ordered by real part (jnp picks another
    branch of the imaginary part)."""
    a, b = bcast(self, other)
    if kind_of(a) != "complex":
        return jnp.logaddexp(a, b)
    # torch's helper: ordered by real part (a tie keeps the order), NaN infectious, equal
    # infinite real parts special-cased (the general form would give inf - inf).
    swap = b.real < a.real
    small, big = jnp.where(swap, b, a), jnp.where(swap, a, b)
    nan = jnp.isnan(small.real) | jnp.isnan(small.imag)
    infinite = jnp.isinf(small.real) & (small.real == big.real)
    general = big + jnp.log1p(jnp.exp(small - big))
    both_inf = jnp.log(jnp.exp(small) + jnp.exp(big))
    out = jnp.where(infinite, jnp.where(small.real < 0, small, both_inf), general)
    return jnp.where(nan, jnp.asarray(complex(np.nan, np.nan), a.dtype), out)


@lowering(aten.logaddexp2, promote=Kind.DEFAULT)
def logaddexp2(self, other):
    """aten::logaddexp2 - ``log2(2**self + 2**other)`` computed stably."""
    return jnp.logaddexp2(*bcast(self, other))


# ---------------------------------------------------------------------------------------
# bitwise / logical


def _bitwise(name, fn):
    def lower(self, other):
        require_kind(name, self, ("int", "bool"))
        return lax2(fn)(self, other)

    lower.__name__ = name
    lower.__doc__ = f"aten::{name} - elementwise on ints and bool; floats raise as in torch."
    return lower


def _shift_right(a, b):
    # C++ ``>>`` on unsigned types (uint8) shifts in zeros, on signed ones the sign bit
    if jnp.issubdtype(a.dtype, jnp.unsignedinteger):
        return lax.shift_right_logical(a, b)
    return lax.shift_right_arithmetic(a, b)


for _op, _fn in [
    (aten.bitwise_and, lax.bitwise_and),
    (aten.bitwise_or, lax.bitwise_or),
    (aten.bitwise_xor, lax.bitwise_xor),
    (aten.bitwise_left_shift, lax.shift_left),
    (aten.bitwise_right_shift, _shift_right),
    # Python's ``<<``/``>>``/``<<=``/``>>=``: the same ATen shift kernels under dunder names
    (aten.__lshift__, lax.shift_left),
    (aten.__ilshift__, lax.shift_left),
    (aten.__rshift__, _shift_right),
    (aten.__irshift__, _shift_right),
]:
    lowering(_op, promote=Kind.DEFAULT)(_bitwise(_op._qualified_op_name.split("::")[1], _fn))


for _op, _fn in [
    (aten.logical_and, lax.bitwise_and),
    (aten.logical_or, lax.bitwise_or),
    (aten.logical_xor, lax.bitwise_xor),
]:

    def _logical(self, other, _fn=_fn):
        a, b = bcast(self, other)
        return _fn(a != jnp.zeros((), a.dtype), b != jnp.zeros((), b.dtype))

    lowering(_op, promote=Kind.ALWAYS_BOOL)(_logical)


# ---------------------------------------------------------------------------------------
# integer and float-step math


def _c_int(x):
    # C++ computes int8/int16/uint8 arithmetic in int after promotion: the same here, so
    # abs(-128) and products wrap only where they wrap in ATen's kernels.
    return x.astype(jnp.int32) if x.dtype.itemsize < 4 else x


def _gcd(a, b):
    """ATen's ``calc_gcd``: Euclid on |a|, |b| (stored back in the type: the minimum's
    stays negative) with C's truncating remainder. jnp.gcd loops forever on the type's
    minimum; C's remainder still shrinks |a| every step, so this ends for every input,
    and gives what ATen gives there (gcd(5, -128) in int8 is -1)."""
    a, b = jnp.abs(a), jnp.abs(b)

    def step(ab):
        a, b = ab
        live = a != 0
        return jnp.where(live, lax.rem(b, jnp.where(live, a, 1)), a), jnp.where(live, a, b)

    _, b = lax.while_loop(lambda ab: jnp.any(ab[0] != 0), step, (a, b))
    return b


@lowering(aten.gcd, promote=Kind.DEFAULT)
def gcd(self, other):
    """aten::gcd - greatest common divisor (non-negative but where |x| overflows: as
    ATen's kernel), integers only."""
    require_kind("gcd", self, ("int",))
    return _gcd(*bcast(self, other))


@lowering(aten.lcm, promote=Kind.DEFAULT)
def lcm(self, other):
    """aten::lcm - least common multiple, ``|a / gcd * b|`` (0 if either is 0) as ATen's
    kernel computes it: the product wraps, then its abs. Integers only."""
    require_kind("lcm", self, ("int",))
    a, b = bcast(self, other)
    g = _c_int(_gcd(a, b))
    x, y = _c_int(a), _c_int(b)
    out = jnp.abs(lax.div(x, jnp.where(g == 0, 1, g)) * y)
    return jnp.where(g == 0, jnp.zeros((), x.dtype), out).astype(a.dtype)


@lowering(aten.nextafter, promote=Kind.NO_OPMATH)
def nextafter(self, other):
    """aten::nextafter - the next representable value after self toward other, in the
    input dtype itself (NO_OPMATH: a bf16 step is not an f32 step)."""
    return jnp.nextafter(*bcast(self, other))
