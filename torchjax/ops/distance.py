"""Pairwise distances: ``_cdist_forward`` / ``_cdist_backward`` (what ``torch.cdist`` calls).

``torch.cdist`` is CompositeImplicitAutograd: for p=2 in the matmul modes it calls
``_euclidean_dist`` (torch's decomposition, differentiated by its own formula); otherwise
``_cdist_forward``, whose gradient ATen computes with ``_cdist_backward``. Both are lowered
here with ATen's formulas (ATen/native/Distance.cpp, cpu/DistanceOpsKernel.cpp), including
its zero-distance conventions, so gradients match where ``jax.grad`` of the norm would give
NaN.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.ops.registry import lowering

aten = torch.ops.aten

# torch.cdist's compute_mode: None/0 "use_mm_for_euclid_dist_if_necessary" (more than 25
# rows on either side), 1 "use_mm_for_euclid_dist", 2 "donot_use_mm_for_euclid_dist".
_MM_THRESHOLD = 25


def _check_inputs(op, x1, x2, p):
    torch._check(p >= 0, lambda: f"aten::{op}: cdist only supports non-negative p values, got {p}")
    torch._check(
        x1.ndim >= 2 and x2.ndim >= 2,
        lambda: (
            f"aten::{op}: cdist only supports at least 2D tensors, X1 got: {x1.ndim}D, "
            f"X2 got: {x2.ndim}D"
        ),
    )
    torch._check(
        x1.shape[-1] == x2.shape[-1],
        lambda: (
            f"aten::{op}: X1 and X2 must have the same number of columns. X1: "
            f"{x1.shape[-1]} X2: {x2.shape[-1]}"
        ),
    )
    torch._check(
        jnp.issubdtype(x1.dtype, jnp.floating) and jnp.issubdtype(x2.dtype, jnp.floating),
        lambda: (
            f"aten::{op}: cdist only supports floating-point dtypes, X1 got: {x1.dtype}, "
            f"X2 got: {x2.dtype}"
        ),
    )


def _broadcast_batch(x1, x2):
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    return (
        jnp.broadcast_to(x1, batch + x1.shape[-2:]),
        jnp.broadcast_to(x2, batch + x2.shape[-2:]),
    )


def _euclidean_mm(x1, x2):
    # ATen's _euclidean_dist: ||a||^2 + ||b||^2 - 2 a.b as one matmul, clamped at 0.
    x1_norm = jnp.sum(x1 * x1, axis=-1, keepdims=True)
    x2_norm = jnp.sum(x2 * x2, axis=-1, keepdims=True)
    ones1 = jnp.ones_like(x1_norm)
    ones2 = jnp.ones_like(x2_norm)
    a = jnp.concatenate([-2 * x1, x1_norm, ones1], axis=-1)
    b = jnp.concatenate([x2, ones2, x2_norm], axis=-1)
    sq = jnp.matmul(a, jnp.swapaxes(b, -1, -2), precision=lax.Precision.HIGHEST)
    return jnp.sqrt(jnp.maximum(sq, 0))


def _pnorm_direct(x1, x2, p):
    diff = jnp.abs(x1[..., :, None, :] - x2[..., None, :, :])
    if p == 0:
        return jnp.sum(diff != 0, axis=-1).astype(x1.dtype)
    if p == 1:
        return jnp.sum(diff, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(diff * diff, axis=-1))
    if math.isinf(p):
        return jnp.max(diff, axis=-1, initial=0).astype(x1.dtype)
    return jnp.sum(diff**p, axis=-1) ** (1 / p)


@lowering(aten._cdist_forward)
def _cdist_forward(x1, x2, p, compute_mode=None):
    """aten::_cdist_forward - p-norm distance between each row of ``x1`` and of ``x2``.

    Shapes: x1 (*B1, P, M), x2 (*B2, R, M); batch dims broadcast; result (*B, P, R).
    Dtypes: floating, result in the common dtype (computed as is: no opmath on CPU either).
    p=2 uses ATen's matmul formula when ``compute_mode`` asks for it (or, by default, when
    P or R exceeds 25), else the direct difference. Reference: torch.cdist.
    """
    _check_inputs("_cdist_forward", x1, x2, p)
    torch._check(
        compute_mode in (None, 0, 1, 2),
        lambda: f"aten::_cdist_forward: {compute_mode} is not a valid value for compute_mode",
    )
    dtype = jnp.promote_types(x1.dtype, x2.dtype)
    x1, x2 = _broadcast_batch(x1.astype(dtype), x2.astype(dtype))
    rows1, rows2 = x1.shape[-2], x2.shape[-2]
    if rows1 == 0 or rows2 == 0 or x1.shape[-1] == 0:
        return jnp.zeros(x1.shape[:-1] + (rows2,), dtype=dtype)
    use_mm = compute_mode == 1 or (
        compute_mode in (None, 0) and (rows1 > _MM_THRESHOLD or rows2 > _MM_THRESHOLD)
    )
    if p == 2 and use_mm:
        return _euclidean_mm(x1, x2)
    return _pnorm_direct(x1, x2, p)


@lowering(aten._cdist_backward)
def _cdist_backward(grad, x1, x2, p, cdist):
    """aten::_cdist_backward - gradient of ``_cdist_forward`` w.r.t. ``x1``.

    Shapes: grad, cdist (*B, P, R); result x1's shape (summed over broadcast batch dims).
    Per pair, with d = x1 - x2 and dist = cdist (ATen's conventions at zero distance):
    p=0: 0; p=1: sign(d); p<2: sign(d) |d|^(p-1) / dist^(p-1), 0 where d or dist is 0;
    p=2: d / dist, 0 where dist is 0; inf: sign(d) where |d| == dist; else
    d |d|^(p-2) / dist^(p-1), 0 where dist is 0; each times grad, summed over R.
    Reference: ATen/native/cpu/DistanceOpsKernel.cpp (Dist::run_backward_parallel_cdist).
    """
    dtype = x1.dtype
    b1, b2 = _broadcast_batch(x1, x2)
    diff = b1[..., :, None, :] - b2[..., None, :, :]
    g = grad[..., None]
    dist = cdist[..., None]
    zero = jnp.zeros((), dtype=dtype)
    if p == 0:
        per = jnp.zeros_like(diff)
    elif p == 1:
        per = jnp.sign(diff) * g
    elif p < 2:
        safe = (diff != 0) & (dist != 0)
        per = jnp.where(
            safe,
            jnp.sign(diff) * jnp.abs(diff) ** (p - 1) * g / jnp.where(safe, dist, 1) ** (p - 1),
            zero,
        )
    elif p == 2:
        per = jnp.where(dist == 0, zero, g * diff / jnp.where(dist == 0, 1, dist))
    elif math.isinf(p):
        per = g * jnp.sign(diff) * (jnp.abs(diff) == dist).astype(dtype)
    else:
        nz = dist != 0
        per = jnp.where(
            nz, diff * jnp.abs(diff) ** (p - 2) * g / jnp.where(nz, dist, 1) ** (p - 1), zero
        )
    result = jnp.sum(per, axis=-2).astype(dtype)
    extra = result.ndim - x1.ndim
    if extra or result.shape != x1.shape:
        axes = tuple(range(extra)) + tuple(
            i + extra
            for i, n in enumerate(x1.shape[:-2])
            if n == 1 and result.shape[i + extra] != 1
        )
        result = jnp.sum(result, axis=axes, keepdims=True).reshape(x1.shape)
    return result


# ---------------------------------------------------------------------------------------
# pdist


def _pairs(n):
    i, j = np.triu_indices(n, k=1)
    return jnp.asarray(i), jnp.asarray(j)


def _check_pdist(op, self, p):
    if self.ndim != 2:
        raise RuntimeError(f"{op}: pdist only supports 2D tensors, got: {self.ndim}D")
    if p < 0:
        raise RuntimeError(f"{op}: pdist only supports non-negative p values, got {p}")


@lowering(aten._pdist_forward)
def _pdist_forward(self, p=2.0):
    """aten::_pdist_forward - p-norm distance of every row pair i < j, row-major order.

    Shapes: (N, M) -> (N * (N - 1) / 2,). p = 0 counts differing coordinates, p = inf is
    the max. Dtypes: self's (floating). Reference: ATen Distance.cpp.
    """
    _check_pdist("aten::_pdist_forward", self, p)
    i, j = _pairs(self.shape[0])
    diff = jnp.abs(self[i] - self[j])
    if p == 0:
        return (diff != 0).sum(axis=1).astype(self.dtype)
    if p == float("inf"):
        return diff.max(axis=1, initial=0)
    if p == 1:
        return diff.sum(axis=1)
    if p == 2:
        return jnp.sqrt((diff * diff).sum(axis=1))
    return (diff**p).sum(axis=1) ** (1.0 / p)


@lowering(aten._pdist_backward)
def _pdist_backward(grad, self, p, pdist):
    """aten::_pdist_backward - gradient of _pdist_forward w.r.t. self.

    ATen's formulas, which give 0 where a distance (or, for p < 1, a coordinate
    difference) is 0 instead of the NaN a plain vjp of sqrt/pow would produce.
    """
    _check_pdist("aten::_pdist_backward", self, p)
    i, j = _pairs(self.shape[0])
    diff = self[i] - self[j]
    dist = pdist[:, None]
    zero = jnp.zeros((), self.dtype)
    if p == 0:
        coef = jnp.zeros_like(diff)
    elif p == 1:
        coef = jnp.sign(diff)
    elif p == float("inf"):
        coef = jnp.sign(diff) * (jnp.abs(diff) == dist)
    elif p == 2:
        coef = jnp.where(dist == 0, zero, diff / jnp.where(dist == 0, 1, dist))
    else:
        safe = jnp.where(dist == 0, 1, dist)
        coef = jnp.sign(diff) * jnp.abs(diff) ** (p - 1) / safe ** (p - 1)
        bad = dist == 0
        if p < 1:
            bad = bad | (diff == 0)
        coef = jnp.where(bad, zero, coef)
    contrib = grad[:, None] * coef
    out = jnp.zeros(self.shape, self.dtype)
    return out.at[i].add(contrib).at[j].add(-contrib)
