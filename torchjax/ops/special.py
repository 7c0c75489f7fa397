"""Special functions: Airy, Bessel, Hurwitz zeta, incomplete gamma, and the lowerings of
the orthogonal polynomials (evaluated in special_polynomials.py).

Values follow ATen's own algorithms (aten/src/ATen/native/Math.h): the Cephes rational
approximations and Chebyshev series, with their coefficient tables (at the end of this
module), and the three-term recurrences of the polynomials. Every branch of a piecewise
definition is computed on a "safe" copy of the input and one is picked with ``jnp.where``,
so edge values are torch's: -inf at 0 and NaN below it for y0/y1, +inf at 0 for k0/k1,
NaN at +-inf for Ai, 0 for a polynomial of negative degree, and so on.

Dtypes: all are INT_TO_FLOAT (ints and bool compute in the default float); ATen evaluates
in the input's own float type except ``zeta``, which it sums in double (``acc_type`` on
CPU), and ``igamma``/``igammac`` on float16/bfloat16, which it computes in float32
(here float32 itself is evaluated in float64: XLA's float32 series are less accurate).

Polynomials of a tensor degree ``n``: ATen loops k = 2..n per element (stopping early at a
NaN). Here one ``lax.while_loop`` advances every element together and freezes each one at
its own n or NaN, stopping when none is left; the trip count is data, not shape, so this
traces under ``jax.jit`` too. Series that stop at convergence (Ai's) work the same way.
At a NaN ``x`` ATen's U/V/W, Legendre and Laguerre loops exit before assigning their
result and return an uninitialized value; we return NaN.

Compilation: each function here is one sizeable XLA program (about a second to compile).
In eager mode ``_elementwise`` runs it on the flattened input padded to a power-of-two
length, so one executable per dtype and size octave serves every shape; the lowerings are
registered ``jit=False`` so the registry does not compile them once per shape instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.ops import _special_tables as _tab
from torchjax.ops.registry import Kind, lowering
from torchjax.ops.special_polynomials import (
    chebyshev,
    const_like,
    hermite,
    laguerre,
    legendre,
    select_first,
)

aten = torch.ops.aten

_SQRT_2_OVER_PI = 0.797884560802865355879892119868763737
_TWO_OVER_PI = 0.636619772367581343075535053490057448
_PI_4 = 0.785398163397448309615660845819875721
_3PI_4 = 2.356194490192344928846982537459627163


def _polevl(x, coefs):
    """sum(coefs[i] * x**(N - i)) by Horner's rule, as ATen's inline loops do."""
    acc = jnp.zeros_like(x)
    for c in coefs:
        acc = acc * x + const_like(c, x)
    return acc


def _chbevl(y, coefs):
    """Clenshaw sum of a Chebyshev series at ``y`` (Cephes ``chbevl``): 0.5 * (b0 - b2)."""
    p = q = jnp.zeros_like(y)
    a = jnp.full_like(y, coefs[0])
    for c in coefs[1:]:
        p, q = q, a
        a = y * q - p + const_like(c, y)
    return const_like(0.5, y) * (a - p)


# ---------------------------------------------------------------------------------------
# Airy and Bessel functions of the first and second kind


@jax.jit
def _airy_ai(x):
    one = const_like(1.0, x)
    neg = x < -2.09
    pos = x >= 2.09
    # x < -2.09: the oscillating asymptotic expansion.
    xn = jnp.where(neg, x, const_like(-3.0, x))
    zeta_n = const_like(-2.0, x) * xn * jnp.sqrt(-xn) / const_like(3.0, x)
    z = one / zeta_n
    zz = z * z
    afn, afd = _polevl(zz, _tab.AIRY_AI_AFN), _polevl(zz, _tab.AIRY_AI_AFD)
    agn, agd = _polevl(zz, _tab.AIRY_AI_AGN), _polevl(zz, _tab.AIRY_AI_AGD)
    t = zeta_n + const_like(0.25 * np.pi, x)
    ai_neg = (
        const_like(5.64189583547756286948e-01, x)
        / jnp.sqrt(jnp.sqrt(-xn))
        * (jnp.sin(t) * (one + zz * afn / afd) - jnp.cos(t) * (z * agn / agd))
    )
    # x >= 2.09: the decaying asymptotic expansion.
    xp = jnp.where(pos, x, const_like(3.0, x))
    zeta_p = const_like(2.0, x) * xp * jnp.sqrt(xp) / const_like(3.0, x)
    an, ad = _polevl(one / zeta_p, _tab.AIRY_AI_AN), _polevl(one / zeta_p, _tab.AIRY_AI_AD)
    ai_pos = (
        const_like(5.64189583547756286948e-01, x)
        * (an / ad)
        / (const_like(2.0, x) * jnp.sqrt(jnp.sqrt(xp)) * jnp.exp(zeta_p))
    )
    # In between: the Maclaurin series f(x) c1 - g(x) c2, summed until it converges.
    xs = jnp.where(neg | pos, jnp.zeros_like(x), x)
    cube = xs * xs * xs
    eps = const_like(np.finfo(x.dtype).eps, x)

    def body(s):
        f, g, k, m, n, active = s
        m2 = m * cube
        k1 = k + one
        m2 = m2 / k1
        n2 = n * cube
        k2 = k1 + one
        n2 = n2 / k2
        m2 = m2 / k2
        f2 = f + m2
        k3 = k2 + one
        n2 = n2 / k3
        g2 = g + n2
        upd = lambda new, old: jnp.where(active, new, old)  # noqa: E731
        still = active & (jnp.abs(m2 / f2) > eps)
        return upd(f2, f), upd(g2, g), upd(k3, k), upd(m2, m), upd(n2, n), still

    ones = jnp.ones_like(x)
    init = (ones, xs, ones, ones, xs, jnp.ones(x.shape, dtype=bool))
    f, g, *_ = lax.while_loop(lambda s: jnp.any(s[-1]), body, init)
    ai_mid = const_like(0.355028053887817239260, x) * f - const_like(0.258819403792806798405, x) * g
    nan = const_like(np.nan, x)
    return select_first(
        jnp.isinf(x), nan, x > 103.892, jnp.zeros_like(x), neg, ai_neg, pos, ai_pos, ai_mid
    )


@jax.jit
def _bessel_j0(x):
    x = jnp.abs(x)
    small = x <= 5.0
    xs = jnp.where(small, x, jnp.ones_like(x))
    x2 = xs * xs
    rp, rq = _polevl(x2, _tab.BESSEL_J0_RP), _polevl(x2, _tab.BESSEL_J0_RQ)
    j_small = (x2 - const_like(5.78318596294678452118e00, x)) * (
        x2 - const_like(3.04712623436620863991e01, x)
    )
    j_small = j_small * rp / rq
    tiny = const_like(1.0, x) - x * x / const_like(4.0, x)
    return select_first(x < 0.00001, tiny, small, j_small, _bessel_large(x, _J0_ASYMPTOTIC, False))


@jax.jit
def _bessel_j1(x):
    sign = jnp.where(x < 0, const_like(-1.0, x), const_like(1.0, x))
    x = jnp.abs(x)
    small = x <= 5.0
    xs = jnp.where(small, x, jnp.ones_like(x))
    x2 = xs * xs
    rp, rq = _polevl(x2, _tab.BESSEL_J1_RP), _polevl(x2, _tab.BESSEL_J1_RQ)
    j_small = rp / rq * xs * (x2 - const_like(1.46819706421238932572e01, x))
    j_small = j_small * (x2 - const_like(4.92184563216946036703e01, x))
    return sign * jnp.where(small, j_small, _bessel_large(x, _J1_ASYMPTOTIC, False))


def _bessel_large(x, tables, second_kind):
    """The x > 5 Hankel asymptotic form shared by j0/y0 (phase pi/4) and j1/y1 (3 pi/4)."""
    pp_c, pq_c, qp_c, qq_c, phase, order1 = tables
    xl = jnp.where(x <= 5.0, const_like(6.0, x), x)
    five = const_like(5.0, x)
    w = five / xl * (five / xl) if order1 else const_like(25.0, x) / (xl * xl)
    p = _polevl(w, pp_c) / _polevl(w, pq_c)
    q = five / xl * (_polevl(w, qp_c) / _polevl(w, qq_c))
    arg = xl - const_like(phase, x)
    if second_kind:
        val = p * jnp.sin(arg) + q * jnp.cos(arg)
    else:
        val = p * jnp.cos(arg) - q * jnp.sin(arg)
    return val * const_like(_SQRT_2_OVER_PI, x) / jnp.sqrt(xl)


@jax.jit
def _bessel_y0(x):
    small = x <= 5.0
    xs = jnp.where(small & (x > 0), x, jnp.ones_like(x))
    x2 = xs * xs
    y_small = _polevl(x2, _tab.BESSEL_Y0_YP) / _polevl(x2, _tab.BESSEL_Y0_YQ)
    y_small = y_small + const_like(_TWO_OVER_PI, x) * jnp.log(xs) * _bessel_j0(xs)
    return select_first(
        x == 0,
        const_like(-np.inf, x),
        x < 0,
        const_like(np.nan, x),
        small,
        y_small,
        _bessel_large(x, _J0_ASYMPTOTIC, True),
    )


@jax.jit
def _bessel_y1(x):
    small = x <= 5.0
    xs = jnp.where(small & (x > 0), x, jnp.ones_like(x))
    x2 = xs * xs
    y_small = xs * (_polevl(x2, _tab.BESSEL_Y1_YP) / _polevl(x2, _tab.BESSEL_Y1_YQ))
    y_small = y_small + const_like(_TWO_OVER_PI, x) * (
        _bessel_j1(xs) * jnp.log(xs) - const_like(1.0, x) / xs
    )
    return select_first(
        x == 0,
        const_like(-np.inf, x),
        x < 0,
        const_like(np.nan, x),
        small,
        y_small,
        _bessel_large(x, _J1_ASYMPTOTIC, True),
    )


@jax.jit
def _spherical_bessel_j0(x):
    x2 = x * x
    series = const_like(1.0 / 6227020800.0, x)
    for c in (-1.0 / 39916800.0, 1.0 / 362880.0, -1.0 / 5040.0, 1.0 / 120.0, -1.0 / 6.0, 1.0):
        series = const_like(c, x) + x2 * series
    safe = jnp.where(jnp.abs(x) < 0.5, jnp.ones_like(x), x)
    return select_first(
        jnp.isinf(x), jnp.zeros_like(x), jnp.abs(x) < 0.5, series, jnp.sin(safe) / safe
    )


# ---------------------------------------------------------------------------------------
# Modified Bessel functions (Chebyshev series, Cephes i0/i1/k0/k1)


@functools.partial(jax.jit, static_argnames="order")
def _bessel_i(x, order):
    ax = jnp.abs(x)
    small = ax <= 8.0
    a_tab, b_tab = (
        (_tab.MODIFIED_BESSEL_I0_A, _tab.MODIFIED_BESSEL_I0_B)
        if order == 0
        else (
            _tab.MODIFIED_BESSEL_I1_A,
            _tab.MODIFIED_BESSEL_I1_B,
        )
    )
    xs = jnp.where(small, ax, jnp.zeros_like(ax))
    xl = jnp.where(small, const_like(32.0, x), ax)
    a = _chbevl(xs / const_like(2.0, x) - const_like(2.0, x), a_tab)
    b = _chbevl(const_like(32.0, x) / xl - const_like(2.0, x), b_tab)
    if order == 0:
        return jnp.where(small, jnp.exp(ax) * a, jnp.exp(ax) * b / jnp.sqrt(xl))
    val = jnp.where(small, a * ax * jnp.exp(ax), jnp.exp(ax) * b / jnp.sqrt(xl))
    return jnp.where(x < 0, -val, val)


@functools.partial(jax.jit, static_argnames=("order", "scaled"))
def _bessel_k(x, order, scaled):
    small = x <= 2.0
    a_tab, b_tab = (
        (_tab.MODIFIED_BESSEL_K0_A, _tab.MODIFIED_BESSEL_K0_B)
        if order == 0
        else (
            _tab.MODIFIED_BESSEL_K1_A,
            _tab.MODIFIED_BESSEL_K1_B,
        )
    )
    xs = jnp.where(small & (x > 0), x, jnp.ones_like(x))
    xl = jnp.where(small, const_like(4.0, x), x)
    a = _chbevl(xs * xs - const_like(2.0, x), a_tab)
    log_half = jnp.log(const_like(0.5, x) * xs)
    if order == 0:
        k_small = a - log_half * _bessel_i(xs, 0)
    else:
        k_small = log_half * _bessel_i(xs, 1) + a / xs
    k_large = _chbevl(const_like(8.0, x) / xl - const_like(2.0, x), b_tab) / jnp.sqrt(xl)
    if scaled:
        k_small = k_small * jnp.exp(xs)
    else:
        k_large = jnp.exp(-xl) * k_large
    return select_first(
        x == 0, const_like(np.inf, x), x < 0, const_like(np.nan, x), small, k_small, k_large
    )


# ---------------------------------------------------------------------------------------
# Hurwitz zeta and the regularized incomplete gamma functions


@functools.partial(jax.jit, static_argnames="float32_first")
def _zeta(x, q, float32_first=False):
    """Hurwitz zeta in float64 (``x``, ``q`` float64) with ATen's edge values.

    ``float32_first``: for a float32 result, the first term ``q ** -x`` rounded to
    float32 before the sum, as ATen's kernel computes it (``std::pow`` of its two float
    arguments, acc_type double for the rest): otherwise about one float32 result in ten
    differs from CPU's by one ulp."""
    x, q = jnp.broadcast_arrays(x, q)
    inf, nan = const_like(np.inf, x), const_like(np.nan, x)
    q_pole = (q <= 0) & (q == jnp.floor(q))
    x_int = x == jnp.floor(x)
    # jax's zeta is for q > 0. For q < 0 (not an integer) and integer x, ATen's direct sum
    # over (q + k)**-x still converges: take its first terms until q + k > 0, then jax.
    shift = (q < 0) & ~q_pole & x_int & (x > 1) & (q > -1e4)
    acc, start = jnp.zeros_like(x), q
    if float32_first:
        head = (q > 0) | shift
        first = jnp.power(jnp.where(head, q, 1), -x)
        # A float32 subnormal would be flushed to zero by XLA: kept in float64 there.
        rounded = first.astype(jnp.float32).astype(x.dtype)
        first = jnp.where(jnp.abs(first) >= np.finfo(np.float32).tiny, rounded, first)
        acc, start = jnp.where(head, first, acc), jnp.where(head, q + 1, q)

    def body(s):
        qq, acc = s
        move = shift & (qq <= 0)
        acc = jnp.where(move, acc + jnp.power(jnp.where(move, qq, 1), -x), acc)
        return jnp.where(move, qq + 1, qq), acc

    qs, acc = lax.while_loop(lambda s: jnp.any(shift & (s[0] <= 0)), body, (start, acc))
    safe_x = jnp.where(x > 1, x, const_like(2.0, x))
    safe_q = jnp.where(qs > 0, qs, const_like(1.0, x))
    val = jax.scipy.special.zeta(safe_x, safe_q) + acc
    return select_first(
        x == 1, inf, x < 1, nan, q_pole, inf, (q <= 0) & ~x_int, nan, jnp.isnan(q), nan, val
    )


