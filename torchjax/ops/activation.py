"""Activation functions and the backward ops autograd emits for them.

Forward ops follow torch's CPU formulas (``aten/src/ATen/native/cpu/Activation.cpp``);
each ``*_backward`` is the closed-form gradient torch's derivatives.yaml names, so
``loss.backward()`` on tpu never falls back to a decomposition. All compute in opmath
(f16/bf16 -> f32) via DEFAULT promotion over the tensor arguments only (the Scalar
parameters, e.g. ``negative_slope``, do not take part in promotion).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.ops import complex_math
from torchjax.ops.comparison import at_least, at_most
from torchjax.ops.registry import Kind, handler, lowering
from torchjax.tensor.dtypes import aten_type_name

aten = torch.ops.aten

_SELF = ("self",)
_GRAD_SELF = ("grad_output", "self")


def _c(value, x):
    """A Python scalar as a 0-d array of ``x``'s dtype (x64 is on: no silent f64)."""
    return np.asarray(value, dtype=x.dtype)


def _zero(x):
    return jnp.zeros((), dtype=x.dtype)


@lowering(aten.relu, promote=Kind.DEFAULT)
def relu(self):
    """aten::relu - ``max(self, 0)`` as ATen's ``clamp_min(self, 0)``: NaN propagates,
    -0.0 stays -0.0; bool raises as in torch."""
    if self.dtype == jnp.bool_:
        raise RuntimeError("aten::relu: Boolean inputs not supported for relu")
    return at_least(self, _zero(self))


@lowering(aten.threshold, promote=Kind.DEFAULT, promote_args=_SELF)
def threshold(self, threshold, value):
    """aten::threshold - ``value`` where ``self <= threshold``, else ``self``."""
    return jnp.where(self <= _c(threshold, self), _c(value, self), self)


@lowering(aten.threshold_backward, promote=Kind.DEFAULT, promote_args=_GRAD_SELF)
def threshold_backward(grad_output, self, threshold):
    """aten::threshold_backward - ``grad_output`` where ``self > threshold``, else 0
    (relu's backward, with self = the relu output and threshold 0)."""
    g, x = jnp.broadcast_arrays(grad_output, self)
    return jnp.where(x <= _c(threshold, x), _zero(g), g)


@lowering(aten.gelu, promote=Kind.DEFAULT, promote_args=_SELF)
def gelu(self, *, approximate="none"):
    """aten::gelu - ``x * Phi(x)`` (erf form) or the tanh approximation, as torch's."""
    if approximate not in ("none", "tanh"):
        raise RuntimeError("approximate argument must be either none or tanh. (in aten::gelu)")
    return jax.nn.gelu(self, approximate=approximate == "tanh")


@lowering(aten.gelu_backward, promote=Kind.DEFAULT, promote_args=_GRAD_SELF)
def gelu_backward(grad_output, self, *, approximate="none"):
    """aten::gelu_backward - d gelu / dx times grad_output (torch's GeluBackward formulas)."""
    x = self
    if approximate == "tanh":
        beta = _c(math.sqrt(2.0) * 2.0 / math.sqrt(math.pi) * 0.5, x)
        kappa = _c(0.044715, x)
        x_sq = x * x
        t = lax.tanh(beta * (x + kappa * x_sq * x))
        left_d = _c(0.5, x) * (1 + t)
        right_d = _c(0.5, x) * x * (1 - t * t) * beta * (1 + _c(3.0, x) * kappa * x_sq)
        return grad_output * (left_d + right_d)
    cdf = _c(0.5, x) * (1 + lax.erf(x * _c(math.sqrt(0.5), x)))
    pdf = lax.exp(_c(-0.5, x) * x * x) * _c(1 / math.sqrt(2 * math.pi), x)
    return grad_output * (cdf + x * pdf)


@lowering(aten.silu, promote=Kind.DEFAULT)
def silu(self):
    """aten::silu - ``self * sigmoid(self)``; complex as CPU's kernel, ``self / (1 +
    exp(-self))`` (Note [Complex special values])."""
    if jnp.iscomplexobj(self):
        return complex_math.silu(self)
    return self * lax.logistic(self)


