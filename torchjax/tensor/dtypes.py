"""The one map between torch dtypes and JAX/NumPy dtypes.

Every torch dtype torchjax supports has exactly one JAX dtype and back, so the dtype a
tpu tensor reports is always the dtype of its jax array (no 64 -> 32 narrowing: see
Note [x64 without touching the user's JAX] in torchjax/_compat/jax.py).
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import torch

_TORCH_TO_NUMPY: dict[torch.dtype, np.dtype] = {
    torch.bool: np.dtype(np.bool_),
    torch.uint8: np.dtype(np.uint8),
    torch.uint16: np.dtype(np.uint16),
    torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    torch.float8_e4m3fnuz: np.dtype(ml_dtypes.float8_e4m3fnuz),
    torch.float8_e5m2fnuz: np.dtype(ml_dtypes.float8_e5m2fnuz),
}
_NUMPY_TO_TORCH: dict[np.dtype, torch.dtype] = {v: k for k, v in _TORCH_TO_NUMPY.items()}

# numpy cannot hand these to torch.from_numpy; they cross as same-width integers.
_BITCAST_VIA: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.int8,
    torch.float8_e5m2: torch.int8,
    torch.float8_e4m3fnuz: torch.int8,
    torch.float8_e5m2fnuz: torch.int8,
}


def to_jax_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy/JAX dtype holding a torch ``dtype``; raises TypeError if unsupported."""
    try:
        return _TORCH_TO_NUMPY[dtype]
    except KeyError:
        raise TypeError(
            f"torchjax: torch dtype {dtype} has no JAX equivalent; supported: "
            f"{sorted(str(d) for d in _TORCH_TO_NUMPY)}"
        ) from None


def complex32_error(operands: str) -> NotImplementedError:
    """The refusal of a computation whose result would be complex32 (ComplexHalf), from
    ``operands`` (words: "a torch.float16 tensor and a Python complex"): JAX has no
    complex32, so no tpu tensor can hold one. NotImplementedError, as torch refuses a
    dtype a kernel lacks; the error layer adds the op's name."""
    error = NotImplementedError(
        f"torchjax: the result dtype of {operands} is torch.complex32 (ComplexHalf), "
        "which JAX does not have, so a tpu tensor cannot hold it. Do the complex math in "
        "complex64: make the float16 operands float32 first (x.float()), or run this step "
        "on CPU (.cpu())."
    )
    error._torchjax_complex32 = True
    return error


def is_complex32_error(error: BaseException) -> bool:
    """Whether ``error`` is ``complex32_error``'s refusal."""
    return getattr(error, "_torchjax_complex32", False)


def to_torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a NumPy/JAX ``dtype``; raises TypeError if unsupported."""
    try:
        return _NUMPY_TO_TORCH[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise TypeError(f"torchjax: JAX dtype {dtype} has no torch equivalent") from None


def cpu_tensor_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A fresh, writable, C-contiguous NumPy copy of a CPU tensor, dtype exact.

    The copy is torch's (``clone``), whose buffer is 64-byte aligned: ``jax.device_put``
    on XLA:CPU then adopts it without copying again, where a NumPy copy (16-byte
    aligned) is copied once more, so ``x.to("tpu")`` of a large tensor held 2x its
    bytes (Note [Storages filled on first read] in torchjax/tensor/_storage.py)."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()  # already a fresh tensor
        t = t.contiguous()
    else:
        t = t.clone(memory_format=torch.contiguous_format)
    via = _BITCAST_VIA.get(t.dtype)
    if via is not None:
        return t.view(via).numpy().view(_TORCH_TO_NUMPY[t.dtype])
    return t.numpy()


def numpy_to_cpu_tensor(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor owning a copy of ``a``, dtype exact."""
    dtype = to_torch_dtype(a.dtype)
    via = _BITCAST_VIA.get(dtype)
    a = np.array(a, copy=True, order="C")
    if via is not None:
        return torch.from_numpy(a.view(_TORCH_TO_NUMPY[via])).view(dtype)
    return torch.from_numpy(a)