@functools.partial(jax.jit, static_argnames="lower")
def _igamma(a, x, lower):
    """P(a, x) (``lower``) or Q(a, x) with ATen's boundary values (calc_igamma /
    calc_igammac, following SciPy)."""
    # XLA's float32 series lose up to 3e-5 (relative) for large, close a and x, where
    # ATen's float32 Cephes stays within 1e-6: float32 is evaluated in float64.
    wide = a.dtype == jnp.float32
    va, vx = (a.astype(jnp.float64), x.astype(jnp.float64)) if wide else (a, x)
    value = lax.igamma(va, vx) if lower else lax.igammac(va, vx)
    value = value.astype(a.dtype)
    zero, one, nan = jnp.zeros_like(value), jnp.ones_like(value), const_like(np.nan, value)
    at_a0, at_x0, at_a_inf, at_x_inf = (one, zero, zero, one) if lower else (zero, one, one, zero)
    return select_first(
        (x < 0) | (a < 0),
        nan,
        a == 0,
        jnp.where(x > 0, at_a0, nan),
        x == 0,
        at_x0,
        jnp.isinf(a),
        jnp.where(jnp.isinf(x), nan, at_a_inf),
        jnp.isinf(x),
        at_x_inf,
        value,
    )


# ---------------------------------------------------------------------------------------
# lowerings