@lowering(aten.silu_backward, promote=Kind.DEFAULT, promote_args=_GRAD_SELF)
def silu_backward(grad_output, self):
    """aten::silu_backward - ``g * s * (1 + x * (1 - s))`` with s = sigmoid(x)."""
    s = lax.logistic(self)
    return grad_output * s * (1 + self * (1 - s))


@lowering(aten.mish, promote=Kind.DEFAULT)
def mish(self):
    """aten::mish - ``self * tanh(softplus(self))``."""
    return self * lax.tanh(jax.nn.softplus(self))


@lowering(aten.mish_backward, promote=Kind.DEFAULT, promote_args=_GRAD_SELF)
def mish_backward(grad_output, self):
    """aten::mish_backward - ``g * (tanh(sp) + x * sigmoid(x) * (1 - tanh(sp)**2))``."""
    t = lax.tanh(jax.nn.softplus(self))
    return grad_output * (t + self * lax.logistic(self) * (1 - t * t))


@lowering(aten.sigmoid_backward, promote=Kind.DEFAULT, promote_args=("grad_output", "output"))
def sigmoid_backward(grad_output, output):
    """aten::sigmoid_backward - ``g * (1 - y) * y`` from the output y (conj for complex)."""
    y = jnp.conj(output)
    return grad_output * (1 - y) * y


@lowering(aten.tanh_backward, promote=Kind.DEFAULT, promote_args=("grad_output", "output"))
def tanh_backward(grad_output, output):
    """aten::tanh_backward - ``g * (1 - y**2)`` from the output y (conj for complex)."""
    y = jnp.conj(output)
    return grad_output * (1 - y * y)


@lowering(aten.elu, promote=Kind.DEFAULT, promote_args=_SELF)
def elu(self, alpha=1, scale=1, input_scale=1):
    """aten::elu - ``scale * x`` for x > 0, ``alpha * scale * (exp(x * input_scale) - 1)``
    otherwise (also serves selu and celu, which torch composes from it)."""
    neg = lax.expm1(self * _c(input_scale, self)) * _c(alpha * scale, self)
    return jnp.where(self <= _zero(self), neg, self * _c(scale, self))


@lowering(aten.elu_backward, promote=Kind.DEFAULT, promote_args=("grad_output", "self_or_result"))
def elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    """aten::elu_backward - from the input, or from the result when ``is_result``."""
    x = self_or_result
    negcoef, negiptcoef = _c(alpha * scale, x), _c(input_scale, x)
    if is_result:
        neg = grad_output * negiptcoef * (x + negcoef)
    else:
        neg = grad_output * negiptcoef * negcoef * lax.exp(x * negiptcoef)
    return jnp.where(x <= _zero(x), neg, grad_output * _c(scale, x))


@lowering(aten.leaky_relu, promote=Kind.DEFAULT, promote_args=_SELF)
def leaky_relu(self, negative_slope=0.01):
    """aten::leaky_relu - ``x`` for x > 0, else ``x * negative_slope``; floating types
    only, as CPU's kernel."""
    if not jnp.issubdtype(self.dtype, jnp.inexact):
        raise NotImplementedError(
            f"\"leaky_relu\" not implemented for '{aten_type_name(self.dtype)}'"
        )
    return jnp.where(self > _zero(self), self, self * _c(negative_slope, self))


@lowering(aten.leaky_relu_backward, promote=Kind.DEFAULT, promote_args=_GRAD_SELF)
def leaky_relu_backward(grad_output, self, negative_slope, self_is_result):
    """aten::leaky_relu_backward - ``g`` where self > 0, else ``g * negative_slope``."""
    g, x = jnp.broadcast_arrays(grad_output, self)
    return jnp.where(x > _zero(x), g, g * _c(negative_slope, g))


@lowering(
    aten.hardtanh,
    promote=Kind.DEFAULT,
    promote_args=_SELF,
    checked_scalars=("min_val", "max_val"),
)
def hardtanh(self, min_val=-1, max_val=1):
    """aten::hardtanh - clamp to [min_val, max_val] (relu6 composes from it), ``self``
    kept where it equals a bound, as CPU (the sign of a zero)."""
    if self.dtype == jnp.bool_:
        raise RuntimeError("aten::hardtanh: Bool inputs not supported for hardtanh")
    return at_most(at_least(self, _c(min_val, self)), _c(max_val, self))


