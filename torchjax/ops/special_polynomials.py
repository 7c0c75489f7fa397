"""The orthogonal polynomials of a tensor degree ``n`` (Chebyshev T/U/V/W and their
shifted forms, Hermite, Laguerre, Legendre), by ATen's three-term recurrences; their
lowerings and the numerics they share with the other special functions are in
special.py's docstring."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def const_like(v, like):
    """``v`` as a 0-d array of ``like``'s dtype (keeps float32 math in float32)."""
    return np.asarray(v, dtype=like.dtype)


def select_first(*pairs_and_default):
    """``select_first(c1, v1, c2, v2, ..., default)``: the first true condition wins."""
    *pairs, out = pairs_and_default
    for cond, val in reversed(list(zip(pairs[::2], pairs[1::2]))):
        out = jnp.where(cond, val, out)
    return out


# ---------------------------------------------------------------------------------------
# Orthogonal polynomials of a tensor degree n


def _degree(n):
    """ATen's ``static_cast<int64_t>(n)``: truncation; NaN, +-inf and out-of-range values
    give INT64_MIN on x86 (a negative degree, so the polynomial is 0)."""
    if not jnp.issubdtype(n.dtype, jnp.floating):
        return n.astype(jnp.int64)
    ok = jnp.isfinite(n) & (jnp.abs(n) < 2.0**63)
    return jnp.where(ok, jnp.where(ok, n, 0).astype(jnp.int64), np.int64(-(2**63)))


def _recurrence(x, n, p, q, step, stop_at_nan=True):
    """P_n(x) from P_0 = p, P_1 = q and P_k = step(k, x, P_{k-2}, P_{k-1}), k = 2..n.

    Each element stops at its own n (and, as in ATen, once P_{k-1} is NaN)."""

    def alive(k, q):
        live = k <= n
        return live & ~jnp.isnan(q) if stop_at_nan else live

    def body(s):
        k, p, q = s
        go = alive(k, q)
        r = step(k.astype(x.dtype), x, p, q)
        return k + 1, jnp.where(go, q, p), jnp.where(go, r, q)

    k0 = jnp.asarray(2, dtype=jnp.int64)
    _, _, q = lax.while_loop(lambda s: jnp.any(alive(s[0], s[2])), body, (k0, p, q))
    return q


def _cheb_step(k, y, p, q):
    return (y + y) * q - p


@functools.partial(jax.jit, static_argnames=("kind", "shifted"))
def chebyshev(x, n, kind, shifted):
    """Chebyshev T/U/V/W_n(x) (``shifted``: of 2x - 1), ATen's branch order."""
    x, n = jnp.broadcast_arrays(x, n)
    n = _degree(n)
    one = const_like(1.0, x)
    y = x + x - one if shifted else x
    if shifted:
        at_pos, at_neg = x == 1, x == 0
    else:
        at_pos, at_neg = (jnp.abs(x) == 1) & (x > 0), (jnp.abs(x) == 1) & (x < 0)
    even = n % 2 == 0
    nf = n.astype(x.dtype)
    two_n1 = (n + n + 1).astype(x.dtype)
    sign = jnp.where(even, one, -one)
    # degree above which ATen switches to the trigonometric form inside (-1, 1)
    trig_from = {"t": 6, "u": 6 if shifted else 8, "v": 6 if shifted else 8}.get(
        kind, 4 if shifted else 8
    )
    inside = (n > trig_from) & (jnp.abs(y) < 1)
    theta = jnp.arccos(jnp.where(inside, y, jnp.zeros_like(y)))
    if kind == "t":
        edge_pos, edge_neg = one, sign
        trig = jnp.cos(nf * theta)
        first = y
    elif kind == "u":
        edge_pos, edge_neg = nf + one, sign * (nf + one)
        s = jnp.sin(theta)
        safe_s = jnp.where(s != 0, s, one)
        trig = jnp.where(
            s != 0,
            jnp.sin((nf + one) * theta) / safe_s,
            (nf + one) * jnp.cos((nf + one) * theta) / y,
        )
        first = y + y
    elif kind == "v":
        edge_pos, edge_neg = one, sign * two_n1
        half = jnp.sin(theta / const_like(2.0, x))
        trig = jnp.where(
            half != 1,
            jnp.cos((nf + const_like(0.5, x)) * theta) / jnp.cos(theta / const_like(2.0, x)),
            sign * two_n1,
        )
        first = y + y - one
    else:  # "w"
        edge_pos, edge_neg = two_n1, sign
        half = jnp.cos(theta / const_like(2.0, x))
        trig = jnp.where(
            half != 1,
            jnp.sin((nf + const_like(0.5, x)) * theta) / jnp.sin(theta / const_like(2.0, x)),
            sign if shifted else jnp.where(y > 0, two_n1, sign),
        )
        first = y + y + one
    rec = _recurrence(
        y, jnp.where(at_pos | at_neg | inside, 0, n), jnp.ones_like(x), first, _cheb_step
    )
    return select_first(
        n < 0,
        jnp.zeros_like(x),
        at_pos,
        edge_pos * jnp.ones_like(x),
        at_neg,
        edge_neg * jnp.ones_like(x),
        inside,
        trig,
        n == 0,
        jnp.ones_like(x),
        rec,
    )


# ATen returns NaN above these degrees (getHermitianLimit in Math.h).
_HERMITE_LIMIT = {np.dtype(np.float32): 128, np.dtype(np.float64): 512}


@functools.partial(jax.jit, static_argnames="physicists")
def hermite(x, n, physicists):
    x, n = jnp.broadcast_arrays(x, n)
    n = _degree(n)
    limit = _HERMITE_LIMIT.get(np.dtype(x.dtype), 1024)
    if physicists:  # H_k = 2x H_{k-1} - 2(k-1) H_{k-2}
        first = x + x
        step = lambda k, x, p, q: (x + x) * q - (k + k - 2) * p  # noqa: E731
    else:  # He_k = x He_{k-1} - (k-1) He_{k-2}
        first = x
        step = lambda k, x, p, q: x * q - (k - 1) * p  # noqa: E731
    rec = _recurrence(x, jnp.where(n > limit, 0, n), jnp.ones_like(x), first, step, False)
    return select_first(
        n < 0, jnp.zeros_like(x), n == 0, jnp.ones_like(x), n > limit, const_like(np.nan, x), rec
    )


@jax.jit
def laguerre(x, n):
    x, n = jnp.broadcast_arrays(x, n)
    n = _degree(n)
    one = const_like(1.0, x)

    def step(k, x, p, q):  # (k-1) in ATen's loop variable: L_k from L_{k-1}, L_{k-2}
        j = k - one
        return (((j + j) + (one - x)) * q - j * p) / (j + one)

    rec = _recurrence(x, jnp.where(x == 0, 0, n), jnp.ones_like(x), one - x, step)
    return select_first(
        n < 0, jnp.zeros_like(x), x == 0, jnp.ones_like(x), n == 0, jnp.ones_like(x), rec
    )


@jax.jit
def legendre(x, n):
    x, n = jnp.broadcast_arrays(x, n)
    n = _degree(n)
    one = const_like(1.0, x)

    def step(k, x, p, q):
        j = k - one
        return ((j + j + one) * x * q - j * p) / (j + one)

    edge = jnp.abs(x) == 1
    rec = _recurrence(x, jnp.where(edge, 0, n), jnp.ones_like(x), x, step)
    parity = jnp.where((x > 0) | (n % 2 == 0), one, -one)
    return select_first(n < 0, jnp.zeros_like(x), edge, parity, n == 0, jnp.ones_like(x), rec)