_BUCKET_MIN = 1024


def _elementwise(fn, *arrays):
    """``fn`` (jitted, elementwise) on ``arrays`` broadcast together.

    In eager mode the arrays are flattened and zero-padded to a power-of-two length (at
    least ``_BUCKET_MIN``), so one compiled executable per dtype and size octave serves
    every shape: these functions take about a second each to compile, once per shape
    otherwise. Zero is a cheap input for every function here (no loop runs long on it).
    Under a trace the arrays go through as they are."""
    arrays = jnp.broadcast_arrays(*(jnp.asarray(a) for a in arrays))
    if any(isinstance(a, jax.core.Tracer) for a in arrays):
        return fn(*arrays)
    shape = arrays[0].shape
    n = arrays[0].size
    size = max(_BUCKET_MIN, 1 << max(n - 1, 0).bit_length())
    flat = [jnp.pad(a.reshape(-1), (0, size - n)) for a in arrays]
    return fn(*flat)[:n].reshape(shape)


def _register(packet, fn, doc):
    """One lowering of ``packet`` (all overloads) evaluating ``fn`` elementwise.

    ``jit=False``: the registry would compile the call once per shape; ``_elementwise``
    runs ``fn`` compiled once per size octave instead."""

    def lower(*args):
        return _elementwise(fn, *args)

    lower.__name__ = lower.__qualname__ = packet._qualified_op_name.split("::")[1]
    lower.__doc__ = doc
    lowering(packet, promote=Kind.INT_TO_FLOAT, jit=False)(lower)