def aten_type_name(dtype) -> str:
    """ATen's scalar-type name ("Float", "Long", "BFloat16", ...) of a torch or JAX dtype,
    as torch's error messages spell it; derived from torch's legacy tensor type name."""
    if not isinstance(dtype, torch.dtype):
        dtype = to_torch_dtype(dtype)
    if dtype == torch.complex32:
        return "ComplexHalf"  # an empty complex32 tensor would warn that it is experimental
    return torch.empty(0, dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")


# c10's names for the C++ type a Scalar is converted to, as its overflow message says.
_CPP_NAMES = {
    "int8": "int8_t",
    "uint8": "uint8_t",
    "int16": "int16_t",
    "uint16": "uint16_t",
    "int32": "int",
    "uint32": "uint32_t",
    "int64": "int64_t",
    "uint64": "uint64_t",
    "float16": "c10::Half",
    "bfloat16": "c10::BFloat16",
    "float32": "float",
    "float64": "double",
    "complex64": "c10::complex<float>",
    "complex128": "c10::complex<double>",
    "float8_e4m3fn": "c10::Float8_e4m3fn",
    "float8_e5m2": "c10::Float8_e5m2",
    "float8_e4m3fnuz": "c10::Float8_e4m3fnuz",
    "float8_e5m2fnuz": "c10::Float8_e5m2fnuz",
}


def check_scalar_fits(value, dtype, op: str) -> None:
    """Raise torch's RuntimeError when the Python number ``value`` does not fit ``dtype``
    (a torch or JAX dtype), as c10's ``checked_convert`` does where a kernel reads a
    Scalar as its tensor's type (fill, masked_fill, where, clamp, full, pad): a finite
    value past the type's range, NaN or infinity into an integer, a complex value into a
    real type. Negative ints into unsigned types wrap (c10 allows it); bool targets and
    bool values are never checked."""
    if isinstance(dtype, torch.dtype):
        dtype = to_jax_dtype(dtype)
    dt = np.dtype(dtype)
    if isinstance(value, bool) or dt == np.bool_ or not isinstance(value, (int, float, complex)):
        return
    kind = dt.kind
    if isinstance(value, complex) and kind != "c":
        _overflow(dt, op)
    parts = (value.real, value.imag) if isinstance(value, complex) else (value,)
    dt = component_dtype(dt)  # a complex type: each part against its component type
    for v in parts:
        if kind in "iu":
            info = np.iinfo(dt)
            if isinstance(v, int):
                if kind == "u" and v < 0 and -v <= info.max:
                    continue  # wraps, as c10 allows for unsigned types
                bad = v < info.min or v > info.max
            else:
                bad = v != v or v < info.min or v > info.max
        else:
            info = ml_dtypes.finfo(dt)
            has_inf = bool(np.isinf(np.array(np.inf).astype(dt)))
            if v != v:
                continue
            if isinstance(v, float) and v in (float("inf"), float("-inf")):
                bad = not has_inf
            else:
                bad = v < float(info.min) or v > float(info.max)
        if bad:
            _overflow(np.dtype(dtype), op)


def is_half(dtype) -> bool:
    """float16, bfloat16 or a float8 type (a torch or JAX dtype)."""
    if not isinstance(dtype, torch.dtype):
        dtype = to_torch_dtype(dtype)
    return dtype.is_floating_point and dtype.itemsize <= 2


def cpp_type_name(dt) -> str:
    """c10's name for the C++ type of NumPy dtype ``dt``, as its overflow message says."""
    return _CPP_NAMES.get(dt.name, dt.name)


def overflow_text(dt, op: str) -> str:
    """c10's text for a number that does not fit ``dt`` (a NumPy dtype) in ``op``."""
    name = cpp_type_name(dt)
    return f"value cannot be converted to type {name} without overflow (in aten::{op})"


def component_dtype(dt):
    """The real type each part of a complex ``dt`` is checked against (``dt`` if real)."""
    if dt.kind != "c":
        return dt
    return np.dtype(np.float32 if dt == np.complex64 else np.float64)


def _overflow(dt, op):
    raise RuntimeError(overflow_text(dt, op))


# Note [float64 on TPU]
# XLA:TPU has no 64-bit float arithmetic: it emulates float64 (and complex128) with
# pairs of float32 numbers: about 48 significant bits where float64 has 53, inside
# float32's exponent range only. Measured on a v5e: ``(1/3) * 3`` equals CPU's to 1e-15,
# ``1e30 * 3`` is 3e-15 from it, and near the bottom of the range the pair's low word
# underflows, so ``1e-30 * 3`` is only 3.2e-9 from CPU's; a magnitude below ~1.2e-38
# becomes 0 and one above ~3.4e38 inf in any computation (``1e-300 * 3`` gave 0).
# int64 is emulated exactly. torchjax keeps the dtype, as JAX does (narrowing it would
# be a dtype lie, and most float64 values in a model, such as rotary frequencies, lie
# well inside the range), and says so once per process, when the first float64 or
# complex128 tensor is made on such a platform.
# The platforms, in one table:
EMULATED_FLOAT64 = {"tpu": "XLA:TPU emulates them with pairs of float32"}
_WARNED: set[str] = set()


def note_emulated_float64(arr, dtype) -> None:
    """Warn once per process and platform when ``arr`` (float64 or complex128) lives on
    a platform of EMULATED_FLOAT64 (Note [float64 on TPU]). Called where a tensor's
    metadata is first computed for its (shape, dtype), so never on the hot path."""
    if dtype not in (np.float64, np.complex128) or isinstance(arr, jax.core.Tracer):
        return  # a tracer has no devices (asking builds an error message: a trace walk)
    try:
        platform = next(iter(arr.devices())).platform
    except Exception:  # a tracer or an array without devices: nothing to say yet
        return
    how = EMULATED_FLOAT64.get(platform)
    if how is None or platform in _WARNED:
        return
    _WARNED.add(platform)
    import warnings

    warnings.warn(
        f"float64/complex128 tensors on {platform}: {how}, so they keep about 48 of "
        "float64's 53 significant bits, and only inside float32's exponent range: "
        "precision falls toward float32's below ~1e-29, magnitudes below ~1.2e-38 become "
        "0 and above ~3.4e38 inf in any computation. Compute on CPU (.cpu()) where the "
        "full float64 range matters (Note [float64 on TPU], docs/tpu.md).",
        UserWarning,
        stacklevel=3,
    )
