"""``pow`` in every dtype, as ATen computes it: integer powers by squaring over every
bit of the exponent, the float and complex exponents ATen special-cases (``x ** 2``,
``x ** 0.5``, ...) computed as it computes them (docs/numerics.md)."""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from torchjax.ops import complex_math, traced_scalars
from torchjax.ops.pointwise_binary import bcast, kind_of, lax2
from torchjax.ops.registry import Kind, functional_handler, handler, lowering
from torchjax.tensor import dtypes

aten = torch.ops.aten


def _powi(base, exp):
    """ATen's ``powi_impl`` for ``exp >= 0``: square-and-multiply over every bit of the
    exponent, products wrapping in the type. XLA's integer power looks at the low six
    bits only (``2 ** 64`` was 1, ``3 ** 129`` was 3)."""
    one = jnp.ones((), base.dtype)

    def bit(_, carry):
        result, a, b = carry
        result = jnp.where((b & 1) != 0, result * a, result)
        return result, a * a, b >> 1

    init = (jnp.broadcast_to(one, base.shape), base, exp)
    return lax.fori_loop(0, exp.dtype.itemsize * 8, bit, init)[0]


def _int_pow(base, exp):
    # torch's powi: negative exponents give 1 for base 1, +-1 for base -1, else 0.
    base, exp = bcast(base, exp)
    zero = jnp.zeros((), exp.dtype)
    neg = exp < zero
    pos = _powi(base, jnp.where(neg, zero, exp).astype(base.dtype))
    one = jnp.ones((), base.dtype)
    odd = (exp % 2) != 0
    neg_val = jnp.where(
        base == one,
        one,
        jnp.where(base == -one, jnp.where(odd, -one, one), jnp.zeros((), base.dtype)),
    )
    return jnp.where(neg, neg_val, pos)


@lowering(aten.pow.Tensor_Tensor, aten.pow.Scalar, promote=Kind.DEFAULT)
def pow(self, exponent):
    """aten::pow (Tensor_Tensor, Tensor_Scalar, Scalar) - ``self ** exponent``.

    Dtypes: DEFAULT promotion. Ints: exact integer power with torch's rule for negative
    exponents (1 ** -n = 1, (-1) ** -n = +-1, else 0); a negative Python-scalar exponent
    with an integer base raises, as in torch (``pow_tensor_scalar``, before promotion).
    bool: ``self or not exponent``."""
    kind = kind_of(self) if hasattr(self, "dtype") else kind_of(exponent)
    if kind == "bool":
        return lax2(lax.bitwise_or)(self, lax.bitwise_not(jnp.asarray(exponent)))
    if kind == "int":
        return _int_pow(self, exponent)
    if kind == "complex":
        dt = self.dtype if hasattr(self, "dtype") else exponent.dtype
        return complex_math.pow(*bcast(jnp.asarray(self, dt), jnp.asarray(exponent, dt)))
    return lax2(lax.pow)(self, exponent)


_pow_scalar = functional_handler(aten.pow.Tensor_Scalar, pow, promote=Kind.DEFAULT)


@handler(aten.pow.Tensor_Scalar)
def pow_tensor_scalar(args, kwargs):
    """aten::pow.Tensor_Scalar at the torch level: a negative integer exponent of an
    integer tensor raises before promotion, which would wrap it (uint8 ** -2 is 254)."""
    self, exponent = args[0], args[1] if len(args) > 1 else kwargs["exponent"]
    if traced_scalars.is_traced(exponent):
        # ATen special-cases exponents by value (below): the number is needed (Note
        # [Traced Python floats]); the graph is traced with static values
        raise traced_scalars.NeedsValue("aten::pow's exponent selects ATen's kernel")
    if (
        isinstance(exponent, int)
        and not isinstance(exponent, bool)
        and exponent < 0
        and not (self.dtype.is_floating_point or self.dtype.is_complex)
    ):
        raise RuntimeError("Integers to negative integer powers are not allowed.")
    if isinstance(exponent, int) and not (self.dtype.is_floating_point or self.dtype.is_complex):
        dtypes.check_scalar_fits(exponent, self.dtype, "pow")
    elif isinstance(exponent, (int, float)) and dtypes.is_half(self.dtype):
        # CPU's half kernels read the exponent as the tensor's type (checked); float32
        # and float64 ones read it as a double.
        dtypes.check_scalar_fits(exponent, self.dtype, "pow")
    special = _cpu_special_power(self, exponent)
    return _pow_scalar(args, kwargs) if special is None else special


def _cpu_special_power(self, exponent):
    """``self ** exponent`` as ATen's ``pow_tensor_scalar_kernel`` computes the powers it
    special-cases for float and complex results: 0.5, -0.5 and -1 as sqrt, rsqrt and
    reciprocal; 2, 3 and -2 as ``x*x``, ``x*x*x`` and ``1/(x*x)`` (not for float16,
    which takes ``std::pow``). A general power gave other last bits (a quarter of
    float32 ``x ** 3``, ``x ** -0.5``), and complex ``z ** 2`` went through the polar
    form (``(2j) ** 2`` had an imaginary part). None: the general power."""
    if isinstance(exponent, bool) or not isinstance(exponent, (int, float, complex)):
        return None
    if complex(exponent).imag != 0:
        return None
    e = complex(exponent).real
    if e not in (0.5, -0.5, -1.0, 2.0, 3.0, -2.0):
        return None
    dtype = torch.result_type(self, exponent)
    if not (dtype.is_floating_point or dtype.is_complex):
        return None
    x = self if self.dtype == dtype else aten._to_copy.default(self, dtype=dtype)
    if e == 0.5:
        return aten.sqrt.default(x)
    if e == -0.5:
        return aten.rsqrt.default(x)
    if e == -1.0:
        return aten.reciprocal.default(x)
    if dtype == torch.float16:
        return None
    square = aten.mul.Tensor(x, x)
    if e == 2.0:
        return square
    if e == 3.0:
        return aten.mul.Tensor(square, x)
    return aten.reciprocal.default(square)