_UNARY_DOC = """aten::{name} - {what}, elementwise.

    Dtypes: INT_TO_FLOAT (ints, bool -> default float). {edges}
    Reference: torch.special.{short}; ATen {short}_forward (Cephes), ported in jnp."""

for _name, _fn, _what, _edges in [
    ("airy_ai", _airy_ai, "Airy function Ai(x)", "NaN at +-inf, 0 above 103.892."),
    ("bessel_j0", _bessel_j0, "Bessel function of the first kind J0", ""),
    ("bessel_j1", _bessel_j1, "Bessel function of the first kind J1 (odd)", ""),
    ("bessel_y0", _bessel_y0, "Bessel function of the second kind Y0", "-inf at 0, NaN < 0."),
    ("bessel_y1", _bessel_y1, "Bessel function of the second kind Y1", "-inf at 0, NaN < 0."),
    ("modified_bessel_i0", functools.partial(_bessel_i, order=0), "modified Bessel I0", ""),
    ("modified_bessel_i1", functools.partial(_bessel_i, order=1), "modified Bessel I1", ""),
    (
        "modified_bessel_k0",
        functools.partial(_bessel_k, order=0, scaled=False),
        "modified Bessel function of the second kind K0",
        "+inf at 0, NaN < 0.",
    ),
    (
        "modified_bessel_k1",
        functools.partial(_bessel_k, order=1, scaled=False),
        "modified Bessel function of the second kind K1",
        "+inf at 0, NaN < 0.",
    ),
    (
        "scaled_modified_bessel_k0",
        functools.partial(_bessel_k, order=0, scaled=True),
        "exp(x) * K0(x) without overflow",
        "+inf at 0, NaN < 0.",
    ),
    (
        "scaled_modified_bessel_k1",
        functools.partial(_bessel_k, order=1, scaled=True),
        "exp(x) * K1(x) without overflow",
        "+inf at 0, NaN < 0.",
    ),
    (
        "spherical_bessel_j0",
        _spherical_bessel_j0,
        "spherical Bessel j0 = sin(x) / x",
        "1 at 0 (Taylor polynomial for |x| < 0.5), 0 at +-inf.",
    ),
]:
    _register(
        getattr(aten, f"special_{_name}"),
        _fn,
        _UNARY_DOC.format(name=f"special_{_name}", what=_what, edges=_edges, short=_name),
    )

