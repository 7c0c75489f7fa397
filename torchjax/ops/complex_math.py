"""Complex elementwise functions with CPU PyTorch's values at special points.

Each function takes and returns one complex ``jax.Array``; pointwise_unary.py calls them
for complex inputs only, so real dtypes keep their one lax primitive.

Note [Complex special values]
CPU torch computes complex math with glibc's C99 functions (``std::sqrt`` ... reached
through c10/util/complex_math.h: Annex G values at infinities, NaNs and signed zeros) and,
for some ops, with its own formulas (ATen/cpu/vec/vec256/vec256_complex_*.h and c10):
``log2``/``log10`` divide both parts of ``log`` by ln 2 / ln 10, ``acos`` is
``pi/2 - asin`` part by part, ``exp2`` is ``exp(z * ln 2)``, ``log1p``/``expm1`` are
c10's formulas, and ``reciprocal``, ``rsqrt`` (``1 / sqrt``) and ``sigmoid``
(``1 / (1 + exp(0 - z))``), ``silu`` and complex ``aten::div`` itself divide with c10's
complex division (numpy's scaled one). ``aten::add``/``sub``/``rsub`` multiply their
second operand by alpha (``scale``: a complex product, even by 1 + 0j, which spreads a NaN
or infinite part to both parts), and a general power is glibc's ``cpow`` (``pow``).
XLA's complex functions are accurate at ordinary points but not at special ones: NaN
where C99 gives an infinity or a zero, zero parts with their own signs, branch cuts
that ignore the sign of a zero part. So each function here either follows CPU's formula
in real arithmetic (where that formula is what CPU runs), or keeps XLA's result at finite
points and overrides the special ones with Annex G's table, using the symmetries C99
defines the functions by: f(conj z) = conj f(z) for all, and f(-z) = -f(z) for the odd
ones (asinh, atanh), so XLA only ever sees the first quadrant. The trigonometric
functions are the hyperbolic ones rotated (sin z = -i sinh(iz), as Annex G defines
them); the rotation only swaps parts and flips signs, so it is exact.
Constants that XLA would fold into the arithmetic (``x + 0``, ``0 - x``, ``(x + 1) - 1``,
a division by ln 10 made a multiplication) sit behind an optimization barrier, so the
signs of zeros and the last bits are CPU's at every optimisation level.
What still differs (XLA flushing subnormals to zero, CPU's vector lanes computing
``neg`` as ``0 - z``) is listed with its cause in tests/ops/test_complex_special_values.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax


def _parts(z):
    return lax.real(z), lax.imag(z)


def _full(like, value):
    return jnp.full_like(like, value)


def _opaque(*arrays):
    """Constants XLA may not fold into the arithmetic: it rewrites ``x + 0`` to ``x``
    and ``0 - x`` to ``-x``, which turns a -0 into +0 the other way round from C."""
    return lax.optimization_barrier(arrays)


def _zero_like_sign(like):
    """+0 or -0 with ``like``'s sign bit."""
    return jnp.copysign(jnp.zeros_like(like), like)


def c10_div(a, b, c, d):
    """(a + bi) / (c + di) as c10::complex divides (numpy's scaled division, with its
    zero-divisor branch), part by part; returns (real, imag).

    c10 multiplies by ``scl = 1 / (c + d * rat)``; where that is subnormal, XLA would
    flush it to zero (and an O(1) quotient to 0 or NaN), so there it divides instead."""
    abs_c, abs_d = jnp.abs(c), jnp.abs(d)
    one = _full(c, 1)
    huge = _full(c, 1 / np.finfo(np.dtype(c.dtype)).tiny)

    def scaled(num_re, num_im, den):
        big = jnp.abs(den) > huge
        scl = one / den
        re = jnp.where(big, num_re / den, num_re * scl)
        return re, jnp.where(big, num_im / den, num_im * scl)

    rat1 = d / c
    re1, im1 = scaled(a + b * rat1, b - a * rat1, c + d * rat1)
    rat2 = c / d
    re2, im2 = scaled(a * rat2 + b, b * rat2 - a, d + c * rat2)
    zeros = (abs_c == 0) & (abs_d == 0)
    first = abs_c >= abs_d  # False where either is NaN, as in C
    re = jnp.where(zeros, a / abs_c, jnp.where(first, re1, re2))
    im = jnp.where(zeros, b / abs_d, jnp.where(first, im1, im2))
    return re, im


