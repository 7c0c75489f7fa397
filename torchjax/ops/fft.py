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

``istft`` runs torch's composite with its window (NOLA) check made on the device under
a trace (Note [istft's window check under a trace]).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch

from torchjax._compat.torch import TorchDispatchMode, call_composite_implicit
from torchjax.device import _checks
from torchjax.ops.registry import handler, lowering
from torchjax.tensor import _fake
from torchjax.tensor._tensor import JaxTensor
from torchjax.tensor.dtypes import aten_type_name

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


# Note [istft's window check under a trace]
# torch's istft (CompositeImplicitAutograd, ATen SpectralOps.cpp) checks the NOLA
# condition with ``at::is_scalar_tensor_true(window_envelop.abs().min().lt(1e-11))``:
# an ``aten::equal`` of that 0-d flag with a tensor of ones, read on the host. Eager reads
# it as CUDA does; under torchjax.jit and torch.compile(backend="tpu") the flag is a
# tracer and the read failed the trace. (torch's own compiled path, the Python-dispatcher
# decomposition in torch/_refs, drops the check.) So istft has a kernel at
# AutogradPrivateUse1 that runs torch's composite itself (its ops, values, argument checks
# and texts, autograd recorded as before) under a dispatch mode that answers that one
# ``equal`` of a traced flag with False and makes the check a device-side check at the op
# (``require(..., deferred=False)``, Note [Device-side checks] in device/_checks.py): the
# compiled call raises eager's RuntimeError, word for word, when it returns. An untraced
# flag is read as before.


def _istft_text(
    self,
    n_fft,
    hop_length,
    win_length,
    window,
    center,
    normalized,
    onesided,
    length,
    return_complex,
) -> str:
    """The text of ATen's NOLA failure for a tpu call (its REPR of the arguments)."""

    def typed(t):
        return f"{t.device.type}{aten_type_name(t.dtype)}Type"

    def opt(v):
        return "None" if v is None else str(int(v))

    win = "None" if window is None else f"{typed(window)}{{{list(window.shape)}}}"
    return (
        f"istft({typed(self)}{list(self.shape)}, n_fft={n_fft}, hop_length={hop_length}, "
        f"win_length={win_length}, window={win}, center={int(center)}, "
        f"normalized={int(normalized)}, onesided={opt(onesided)}, length={opt(length)}, "
        f"return_complex={int(return_complex)}) window overlap add min: 1\n"
        f"[ {self.device.type}BoolType{{}} ]"
    )


class _TracedNolaCheck(TorchDispatchMode):
    """Turns istft's host read of a traced NOLA flag into a check at the op."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flag = args[0] if args else None
        if (
            func is aten.equal.default
            and isinstance(flag, JaxTensor)
            and flag.dtype == torch.bool
            and flag.dim() == 0
            and isinstance(flag.jax(), jax.core.Tracer)
        ):
            template = self.text.replace("{", "{{").replace("}", "}}")
            _checks.require(flag.jax(), 1, RuntimeError, template, deferred=False)
            return False
        return func(*args, **kwargs)


def _istft_autograd(
    self,
    n_fft,
    hop_length=None,
    win_length=None,
    window=None,
    center=True,
    normalized=False,
    onesided=None,
    length=None,
    return_complex=False,
):
    """aten::istft - torch's composite, its NOLA check made on the device under a trace
    (Note [istft's window check under a trace])."""
    args = (self, n_fft, hop_length, win_length, window, center, normalized, onesided, length)
    if not isinstance(self, JaxTensor) or _fake.is_fake(self):
        # Fake tensors (Dynamo's tracing): torch's Python decomposition, as before.
        return aten.istft.default.decompose(*args, return_complex)
    hop = n_fft // 4 if hop_length is None else hop_length
    win = n_fft if win_length is None else win_length
    text = _istft_text(
        self, n_fft, hop, win, window, center, normalized, onesided, length, return_complex
    )
    with _TracedNolaCheck(text):
        return call_composite_implicit(aten.istft.default, *args, return_complex)


_ISTFT_LIB = torch.library.Library("aten", "IMPL", "AutogradPrivateUse1")
_ISTFT_LIB.impl("istft", _istft_autograd)


@handler(aten.istft.default)
def _istft(args, kwargs):
    # Under torch.inference_mode the Autograd keys are skipped and the op reaches
    # __torch_dispatch__ whole: the same kernel.
    return _istft_autograd(*args, **kwargs)