_POLY_DOC = """aten::{name} - {what} of degree ``n`` at ``x``, elementwise.

    Shapes: x, n broadcast (either may be a Scalar overload). Dtypes: INT_TO_FLOAT; n is
    truncated to an integer as ATen does (NaN/inf/negative degrees give 0). ATen's special
    values and recurrence; see the module docstring for the loop. Reference: torch.special."""

for _kind in "tuvw":
    for _shifted in (False, True):
        _name = f"special_{'shifted_' if _shifted else ''}chebyshev_polynomial_{_kind}"
        _register(
            getattr(aten, _name),
            functools.partial(chebyshev, kind=_kind, shifted=_shifted),
            _POLY_DOC.format(
                name=_name,
                what=f"{'shifted ' if _shifted else ''}Chebyshev polynomial {_kind.upper()}",
            ),
        )
for _name, _fn, _what in [
    ("special_hermite_polynomial_h", functools.partial(hermite, physicists=True), "Hermite H"),
    ("special_hermite_polynomial_he", functools.partial(hermite, physicists=False), "Hermite He"),
    ("special_laguerre_polynomial_l", laguerre, "Laguerre L"),
    ("special_legendre_polynomial_p", legendre, "Legendre P"),
]:
    _register(getattr(aten, _name), _fn, _POLY_DOC.format(name=_name, what=f"{_what} polynomial"))