@lowering(aten.hardtanh_backward, promote=Kind.DEFAULT, promote_args=_GRAD_SELF)
def hardtanh_backward(grad_output, self, min_val, max_val):
    """aten::hardtanh_backward - ``g`` strictly inside (min_val, max_val), else 0."""
    g, x = jnp.broadcast_arrays(grad_output, self)
    outside = (x <= _c(min_val, x)) | (x >= _c(max_val, x))
    return jnp.where(outside, _zero(g), g)


def _relu6(x):
    return lax.min(lax.max(x, jnp.zeros(x.shape, x.dtype)), jnp.full(x.shape, 6, x.dtype))


@lowering(aten.hardsigmoid, promote=Kind.DEFAULT)
def hardsigmoid(self):
    """aten::hardsigmoid - ``relu6(x + 3) / 6``."""
    return _relu6(self + _c(3, self)) / _c(6, self)


@lowering(aten.hardsigmoid_backward, promote=Kind.DEFAULT, promote_args=_GRAD_SELF)
def hardsigmoid_backward(grad_output, self):
    """aten::hardsigmoid_backward - ``g / 6`` for -3 < x < 3, else 0."""
    inside = (self > _c(-3, self)) & (self < _c(3, self))
    return jnp.where(inside, grad_output / _c(6, grad_output), _zero(grad_output))


@lowering(aten.hardswish, promote=Kind.DEFAULT)
def hardswish(self):
    """aten::hardswish - ``x * relu6(x + 3) / 6``."""
    return self * _relu6(self + _c(3, self)) / _c(6, self)


@lowering(aten.hardswish_backward, promote=Kind.DEFAULT, promote_args=_GRAD_SELF)
def hardswish_backward(grad_output, self):
    """aten::hardswish_backward - 0 for x <= -3, ``g * (x / 3 + 0.5)`` below 3, else g
    (torch's CPU kernel takes the outer branches at exactly -3 and 3)."""
    x = self
    mid = grad_output * (x / _c(3, x) + _c(0.5, x))
    return jnp.where(x <= _c(-3, x), _zero(mid), jnp.where(x < _c(3, x), mid, grad_output))


@lowering(aten.softplus, promote=Kind.DEFAULT, promote_args=_SELF)
def softplus(self, beta=1, threshold=20):
    """aten::softplus - ``log1p(exp(beta * x)) / beta``, linear where beta * x > threshold."""
    bx = self * _c(beta, self)
    soft = lax.log1p(lax.exp(bx)) / _c(beta, self)
    return jnp.where(bx > _c(threshold, self), self, soft)


@lowering(aten.softplus_backward, promote=Kind.DEFAULT, promote_args=_GRAD_SELF)
def softplus_backward(grad_output, self, beta, threshold):
    """aten::softplus_backward - ``g * z / (z + 1)`` with z = exp(beta * x); g past threshold."""
    bx = self * _c(beta, self)
    z = lax.exp(bx)
    return jnp.where(bx > _c(threshold, self), grad_output, grad_output * z / (z + 1))


@lowering(aten.log_sigmoid_forward, promote=Kind.DEFAULT)
def log_sigmoid_forward(self):
    """aten::log_sigmoid_forward - ``(log(sigmoid(x)), buffer)``; buffer = exp(-|x|) as on
    CPU (our backward recomputes it from self, so any buffer works)."""
    buffer = lax.exp(-lax.abs(self))
    out = lax.min(self, jnp.zeros(self.shape, self.dtype)) - lax.log1p(buffer)
    return out, buffer


@lowering(aten.log_sigmoid_backward, promote=Kind.DEFAULT, promote_args=_GRAD_SELF)
def log_sigmoid_backward(grad_output, self, buffer):
    """aten::log_sigmoid_backward - ``g * (1 - sigmoid(x))``, written as torch's CPU kernel."""
    z = lax.exp(-lax.abs(self))
    neg = self < _zero(self)
    one = jnp.ones((), self.dtype)
    max_deriv = jnp.where(neg, one, _zero(self))
    sign = jnp.where(neg, one, -one)
    return grad_output * (max_deriv - sign * (z / (one + z)))


def _glu_halves(op, self, dim):
    n = self.shape[dim]
    if n % 2:
        raise RuntimeError(
            f"aten::{op}: Halving dimension must be even, but dimension "
            f"{dim % self.ndim} is size {n}"
        )
    return jnp.split(self, 2, axis=dim)