def reciprocal(z):
    """ATen's complex reciprocal: ``complex(1) / z`` with c10's division."""
    x, y = _parts(z)
    one, zero = _opaque(_full(x, 1), _full(x, 0))
    return lax.complex(*c10_div(one, zero, x, y))


def sqrt(z):
    """csqrt: XLA's value, conjugate-symmetric, with Annex G's infinite cases."""
    out = conj_symmetric(lax.sqrt)(z)
    x, y = _parts(z)
    inf, nan = _full(x, np.inf), _full(x, np.nan)
    out = jnp.where((x == np.inf) & jnp.isnan(y), lax.complex(inf, nan), out)
    out = jnp.where((x == -np.inf) & jnp.isnan(y), lax.complex(nan, inf), out)
    return jnp.where(jnp.isinf(y), lax.complex(inf, y), out)


def rsqrt(z):
    """ATen's complex rsqrt: ``sqrt(z).reciprocal()``."""
    return reciprocal(sqrt(z))


def _abs(x, y):
    # hypot's rule: an infinite part makes |z| infinite even beside a NaN.
    mag = lax.abs(lax.complex(x, y))
    return jnp.where(jnp.isinf(x) | jnp.isinf(y), _full(x, np.inf), mag)


def log(z):
    """clog: XLA's value at finite points (conjugate-symmetric); elsewhere
    ``log|z| + i atan2(y, x)``, which is Annex G's table there."""
    out = conj_symmetric(lax.log)(z)
    x, y = _parts(z)
    special = lax.complex(lax.log(_abs(x, y)), lax.atan2(y, x))
    return jnp.where(jnp.isfinite(x) & jnp.isfinite(y), out, special)


def log_scaled(z, base: float):
    """log2/log10: CPU divides both parts of ``log(z)`` by ln(base)."""
    re, im = _parts(log(z))
    # Opaque: XLA turns a division by a constant into a multiplication by its inverse,
    # a last-bit difference (torch compares a complex with an infinite part exactly).
    (scale,) = _opaque(jnp.full_like(re, np.log(base)))
    return lax.complex(re / scale, im / scale)


def _mul(a, b, c, d):
    return a * c - b * d, a * d + b * c


def log1p(z):
    """c10's log1p: ``u = z + 1``; z where u == 1, else ``log(u) * (z / (u - 1))``
    unless ``u - 1 == z``."""
    x, y = _parts(z)
    (one,) = _opaque(jnp.ones_like(x))  # XLA would fold (x + 1) - 1 into x
    ux = x + one
    log_u = log(lax.complex(ux, y))
    lr, li = _parts(log_u)
    dx = ux - one
    qr, qi = c10_div(x, y, dx, y)
    out = lax.complex(*_mul(lr, li, qr, qi))
    out = jnp.where((dx == x) & (y == y), log_u, out)
    return jnp.where((ux == 1) & (y == 0), z, out)


def exp(z):
    """cexp: XLA's value (conjugate-symmetric) with Annex G's values at an infinite
    real part beside a non-finite imaginary one: exp(-inf + inf j) and exp(-inf + nan j)
    are 0 (the imaginary zero with y's sign), exp(+inf + inf j) and exp(+inf + nan j)
    are inf + nan j (XLA: NaN)."""
    out = conj_symmetric(lax.exp)(z)
    x, y = _parts(z)
    odd = ~jnp.isfinite(y)
    zero = lax.complex(jnp.zeros_like(x), _zero_like_sign(y))
    inf_nan = lax.complex(_full(x, np.inf), _full(y, np.nan))
    out = jnp.where(odd & (x == -np.inf), zero, out)
    return jnp.where(odd & (x == np.inf), inf_nan, out)


def exp2(z):
    """CPU's exp2: ``exp(z * ln 2)``, both parts scaled."""
    x, y = _parts(z)
    ln2 = np.asarray(np.log(2), dtype=x.dtype)
    return exp(lax.complex(x * ln2, y * ln2))


