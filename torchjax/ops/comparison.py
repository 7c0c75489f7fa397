"""Whole-tensor comparisons: ``equal``, ``isclose``, ``allclose``.

``equal`` and ``allclose`` return a Python ``bool``, not a tensor: the registry passes a
non-array result through unwrapped, so they are ordinary lowerings that end in one
device-to-host read (as torch's own CUDA kernels do with ``.item()``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from torchjax.ops.registry import Kind, lowering
from torchjax.tensor import dtypes

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