@lowering(aten.glu, promote=Kind.DEFAULT, promote_args=_SELF)
def glu(self, dim=-1):
    """aten::glu - ``a * sigmoid(b)`` for the two halves of ``self`` along ``dim``."""
    if self.ndim == 0:
        raise RuntimeError(
            "aten::glu: glu does not support scalars because halving size must be even"
        )
    a, b = _glu_halves("glu", self, dim)
    return a * lax.logistic(b)


@lowering(aten.glu_backward, promote=Kind.DEFAULT, promote_args=_GRAD_SELF)
def glu_backward(grad_output, self, dim):
    """aten::glu_backward - gradient w.r.t. both halves, concatenated along ``dim``."""
    a, b = _glu_halves("glu_backward", self, dim)
    s = lax.logistic(b)
    return jnp.concatenate([grad_output * s, grad_output * a * s * (1 - s)], axis=dim)


@lowering(aten.hardshrink, promote=Kind.DEFAULT, promote_args=_SELF)
def hardshrink(self, lambd=0.5):
    """aten::hardshrink - 0 for ``-lambd <= x <= lambd``, else x."""
    return jnp.where(lax.abs(self) <= _c(lambd, self), _zero(self), self)


@lowering(aten.hardshrink_backward, promote=Kind.DEFAULT, promote_args=("grad_out", "self"))
def hardshrink_backward(grad_out, self, lambd):
    """aten::hardshrink_backward - g outside [-lambd, lambd], else 0."""
    return jnp.where(lax.abs(self) <= _c(lambd, self), _zero(grad_out), grad_out)


@lowering(aten.softshrink, promote=Kind.DEFAULT, promote_args=_SELF)
def softshrink(self, lambd=0.5):
    """aten::softshrink - shrink toward 0 by lambd, 0 inside [-lambd, lambd]."""
    if lambd < 0:
        hi = float(jnp.finfo(self.dtype).max) if jnp.issubdtype(self.dtype, jnp.inexact) else 0
        raise RuntimeError(
            f"lambda must be in range [0, {hi:g}] for input dtype {self.dtype}, but found "
            f"{lambd} (in aten::softshrink)"
        )
    lam = _c(lambd, self)
    return jnp.where(self > lam, self - lam, jnp.where(self < -lam, self + lam, _zero(self)))


@lowering(aten.softshrink_backward, promote=Kind.DEFAULT, promote_args=("grad_output", "self"))
def softshrink_backward(grad_output, self, lambd):
    """aten::softshrink_backward - g outside [-lambd, lambd], else 0."""
    return jnp.where(lax.abs(self) <= _c(lambd, self), _zero(grad_output), grad_output)


# ---------------------------------------------------------------------------------------
# rrelu


@handler(aten.rrelu_with_noise.default)
def rrelu_with_noise(args, kwargs):
    """aten::rrelu_with_noise - randomized leaky relu; writes the slopes into ``noise``.

    Training: each x <= 0 gets a slope drawn uniformly from [lower, upper) (torchjax's RNG,
    so values differ from CPU torch), stored in ``noise`` (1 where x > 0); eval: a fixed
    slope (lower + upper) / 2. Reference: ATen Activation.cpp (rrelu_with_noise_out_cpu).
    """
    names = ("self", "noise", "lower", "upper", "training", "generator")
    bound = dict(zip(names, args), **kwargs)
    self, noise = bound["self"], bound["noise"]
    if not self.is_floating_point():
        raise NotImplementedError(
            f"\"rrelu_with_noise\" not implemented for '{aten_type_name(self.dtype)}'"
        )
    lower, upper = float(bound.get("lower", 0.125)), float(bound.get("upper", 1.0 / 3.0))
    if bound.get("generator") is not None:
        raise RuntimeError(
            "aten::rrelu_with_noise: generator= is not supported for tpu tensors; seed with "
            "torch.manual_seed"
        )
    if not bound.get("training", False):
        return torch.nn.functional.leaky_relu(self, (lower + upper) / 2)
    slopes = torch.empty_like(self).uniform_(lower, upper)
    r = torch.where(self <= 0, slopes, torch.ones_like(self))
    noise.copy_(r)
    return self * r