def expm1(z):
    """c10's expm1: ``expm1(x) cos y - 2 sin(y/2)**2 + i exp(x) sin y``."""
    x, y = _parts(z)
    s = lax.sin(y / 2)
    return lax.complex(lax.expm1(x) * lax.cos(y) - 2 * s * s, lax.exp(x) * lax.sin(y))


def sinh(z):
    """csinh as ``sinh x cos y + i cosh x sin y`` with Annex G's values where that
    product meets 0 * inf: a zero imaginary part stays, ``sinh(±0 + i{inf,nan})`` is
    ``±0 + nan j`` and ``sinh(±inf + i{inf,nan})`` is ``inf + nan j``."""
    x, y = _parts(z)
    re = lax.sinh(x) * lax.cos(y)
    im = lax.cosh(x) * lax.sin(y)
    bad_y = ~jnp.isfinite(y)
    re = jnp.where((x == 0) & bad_y, x, re)
    re = jnp.where(jnp.isinf(x) & bad_y, _full(x, np.inf), re)
    im = jnp.where(y == 0, y, im)
    return lax.complex(re, im)


def cosh(z):
    """ccosh as ``cosh x cos y + i sinh x sin y``; Annex G where that product meets
    0 * inf: ``cosh(±inf ± 0j)`` keeps a signed zero, ``cosh(±0 + i{inf,nan})`` is
    ``nan + 0j``, ``cosh(nan ± 0j)`` keeps y and ``cosh(±inf + i{inf,nan})`` is
    ``inf + nan j``."""
    x, y = _parts(z)
    re = lax.cosh(x) * lax.cos(y)
    im = lax.sinh(x) * lax.sin(y)
    bad_y = ~jnp.isfinite(y)
    zero_im = jnp.where(jnp.signbit(x) != jnp.signbit(y), _full(y, -0.0), _full(y, 0.0))
    im = jnp.where(y == 0, jnp.where(jnp.isnan(x), y, zero_im), im)
    re = jnp.where(jnp.isinf(x) & bad_y, _full(x, np.inf), re)
    im = jnp.where((x == 0) & bad_y, _full(y, 0.0), im)
    return lax.complex(re, im)


def tanh(z):
    """ctanh: XLA's value (conjugate-symmetric); ``tanh(±0 + i{inf,nan})`` is
    ``±0 + nan j`` (XLA: NaN)."""
    out = conj_symmetric(lax.tanh)(z)
    x, y = _parts(z)
    return jnp.where((x == 0) & ~jnp.isfinite(y), lax.complex(x, _full(y, np.nan)), out)


def _times_i(z):
    x, y = _parts(z)
    return lax.complex(-y, x)


def _times_minus_i(z):
    x, y = _parts(z)
    return lax.complex(y, -x)


def sin(z):
    """csin(z) = -i csinh(iz); glibc gives ``+inf`` as the imaginary part of
    ``sin({nan,inf} ± inf j)`` (the identity: ``∓inf``; Annex G leaves the sign open)."""
    out = _times_minus_i(sinh(_times_i(z)))
    x, y = _parts(z)
    nan_inf = lax.complex(_full(x, np.nan), _full(y, np.inf))
    return jnp.where(~jnp.isfinite(x) & jnp.isinf(y), nan_inf, out)


def cos(z):
    """ccos(z) = ccosh(iz)."""
    return cosh(_times_i(z))


def tan(z):
    """ctan(z) = -i ctanh(iz)."""
    return _times_minus_i(tanh(_times_i(z)))


def _odd(fn):
    """f on the first quadrant, signs restored by f(-z) = -f(z), f(conj z) = conj f(z)."""

    def lowered(z):
        x, y = _parts(z)
        re, im = _parts(fn(lax.complex(jnp.abs(x), jnp.abs(y))))
        return lax.complex(jnp.copysign(re, x), jnp.copysign(im, y))

    return lowered


