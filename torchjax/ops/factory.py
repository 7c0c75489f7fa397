"""Factory ops: tensors made from sizes and scalars (arange, linspace, eye, *_like, ...).

``torch.arange(5, device="tpu")`` runs torch's CompositeExplicitAutograd kernel, which
makes the output with ``empty`` (torchjax/device/_factory.py) and then calls the ``out=``
overload (``arange.start_out``) on it; that overload reaches us. Its value depends on the
out tensor's dtype (torch computes the sequence in that dtype), so these are handlers that
read ``out`` rather than lowerings, and write with ``write_into`` (resize allowed).

Lowering them directly matters: torch's decompositions of ``arange``/``linspace``/``eye``
go through ``prims.iota``, whose meta function calls ``torch.empty`` on the output device,
which reaches ``arange`` again (infinite recursion on tpu).

``tril_indices``/``triu_indices`` have no composite kernel in torch, so they are
registered for the PrivateUse1 key like ``empty``; so is ``kaiser_window``, whose
composite kernel cannot run on tpu (Note [kaiser_window on tpu]).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from torchjax._compat.jax import put_host, x64
from torchjax.ops.registry import handler
from torchjax.ops.writeback import write_into
from torchjax.tensor import _errors, dtypes
from torchjax.tensor._memory_format import result_strides
from torchjax.tensor._storage import contiguous_strides
from torchjax.tensor._tensor import wrap

aten = torch.ops.aten

_LIB = None


def _value(x):
    """A Scalar argument as a Python number (0-d tensors arrive for linspace.Tensor_*)."""
    return aten._local_scalar_dense.default(x) if isinstance(x, torch.Tensor) else x


def _write_out(func, out, arr):
    return write_into(func, out, wrap(arr, out._device_index), check_cast=False, resize=True)


def _is_integral(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


# ---------------------------------------------------------------------------------------
# arange


# Note [arange of complex]
# CPU's arange has kernels for the real dtypes only (AT_DISPATCH_ALL_TYPES_AND2(Half,
# BFloat16)): a complex or bool ``dtype`` (or ``out``) is refused with NotImplementedError
# before any bound is read, where jax would count 0, 1, 2 in complex. Complex bounds are
# read as doubles (``Scalar::to<double>``): one with a zero imaginary part is its real
# part (``arange(0j, 5+0j)`` is float32 0..4), any other (NaN included) raises c10's
# conversion error.
def _real_bound(v):
    if not isinstance(v, complex):
        return v
    if v.imag != 0 or math.isnan(v.imag):
        raise RuntimeError("value cannot be converted to type double without overflow")
    return v.real


def arange_values(start, end, step, dtype: torch.dtype) -> np.ndarray:
    """The values of ``torch.arange(start, end, step, dtype=dtype)`` as a NumPy array.

    Follows ATen's CPU kernel (RangeFactories.cpp): bounds are cast to the accumulate
    type first (int64 for integer outputs, truncating; double for float/double, float
    for f16/bf16); int64 outputs size the result in int64 arithmetic (exact past 2**53),
    other outputs as ceil((end - start) / step) in double from the original bounds; the
    values are ``start + i * step`` in the accumulate type, cast to ``dtype``.
    """
    start, end, step = (_real_bound(_value(v)) for v in (start, end, step))
    for v in (start, end):
        if isinstance(v, float) and not math.isfinite(v):
            raise RuntimeError(f"unsupported range: {start} -> {end} (in aten::arange)")
    if _is_integral(dtype):
        xstart, xend, xstep = int(start), int(end), int(step)
        acc = np.int64
    else:
        xstart, xend, xstep = float(start), float(end), float(step)
        acc = np.float32 if dtype in (torch.float16, torch.bfloat16) else np.float64
    # int64 checks the truncated bounds (its size is computed from them); other dtypes
    # check the given ones (arange(0, 1, 0.1, dtype=int32) is ten zeros in torch).
    lo, hi, st = (xstart, xend, xstep) if dtype == torch.int64 else (start, end, step)
    if step == 0:
        raise RuntimeError("step must be nonzero")
    if st == 0:  # int64's step truncated to 0: torch raises ValueError there
        raise _errors.deliberate(ValueError("step must be nonzero"))
    if not ((st > 0 and hi >= lo) or (st < 0 and hi <= lo)):
        raise RuntimeError(
            f"upper bound and lower bound inconsistent with step sign "
            f"(in aten::arange: start={start}, end={end}, step={step})"
        )
    if dtype == torch.int64:
        sgn = (xstep > 0) - (xstep < 0)
        num = xend - xstart + xstep - sgn
        size = abs(num) // abs(xstep) * (1 if (num >= 0) == (xstep > 0) else -1)
    else:
        size = math.ceil((float(end) - float(start)) / float(step))
    size = max(size, 0)
    if acc is np.int64:
        return xstart + xstep * np.arange(size, dtype=np.int64)
    return np.asarray(xstart, acc) + np.asarray(xstep, acc) * np.arange(size, dtype=acc)


@handler(aten.arange.start_out, aten.arange.out)
def arange_out(args, kwargs):
    """aten::arange.out / start_out - ``[start, end)`` by ``step`` written into ``out``.

    Shapes: ``out`` resized to ceil((end - start) / step). Dtypes: ``out``'s, real only
    (Note [arange of complex]); integer bounds stay exact in int64 (past 2**31 and 2**53).
    Reference: torch.arange.
    """
    out = kwargs["out"]
    if out.dtype.is_complex or out.dtype == torch.bool:  # Note [arange of complex]
        name = dtypes.aten_type_name(out.dtype)
        raise NotImplementedError(f"\"arange_cpu\" not implemented for '{name}'")
    if len(args) == 1:
        start, end, step = 0, args[0], 1
    else:
        start, end = args[0], args[1]
        step = args[2] if len(args) > 2 else kwargs.get("step", 1)
    vals = arange_values(start, end, step, out.dtype)
    # Cast on the host and transfer: jnp's cast would be an XLA call of its own.
    arr = put_host(vals.astype(dtypes.to_jax_dtype(out.dtype)))
    return _write_out(aten.arange.start_out, out, arr)


# ---------------------------------------------------------------------------------------
# linspace / logspace


def _step_dtype(dtype: torch.dtype):
    # torch's step_t: double for integral outputs, the output type otherwise; we compute
    # f16/bf16 in float32 (torch's Half arithmetic rounds through float too).
    if _is_integral(dtype) or dtype == torch.float64:
        return np.float64
    if dtype == torch.complex128:
        return np.complex128
    if dtype.is_complex:
        return np.complex64
    return np.float32


def _halfway(start, end, steps, step_dt):
    """start + step*i for the first half, end - step*(steps-1-i) for the rest (torch's
    symmetric form: both endpoints are exact)."""
    if steps == 1:  # torch fills ``start`` (the symmetric form would give ``end``)
        return np.asarray([start], step_dt)
    with np.errstate(invalid="ignore", over="ignore"):  # inf bounds give NaN, as torch
        step = (np.asarray(end, step_dt) - np.asarray(start, step_dt)) / step_dt(max(steps - 1, 1))
        idx = np.arange(steps)
        lo = np.asarray(start, step_dt) + step * idx.astype(step_dt)
        hi = np.asarray(end, step_dt) - step * (steps - 1 - idx).astype(step_dt)
    return np.where(idx < steps // 2, lo, hi).astype(step_dt)


def _check_steps(op, steps):
    if steps < 0:
        raise RuntimeError(f"number of steps must be non-negative (in aten::{op}, got {steps})")


@handler(
    aten.linspace.out,
    aten.linspace.Tensor_Tensor_out,
    aten.linspace.Tensor_Scalar_out,
    aten.linspace.Scalar_Tensor_out,
)
def linspace_out(args, kwargs):
    """aten::linspace.out - ``steps`` evenly spaced values from start to end into ``out``.

    Dtypes: ``out``'s; integral outputs truncate the bounds first and step in double
    (torch's CPU kernel). Reference: torch.linspace, ATen RangeFactoriesKernel.cpp.
    """
    out = kwargs["out"]
    start, end, steps = _value(args[0]), _value(args[1]), args[2]
    _check_steps("linspace.out", steps)
    dtype = out.dtype
    for bound in (start, end):  # the kernel reads both as its scalar type, checked
        dtypes.check_scalar_fits(bound, dtype, "linspace")
    if _is_integral(dtype):  # read as the output type: a negative bound wraps if unsigned
        kind = np.dtype(dtypes.to_jax_dtype(dtype))
        start, end = (int(np.asarray(int(b)).astype(kind)) for b in (start, end))
    vals = _halfway(start, end, steps, _step_dtype(dtype))
    arr = jnp.asarray(vals).astype(dtypes.to_jax_dtype(dtype))
    return _write_out(aten.linspace.out, out, arr)


@handler(
    aten.logspace.out,
    aten.logspace.Tensor_Tensor_out,
    aten.logspace.Tensor_Scalar_out,
    aten.logspace.Scalar_Tensor_out,
)
def logspace_out(args, kwargs):
    """aten::logspace.out - ``base ** linspace(start, end, steps)`` into ``out``.

    Dtypes: ``out``'s; integral outputs truncate the bounds first; the exponent is
    computed in the step type, the power in double.
    Reference: torch.logspace.
    """
    out = kwargs["out"]
    start, end, steps = _value(args[0]), _value(args[1]), args[2]
    base = args[3] if len(args) > 3 else kwargs.get("base", 10.0)
    _check_steps("logspace.out", steps)
    if _is_integral(out.dtype):  # torch truncates the bounds, as for linspace
        start, end = int(start), int(end)
    exps = _halfway(start, end, steps, _step_dtype(out.dtype))
    vals = np.power(
        np.asarray(base, np.float64), exps.astype(np.float64) if not out.dtype.is_complex else exps
    )
    arr = jnp.asarray(vals).astype(dtypes.to_jax_dtype(out.dtype))
    return _write_out(aten.logspace.out, out, arr)


def _scalar_bounds(factory):
    def tensor_bounds(args, kwargs):
        """linspace/logspace with 0-d tensor bounds: torch reads them with .item()."""
        start, end = _value(args[0]), _value(args[1])
        return factory(start, end, *args[2:], **kwargs)

    return tensor_bounds


handler(aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar, aten.linspace.Scalar_Tensor)(
    _scalar_bounds(torch.linspace)
)
handler(aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar, aten.logspace.Scalar_Tensor)(
    _scalar_bounds(torch.logspace)
)


# ---------------------------------------------------------------------------------------
# eye, tril/triu indices


@handler(aten.eye.out, aten.eye.m_out)
def eye_out(args, kwargs):
    """aten::eye.out / m_out - ``n x m`` identity into ``out`` (m defaults to n).

    Dtypes: ``out``'s (bool gives True on the diagonal). Reference: torch.eye.
    """
    out = kwargs["out"]
    n = args[0]
    m = args[1] if len(args) > 1 else n
    if n < 0:
        raise RuntimeError(f"n must be greater or equal to 0, got {n} (in aten::eye.out)")
    if m < 0:
        raise RuntimeError(f"m must be greater or equal to 0, got {m} (in aten::eye.out)")
    arr = jnp.eye(n, m, dtype=dtypes.to_jax_dtype(out.dtype))
    return _write_out(aten.eye.out, out, arr)


def _tri_indices(op, np_fn, row, col, offset):
    if row < 0 or col < 0:
        raise RuntimeError(
            f"aten::{op}: row and col must be non-negative, got row={row}, col={col}"
        )
    r, c = np_fn(row, offset, col)
    return np.stack([r, c]).astype(np.int64).reshape(2, -1)


def _tri_factory(op, np_fn):
    def kernel(row, col, offset=0, dtype=torch.int64, layout=None, device=None, pin_memory=None):
        dtype = torch.int64 if dtype is None else dtype
        if dtype not in (torch.int32, torch.int64):
            raise RuntimeError(f"aten::{op}: dtype must be int32 or int64, got {dtype}")
        index = 0 if device is None else (torch.device(device).index or 0)
        with x64(True):
            vals = _tri_indices(op, np_fn, row, col, offset)
            return wrap(jnp.asarray(vals, dtype=dtypes.to_jax_dtype(dtype)), index)

    return kernel


def _tri_out(op, np_fn):
    def out_fn(args, kwargs):
        out = kwargs["out"]
        offset = args[2] if len(args) > 2 else kwargs.get("offset", 0)
        vals = _tri_indices(op, np_fn, args[0], args[1], offset)
        return _write_out(
            getattr(aten, op).out, out, jnp.asarray(vals, dtype=dtypes.to_jax_dtype(out.dtype))
        )

    return out_fn


tril_indices = _tri_factory("tril_indices", np.tril_indices)
triu_indices = _tri_factory("triu_indices", np.triu_indices)
handler(aten.tril_indices.out)(_tri_out("tril_indices", np.tril_indices))
handler(aten.triu_indices.out)(_tri_out("triu_indices", np.triu_indices))


# ---------------------------------------------------------------------------------------
# kaiser_window

# Note [kaiser_window on tpu]
# torch's kaiser_window is a CompositeExplicitAutograd kernel that checks its options,
# makes ``arange`` and ``empty`` on the output device and then calls a DispatchStub
# (kaiser_window_stub) directly, not through the dispatcher: the stub has no kernel for
# PrivateUse1, so on tpu it stops at an internal assert. We register a PrivateUse1 kernel
# for all three overloads that follows the composite step by step: the composite's own
# checks run on the meta device (same messages, the device named as the caller's), the
# short cuts for lengths 0 and 1 are kept, and the stub's arithmetic (ATen's CPU kernel:
# opmath, i0 of beta * sqrt(|1 - ((n - alpha) / alpha)^2|) over i0 of beta) runs as tpu
# ops on the tpu ``arange``, so the lowerings of i0, sqrt, ... are the ones it uses.
# The ``out=`` overloads take a tpu tensor, so they reach the registry: a handler runs
# the same kernel in ``out``'s dtype and writes the result, resizing ``out``.


def _kaiser_checks(window_length, periodic, beta, dtype, layout, device, pin_memory):
    """Run the composite's option checks on meta; raise its error naming ``device``."""
    try:
        aten.kaiser_window.beta(
            window_length,
            periodic,
            beta,
            dtype=dtype,
            layout=layout,
            device="meta",
            pin_memory=pin_memory,
        )
    except RuntimeError as e:
        text = str(e).replace("device=meta", f"device={device}")
        raise _errors.verbatim(RuntimeError(text)) from None


def kaiser_window(
    window_length,
    periodic=True,
    beta=12.0,
    *,
    dtype=None,
    layout=None,
    device=None,
    pin_memory=None,
):
    """aten::kaiser_window (default, periodic, beta) - the Kaiser window on tpu.

    Shapes: ``(window_length,)``. Dtypes: ``dtype`` (default dtype if None), computed in
    float32 for f16/bf16 as torch's CPU kernel. Reference: torch.kaiser_window, ATen
    TensorFactories.cpp and UnaryOpsKernel.cpp (kaiser_window_kernel).
    """
    device = torch.device("tpu") if device is None else torch.device(device)
    _kaiser_checks(window_length, periodic, beta, dtype, layout, device, pin_memory)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if window_length == 0:
        return torch.empty(0, dtype=dtype, device=device)
    if window_length == 1:
        return torch.ones(1, dtype=dtype, device=device)
    length = window_length + 1 if periodic else window_length
    opmath = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    n = torch.arange(length, dtype=dtype, device=device).to(opmath)
    alpha = (length - 1) / 2.0
    arg = beta * torch.sqrt(torch.abs(1 - ((n - alpha) / alpha).pow(2)))
    i0_beta = torch.special.i0(torch.full((), beta, dtype=opmath, device=device))
    window = (torch.special.i0(arg) / i0_beta).to(dtype)
    return window.narrow(0, 0, window_length) if periodic else window


@handler(aten.kaiser_window.out, aten.kaiser_window.periodic_out, aten.kaiser_window.beta_out)
def kaiser_window_out(args, kwargs):
    """aten::kaiser_window.out (and periodic_out, beta_out) - the window into ``out``."""
    out = kwargs["out"]
    # torch's generated out= kernel passes out's options: its layout is given, not default.
    window = kaiser_window(*args, dtype=out.dtype, layout=out.layout, device=out.device)
    return write_into(aten.kaiser_window.beta_out, out, window, check_cast=False, resize=True)


def _register_kernels() -> None:
    """PrivateUse1 kernels for factories torch has no composite kernel for, or whose
    composite kernel cannot run on tpu (Note [kaiser_window on tpu])."""
    global _LIB
    _LIB = torch.library.Library("aten", "IMPL", "PrivateUse1")
    _LIB.impl("tril_indices", tril_indices)
    _LIB.impl("triu_indices", triu_indices)
    for overload in ("kaiser_window", "kaiser_window.periodic", "kaiser_window.beta"):
        _LIB.impl(overload, kaiser_window)


_register_kernels()


# ---------------------------------------------------------------------------------------
# *_like


def like_options(self: torch.Tensor, kwargs) -> dict:
    """dtype/device for a ``*_like`` op: the kwargs where given, else ``self``'s."""
    dtype = kwargs.get("dtype")
    device = kwargs.get("device")
    return {
        "dtype": self.dtype if dtype is None else dtype,
        "device": self.device if device is None else device,
    }


def _like_strides(self: torch.Tensor, kwargs):
    """The strides of a ``*_like`` result (Note [Memory formats on tpu] in
    torchjax/tensor/_memory_format.py); None when contiguous."""
    size = tuple(self.shape)
    stride = result_strides(size, self.stride(), kwargs.get("memory_format"))
    return None if stride == contiguous_strides(size) else stride


def like_empty(self: torch.Tensor, kwargs) -> torch.Tensor:
    """``empty_like(self, **kwargs)``: ``self``'s shape at the strides its memory_format
    gives, zero-filled on tpu (jax arrays always hold values)."""
    stride = _like_strides(self, kwargs)
    if stride is None:
        return torch.empty(tuple(self.shape), **like_options(self, kwargs))
    return torch.empty_strided(tuple(self.shape), stride, **like_options(self, kwargs))


def _filled_like(self, kwargs, fill_value, factory):
    if _like_strides(self, kwargs) is None:
        return factory(tuple(self.shape), **like_options(self, kwargs))
    return like_empty(self, kwargs).fill_(fill_value)


@handler(aten.full_like.default)
def full_like(args, kwargs):
    """aten::full_like - a tensor of ``self``'s shape filled with ``fill_value``.

    dtype/device default to ``self``'s, strides follow ``memory_format`` as
    ``empty_like``'s. Reference: torch.full_like.
    """
    self, fill_value = args[0], args[1]
    return _filled_like(
        self, kwargs, fill_value, lambda size, **o: torch.full(size, fill_value, **o)
    )


@handler(aten.zeros_like.default)
def zeros_like(args, kwargs):
    """aten::zeros_like - zeros of ``self``'s shape (dtype/device from kwargs or self,
    strides as ``empty_like``'s)."""
    return _filled_like(args[0], kwargs, 0, torch.zeros)


@handler(aten.ones_like.default)
def ones_like(args, kwargs):
    """aten::ones_like - ones of ``self``'s shape (dtype/device from kwargs or self,
    strides as ``empty_like``'s)."""
    return _filled_like(args[0], kwargs, 1, torch.ones)


@handler(aten.empty_like.default)
def empty_like(args, kwargs):
    """aten::empty_like - an uninitialised tensor of ``self``'s shape at the strides
    ``memory_format`` gives. On tpu it is zero-filled (jax arrays always hold values)."""
    return like_empty(args[0], kwargs)


@handler(aten.scalar_tensor.out)
def scalar_tensor_out(args, kwargs):
    """aten::scalar_tensor.out - a 0-d tensor holding ``s`` in ``out``'s dtype."""
    out = kwargs["out"]
    arr = jnp.asarray(np.asarray(args[0])).astype(dtypes.to_jax_dtype(out.dtype))
    return _write_out(aten.scalar_tensor.out, out, arr)


def _filled_out(func, out, size, value):
    arr = jnp.full(tuple(size), _value(value), dtype=dtypes.to_jax_dtype(out.dtype))
    return _write_out(func, out, arr)


@handler(aten.full.out)
def full_out(args, kwargs):
    """aten::full.out - ``out`` resized to ``size`` and filled with ``fill_value``."""
    return _filled_out(aten.full.out, kwargs["out"], args[0], args[1])


@handler(aten.zeros.out)
def zeros_out(args, kwargs):
    """aten::zeros.out - ``out`` resized to ``size``, all zeros."""
    return _filled_out(aten.zeros.out, kwargs["out"], args[0], 0)


@handler(aten.ones.out)
def ones_out(args, kwargs):
    """aten::ones.out - ``out`` resized to ``size``, all ones."""
    return _filled_out(aten.ones.out, kwargs["out"], args[0], 1)


@handler(aten.empty.out)
def empty_out(args, kwargs):
    """aten::empty.out - ``out`` resized to ``size`` (zero-filled on tpu)."""
    return _filled_out(aten.empty.out, kwargs["out"], args[0], 0)
