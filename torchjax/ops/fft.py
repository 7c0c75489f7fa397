"""Discrete Fourier transforms: the three ATen primitives every ``torch.fft.*`` function
(and ``stft``/``istft``) reaches, lowered to ``jax.numpy.fft``.

``torch.fft.fft``, ``rfft2``, ``hfftn``, ``fftshift``... are CompositeImplicitAutograd in
torch: they pad/trim the input, conjugate (hermitian forms) and call one of
``_fft_r2c`` (real -> complex), ``_fft_c2r`` (hermitian complex -> real) and ``_fft_c2c``.
Their backward formulas call the same three ops.

Normalization: the primitives take ``normalization`` as ATen's ``fft_norm_mode``
(0: none, 1: 1/sqrt(n), 2: 1/n, n the product of the signal sizes over ``dim``) and it
applies whatever the direction. So every transform here is computed unnormalized (jax's
``norm="backward"`` forward / ``norm="forward"`` inverse) and scaled once afterwards.

More than three axes: XLA's FFT transforms at most three innermost axes at a time, so
longer ``dim`` lists are done in groups of three (the transform is separable).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch

from torchjax.ops.registry import lowering

aten = torch.ops.aten

# ATen's fft_norm_mode
_NORM_NONE, _NORM_ROOT_N, _NORM_N = 0, 1, 2


def _dims(dim, ndim: int) -> list[int]:
    return [d % ndim for d in dim]


def _scale(x: jax.Array, normalization: int, n: int) -> jax.Array:
    if normalization == _NORM_NONE or n == 0:
        return x
    factor = 1.0 / (math.sqrt(n) if normalization == _NORM_ROOT_N else n)
    return x * jnp.asarray(factor, dtype=x.real.dtype)


def _c2c(x: jax.Array, axes: list[int], forward: bool) -> jax.Array:
    """Unnormalized complex transform over ``axes`` (any number of them)."""
    for i in range(0, len(axes), 3):
        group = axes[i : i + 3]
        if forward:
            x = jnp.fft.fftn(x, axes=group, norm="backward")
        else:
            x = jnp.fft.ifftn(x, axes=group, norm="forward")
    return x


@lowering(aten._fft_c2c)
def _fft_c2c(self, dim, normalization, forward):
    """aten::_fft_c2c - complex-to-complex FFT over ``dim`` (forward or inverse).

    Shapes: unchanged. Dtypes: complex64/complex128 in and out.
    Reference: aten/src/ATen/native/SpectralOps.cpp; jnp.fft.fftn."""
    axes = _dims(dim, self.ndim)
    out = _c2c(self, axes, forward)
    return _scale(out, normalization, math.prod(self.shape[d] for d in axes))


@lowering(aten._fft_r2c)
def _fft_r2c(self, dim, normalization, onesided):
    """aten::_fft_r2c - real-to-complex forward FFT over ``dim``.

    Shapes: with ``onesided`` the last dim of ``dim`` becomes n // 2 + 1, else unchanged.
    Dtypes: float32 -> complex64, float64 -> complex128. Reference: torch.fft.rfftn."""
    axes = _dims(dim, self.ndim)
    n = math.prod(self.shape[d] for d in axes)
    if onesided:
        out = jnp.fft.rfft(self, axis=axes[-1], norm="backward")
        out = _c2c(out, axes[:-1], True)
    else:
        out = _c2c(self.astype(jnp.result_type(self.dtype, jnp.complex64)), axes, True)
    return _scale(out, normalization, n)


@lowering(aten._fft_c2r)
def _fft_c2r(self, dim, normalization, last_dim_size):
    """aten::_fft_c2r - inverse FFT of a one-sided hermitian signal, giving real output.

    Shapes: the last dim of ``dim`` becomes ``last_dim_size``. Dtypes: complex64 ->
    float32, complex128 -> float64. Like ATen (pocketfft), the imaginary parts of the
    zero-frequency (and Nyquist) bins are ignored. Reference: torch.fft.irfftn."""
    axes = _dims(dim, self.ndim)
    x = _c2c(self, axes[:-1], False)
    out = jnp.fft.irfft(x, n=last_dim_size, axis=axes[-1], norm="forward")
    n = math.prod(out.shape[d] for d in axes)
    return _scale(out, normalization, n)