def asinh(z):
    """casinh: XLA's value on the first quadrant, odd and conjugate-symmetric (so
    ``asinh(-0 - 1.5j)`` has a negative real part, the cut's other side); Annex G's
    NaN rows."""
    out = _odd(lax.asinh)(z)
    x, y = _parts(z)
    nan, inf = _full(x, np.nan), _full(x, np.inf)
    nan_nan = lax.complex(nan, nan)
    x_nan = jnp.where(y == 0, lax.complex(nan, y), nan_nan)
    x_nan = jnp.where(jnp.isinf(y), lax.complex(inf, nan), x_nan)
    y_nan = jnp.where(jnp.isinf(x), lax.complex(x, nan), nan_nan)
    out = jnp.where(jnp.isnan(y), y_nan, out)
    return jnp.where(jnp.isnan(x), x_nan, out)


def asin(z):
    """casin(z) = -i casinh(iz); beside a NaN, glibc's casin gives ``±0 + nan j`` at a
    zero real part (x kept) and ``nan + inf j`` (y's sign) beside an infinity."""
    out = _times_minus_i(asinh(_times_i(z)))
    x, y = _parts(z)
    any_nan = jnp.isnan(x) | jnp.isnan(y)
    nan_inf = lax.complex(_full(x, np.nan), jnp.copysign(_full(y, np.inf), y))
    return jnp.where(any_nan & (jnp.isinf(x) | jnp.isinf(y)), nan_inf, out)


def acos(z):
    """CPU's acos: ``pi/2 - asin(z)``. complex128's vector kernel subtracts part by part
    (``0 - im``: a zero imaginary part is +0); complex64's calls glibc's cacosf, which
    negates (``-im``)."""
    re, im = _parts(asin(z))
    re = np.asarray(np.pi / 2, re.dtype) - re
    if z.dtype == jnp.complex64:
        return lax.complex(re, -im)
    (zero,) = _opaque(jnp.zeros_like(im))
    return lax.complex(re, zero - im)


def acosh(z):
    """cacosh: XLA's value (conjugate-symmetric) at finite points; Annex G's NaN rows:
    ``acosh(±0 + nan j)`` is ``nan + i pi/2``, a NaN beside a finite part NaN + NaN j,
    beside an infinite one inf + NaN j."""
    out = conj_symmetric(lax.acosh)(z)
    x, y = _parts(z)
    nan, inf = _full(x, np.nan), _full(x, np.inf)
    any_nan = jnp.isnan(x) | jnp.isnan(y)
    other_inf = jnp.isinf(x) | jnp.isinf(y)
    special = jnp.where(other_inf, lax.complex(inf, nan), lax.complex(nan, nan))
    special = jnp.where(x == 0, lax.complex(nan, _full(y, np.pi / 2)), special)
    return jnp.where(any_nan, special, out)


def atanh(z):
    """catanh: XLA's value on the first quadrant (odd, conjugate-symmetric) at finite
    points; Annex G's table elsewhere: an infinite part gives ``±0 ± i pi/2``, a NaN
    gives NaN + NaN j except ``atanh(nan ± inf j)`` = ``0 ± i pi/2``,
    ``atanh(±inf + nan j)`` = ``±0 + nan j`` and ``atanh(±0 + nan j)`` = ``±0 + nan j``."""
    out = _odd(lax.atanh)(z)
    x, y = _parts(z)
    nan = _full(x, np.nan)
    half_pi = jnp.copysign(_full(y, np.pi / 2), y)
    inf_part = lax.complex(_zero_like_sign(x), half_pi)
    out = jnp.where(jnp.isinf(x) | jnp.isinf(y), inf_part, out)
    x_nan = jnp.where(jnp.isinf(y), lax.complex(jnp.zeros_like(x), half_pi), lax.complex(nan, nan))
    keeps_x = jnp.isinf(x) | (x == 0)
    y_nan = jnp.where(keeps_x, lax.complex(_zero_like_sign(x), nan), lax.complex(nan, nan))
    out = jnp.where(jnp.isnan(y), y_nan, out)
    return jnp.where(jnp.isnan(x), x_nan, out)


def atan(z):
    """catan(z) = -i catanh(iz); ``atan(±inf + nan j)`` is ``±pi/2 + 0j`` with the
    NaN's sign on the zero (the rotation would flip it)."""
    out = _times_minus_i(atanh(_times_i(z)))
    x, y = _parts(z)
    half_pi = lax.complex(jnp.copysign(_full(x, np.pi / 2), x), _zero_like_sign(y))
    return jnp.where(jnp.isinf(x) & jnp.isnan(y), half_pi, out)


