"""Samplers behind torch.distributions: gamma, Dirichlet, Poisson, binomial.

``torch.distributions`` draws Gamma, Beta, Dirichlet, Chi2, StudentT, Poisson, Binomial
and LKJCholesky samples through these ATen ops, and reparameterizes Gamma (and through
it Chi2 and StudentT) with ``_standard_gamma_grad``. Each is jax.random's sampler with
a key of the device's stream (as every random op here), computed in float32 for
float16 and bfloat16 as CUDA's kernels do (CPU has no half kernels for most of them;
tpu answers as CUDA does). Integer inputs are refused with torch's message. Values
follow jax's algorithms, not torch's: the same distribution, other numbers; a CPU
``generator=`` draws on CPU, CPU's numbers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torchjax.device import _checks
from torchjax.ops.random import _key, _opmath
from torchjax.ops.registry import lowering
from torchjax.tensor.dtypes import aten_type_name

aten = torch.ops.aten


def _floating(kernel: str, *xs) -> None:
    for x in xs:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise NotImplementedError(
                f"\"{kernel}\" not implemented for '{aten_type_name(x.dtype)}'"
            )


def _gamma(key, alpha):
    # torch's gamma kernels give at least the smallest normal number: for a sample that
    # underflows, and for an alpha <= 0 or NaN (jax: 0 or NaN there); infinity for an
    # infinite alpha.
    ct = _opmath(alpha.dtype)
    alpha = alpha.astype(ct)
    draw = jax.random.gamma(key, alpha, alpha.shape, dtype=ct)
    draw = jnp.where(draw > jnp.finfo(ct).tiny, draw, jnp.finfo(ct).tiny)
    return jnp.where(alpha == jnp.inf, alpha, draw)


@lowering(aten._standard_gamma.default, cpu_generator=True)
def standard_gamma(self, generator=None):
    """aten::_standard_gamma - Gamma(self, 1) samples, ``self``'s shape and dtype."""
    _floating("gamma", self)
    return _gamma(_key(self), self).astype(self.dtype)


@lowering(aten._standard_gamma_grad.default)
def standard_gamma_grad(self, output):
    """aten::_standard_gamma_grad - d sample / d alpha at a Gamma(self, 1) sample
    ``output``, by implicit differentiation of its CDF (``lax.random_gamma_grad``),
    computed in float64: within 1e-9 of the exact derivative, where torch's own
    approximation is within 1e-3 of it (and jax's in float32 within 2e-2, far in the
    lower tail of a large alpha)."""
    _floating("_standard_gamma_grad", self, output)
    f64 = jnp.float64
    return lax.random_gamma_grad(self.astype(f64), output.astype(f64)).astype(self.dtype)


@lowering(aten._sample_dirichlet.default, cpu_generator=True)
def sample_dirichlet(self, generator=None):
    """aten::_sample_dirichlet - Dirichlet(self) samples over the last dimension: gamma
    draws normalised by their sum, as torch computes them."""
    _floating("dirichlet", self)
    if self.size == 0:
        return self
    gammas = _gamma(_key(self), self)
    return (gammas / jnp.sum(gammas, axis=-1, keepdims=True)).astype(self.dtype)


@lowering(aten.poisson.default, cpu_generator=True)
def poisson(self, generator=None):
    """aten::poisson - Poisson(self) counts, in ``self``'s (floating) dtype."""
    _floating("poisson_cpu", self)
    if self.size:
        # On the device, raised at the next sync (Note [Device-side checks]).
        bad = ~(self >= 0).reshape(-1)  # negative or NaN
        _checks.require(
            jnp.any(bad),
            self.reshape(-1)[jnp.argmax(bad)],
            RuntimeError,
            "invalid Poisson rate, expected rate to be non-negative "
            "(in aten::poisson: got rate {value})",
        )
    ct = _opmath(self.dtype)
    counts = jax.random.poisson(_key(self), self.astype(ct), self.shape)
    return counts.astype(self.dtype)


@lowering(aten.binomial.default, cpu_generator=True)
def binomial(count, prob, generator=None):
    """aten::binomial - Binomial(count, prob) counts, in ``count``'s dtype."""
    _floating("binomial_cpu", count, prob)
    ct = _opmath(count.dtype)
    shape = jnp.broadcast_shapes(count.shape, prob.shape)
    # torch clamps the probability into [0, 1] (prob 1.5 draws every trial).
    p = jnp.clip(prob.astype(ct), 0, 1)
    draws = jax.random.binomial(_key(count), count.astype(ct), p, shape, dtype=ct)
    return draws.astype(count.dtype)