@lowering(aten.special_zeta, promote=Kind.INT_TO_FLOAT, jit=False)
def special_zeta(self, other):
    """aten::special_zeta - Hurwitz zeta ``sum_k (other + k) ** -self``, elementwise.

    Shapes: broadcast (Scalar overloads too). Dtypes: INT_TO_FLOAT, summed in float64 as
    ATen's CPU kernel does (``acc_type``), cast back; for float32 the first term is
    rounded to float32 first, as ATen computes it (``_zeta``). Edges as ATen: +inf at self == 1 and
    at non-positive integer ``other``; NaN for self < 1 and for other <= 0 with a
    non-integer self. Reference: torch.special.zeta; Cephes zeta."""
    dtype = jnp.result_type(self, other)
    x, q = jnp.asarray(self, jnp.float64), jnp.asarray(other, jnp.float64)
    fn = functools.partial(_zeta, float32_first=dtype == jnp.float32)
    return _elementwise(fn, x, q).astype(dtype)


@lowering(aten.igamma, promote=Kind.INT_TO_FLOAT, jit=False)
def igamma(self, other):
    """aten::igamma - regularized lower incomplete gamma P(self, other), elementwise.

    Dtypes: INT_TO_FLOAT, f16/bf16 in float32. Boundary values as ATen (NaN for negative
    arguments, P(0, x > 0) = 1, P(inf, finite) = 0). Reference: torch.igamma; lax.igamma."""
    return _elementwise(functools.partial(_igamma, lower=True), self, other)


@lowering(aten.igammac, promote=Kind.INT_TO_FLOAT, jit=False)
def igammac(self, other):
    """aten::igammac - regularized upper incomplete gamma Q(self, other) = 1 - P.

    Dtypes: INT_TO_FLOAT, f16/bf16 in float32. Boundary values as ATen.
    Reference: torch.igammac; lax.igammac."""
    return _elementwise(functools.partial(_igamma, lower=False), self, other)


_J0_ASYMPTOTIC = (
    _tab.BESSEL_J0_PP,
    _tab.BESSEL_J0_PQ,
    _tab.BESSEL_J0_QP,
    _tab.BESSEL_J0_QQ,
    _PI_4,
    False,
)
_J1_ASYMPTOTIC = (
    _tab.BESSEL_J1_PP,
    _tab.BESSEL_J1_PQ,
    _tab.BESSEL_J1_QP,
    _tab.BESSEL_J1_QQ,
    _3PI_4,
    True,
)