def _one_plus_exp_minus(z):
    """``1 + exp(-z)`` as CPU's vector kernels form it, part by part (their complex
    ``neg`` is ``0 - z``); returns (real, imag)."""
    x, y = _parts(z)
    zero, one = _opaque(jnp.zeros_like(x), jnp.ones_like(x))
    er, ei = _parts(exp(lax.complex(zero - x, zero - y)))
    return er + one, ei + zero


def sigmoid(z):
    """CPU's complex sigmoid: ``(1 + exp(-z)).reciprocal()`` (c10's division)."""
    return reciprocal(lax.complex(*_one_plus_exp_minus(z)))


def silu(z):
    """CPU's complex silu: ``z / (1 + exp(-z))`` with c10's division."""
    x, y = _parts(z)
    return lax.complex(*c10_div(x, y, *_one_plus_exp_minus(z)))


def scale(x, alpha: complex):
    """``alpha * x`` as ATen's add kernel forms it for a complex ``x`` (``self + alpha *
    other``, ``sub`` and ``rsub`` with ``-alpha``): a full complex product even for
    alpha = 1, so a NaN or infinite part of ``x`` reaches both parts of the result
    (``1 - (nan - 1j)`` is NaN + NaN j on CPU)."""
    xr, xi = _parts(x)
    ar, ai = _opaque(_full(xr, alpha.real), _full(xr, alpha.imag))
    return lax.complex(xr * ar - xi * ai, xr * ai + xi * ar)


def _c99_mul(a, b, c, d):
    """(a + bi)(c + di) as C computes a complex product (libgcc's ``__muldc3``, Annex G):
    where both parts come out NaN, an infinite operand is boxed to ±1 / ±0 and the
    product recomputed scaled by inf (NaN operands beside it read as zeros), and an
    overflow to inf in a partial product is recovered the same way."""
    ac, bd, ad, bc = a * c, b * d, a * d, b * c
    x, y = ac - bd, ad + bc
    isinf, isnan = jnp.isinf, jnp.isnan

    def box(v):
        return jnp.copysign(jnp.where(isinf(v), _full(v, 1), _full(v, 0)), v)

    def zero_nan(v):
        return jnp.where(isnan(v), jnp.copysign(_full(v, 0), v), v)

    z_inf = isinf(a) | isinf(b)
    a, b = jnp.where(z_inf, box(a), a), jnp.where(z_inf, box(b), b)
    c, d = jnp.where(z_inf, zero_nan(c), c), jnp.where(z_inf, zero_nan(d), d)
    w_inf = isinf(c) | isinf(d)
    c, d = jnp.where(w_inf, box(c), c), jnp.where(w_inf, box(d), d)
    a, b = jnp.where(w_inf, zero_nan(a), a), jnp.where(w_inf, zero_nan(b), b)
    overflow = ~z_inf & ~w_inf & (isinf(ac) | isinf(bd) | isinf(ad) | isinf(bc))
    a, b, c, d = (jnp.where(overflow, zero_nan(v), v) for v in (a, b, c, d))
    recalc = isnan(x) & isnan(y) & (z_inf | w_inf | overflow)
    inf = _full(x, np.inf)
    x = jnp.where(recalc, inf * (a * c - b * d), x)
    y = jnp.where(recalc, inf * (a * d + b * c), y)
    return x, y


def pow(z, w):
    """CPU's general complex power, ``std::pow(z, w)``: glibc's cpow,
    ``cexp(w * clog(z))`` with C's complex product (Annex G values at infinities and
    NaNs; XLA's power gave NaN + NaN j where CPU gives inf + NaN j or a zero)."""
    lr, li = _parts(log(z))
    wr, wi = _parts(w)
    return exp(lax.complex(*_c99_mul(wr, wi, lr, li)))


def conj_symmetric(fn):
    """fn made to satisfy f(conj z) = conj f(z): XLA ignores the sign of a zero
    imaginary part (sqrt(-1 - 0j) gave +1j), C99 uses it to pick a side of a cut."""

    def lowered(z):
        below = jnp.signbit(lax.imag(z))
        out = fn(jnp.where(below, lax.conj(z), z))
        return jnp.where(below, lax.conj(out), out)

    return lowered
