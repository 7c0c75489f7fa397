"""Type promotion around a lowering: the computation, result and input dtypes of a call,
and the casts into and out of the computation dtype (torch's elementwise promotion, with
the rounding CPU kernels do on the way in).

Each overload's ``Policy`` is built once by the registry and applied on both of its paths:
op by op (registry.py) and inside its compiled executable (ops/cached_compute.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from jax import lax

from torchjax._compat.jax import plain_eager, put_host, weak_float
from torchjax._compat.torch import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
from torchjax.tensor import dtypes

Kind = ELEMENTWISE_TYPE_PROMOTION_KIND

_SCALAR_TYPES = (bool, int, float, complex)


def _promotion_key(x):
    if isinstance(x, torch.Tensor):
        return (x.dtype, x.dim() == 0)
    if x.__class__ is torch.SymFloat:  # a traced Python float (Note [Traced Python floats])
        return float
    return type(x)


_PROMOTION_CACHE: dict = {}


def promoted_by_key(kind, keys):
    """(computation, result, inputs) jax dtypes for promotion keys (``_promotion_key``
    values); ``inputs`` is the half type promoted arguments are rounded to before the
    computation, or None (Note [Half-precision inputs are rounded first])."""
    # The default dtype decides int -> float and Python-float results (int * 0.5).
    key = (kind, torch.get_default_dtype()) + tuple(keys)
    hit = _PROMOTION_CACHE.get(key)
    if hit is None:
        hit = _PROMOTION_CACHE[key] = _promotion(kind, [_promotion_example(k) for k in keys])
    return hit


def _promotion_example(key):
    # A value with that promotion key: torch's promotion reads only dtype and 0-d-ness.
    if isinstance(key, tuple):
        dt, zero_dim = key
        return torch.empty(() if zero_dim else (1,), dtype=dt, device="meta")
    return key(0)


def common_dtype(vals):
    """The torch dtype elementwise kernels compute ``vals`` (tensors and Python numbers)
    in without opmath: TensorIterator's common dtype, which CPU kernels dispatch on."""
    key = ("common", torch.get_default_dtype()) + tuple(_promotion_key(v) for v in vals)
    hit = _PROMOTION_CACHE.get(key)
    if hit is None:
        examples = [_promotion_example(_promotion_key(v)) for v in vals]
        hit = _PROMOTION_CACHE[key] = elementwise_dtypes(
            *examples, type_promotion_kind=Kind.NO_OPMATH
        )[0]
    return hit


def promoted_dtypes(kind, vals):
    key = (kind, torch.get_default_dtype()) + tuple(_promotion_key(v) for v in vals)
    hit = _PROMOTION_CACHE.get(key)
    if hit is None:
        hit = _PROMOTION_CACHE[key] = _promotion(kind, vals)
    return hit


# Note [Half-precision inputs are rounded first]
# torch's elementwise kernels read every input as the common dtype and compute in its
# opmath type: for float16/bfloat16 the common dtype is the half type, so a Python number,
# a 0-d tensor or an integer tensor is rounded to it first (TensorIterator casts CPU
# scalars to the common dtype; c10 converts a double through float), then computed in
# float32. ``x_bf16 + 0.3`` adds 0.30078125, and ``x_bf16 == 0.3`` is True where x holds
# bfloat16(0.3). torch's reference promotion (``elementwise_dtypes``) gives only the
# computation dtype, and casting straight to it kept 0.3 in float32: different sums in
# about one element in three, and comparisons that differ. Three kernels differ: CPU's
# ``mul``, true ``div`` and ``floor_divide`` read a one-element second operand's original
# value in float32 (``original_scalar_value``), so ``bf16 * 0.3`` multiplies by 0.3f:
# their lowerings list it in ``exact_scalars``. ``add``'s alpha is rounded to the half type too
# (``round_scalars``), and ``a + alpha * b`` is then rounded once, as CPU's vectorised
# loop does; CPU's scalar loop, which takes a tensor's last ``numel % 32`` elements,
# rounds the product first, so those elements can differ by one step.
_HALF_TYPES = (torch.float16, torch.bfloat16)


def _promotion(kind, vals):
    compute, result = elementwise_dtypes(*vals, type_promotion_kind=kind)
    if result == torch.complex32:
        raise _complex32_result(vals)
    inputs = None
    if compute == torch.float32:
        common, _ = elementwise_dtypes(*vals, type_promotion_kind=Kind.NO_OPMATH)
        if common in _HALF_TYPES:
            inputs = dtypes.to_jax_dtype(common)
    return (dtypes.to_jax_dtype(compute), dtypes.to_jax_dtype(result), inputs)


def _complex32_result(vals) -> NotImplementedError:
    # Why NotImplementedError: torch's refusal of a dtype a kernel lacks; a TypeError
    # would be swallowed by ``Tensor.__mul__``, which turns it into "unsupported operand".
    names = [
        f"a {v.dtype} tensor" if isinstance(v, torch.Tensor) else f"a Python {type(v).__name__}"
        for v in vals
    ]
    return dtypes.complex32_error(", ".join(names[:-1]) + " and " + names[-1])


# str() of the schema types Tensor, Scalar, Tensor?, Scalar?
_PROMOTABLE_TYPES = ("Tensor", "number", "Optional[Tensor]", "Optional[number]")


def promote_indices(schema, entry):
    names = entry.promote_args
    args = schema.arguments
    if names is None:
        return tuple(
            i for i, a in enumerate(args) if not a.kwarg_only and str(a.type) in _PROMOTABLE_TYPES
        )
    return tuple(i for i, a in enumerate(args) if a.name in names)


# Note [A converted bool is not a select]
# XLA's algebraic simplifier rewrites a product with a converted bool,
# ``convert(mask) * y`` (and a dot with one), into ``select(mask, y, 0)``: ``False *
# inf`` then gives 0 where IEEE arithmetic and CPU give NaN (``mask * float("inf")``,
# ``torch.dot(mask.float(), x)``). It does so inside any one program, so an op's own
# executable, a fused segment and ``torchjax.jit`` alike. An optimization barrier around
# the converted value keeps it a number; its cost is that the convert is not fused into
# its consumer.


# float8_e4m3fn has no infinity: CPU's conversion saturates what is out of its range
# (inf included) to +-448 and keeps NaN; XLA's gives NaN. The other float8 types convert
# alike on both (e5m2 overflows to inf, the fnuz types to NaN).
_E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)
_E4M3FN_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


def astype(x, dtype):
    """The jax array ``x`` as ``dtype``; a bool made float or complex stays a number
    (Note [A converted bool is not a select]); float8_e4m3fn saturates as on CPU; a
    complex made real keeps its real part."""
    if x.dtype == dtype:
        return x
    if dtype == _E4M3FN and (
        jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.signedinteger)
    ):
        x = jnp.clip(x, -_E4M3FN_MAX, _E4M3FN_MAX)
    elif dtype == _E4M3FN and jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        x = jnp.minimum(x, _E4M3FN_MAX)
    elif x.dtype.kind == "c" and np.dtype(dtype).kind != "c":
        # torch's cast keeps the real part; jax's astype of complex to real is deprecated.
        x = jnp.real(x)
    out = x.astype(dtype)
    if x.dtype == np.bool_ and jnp.issubdtype(dtype, jnp.inexact):
        out = lax.optimization_barrier(out)
    return out


def cast(x, dtype):
    if isinstance(x, jax.Array):
        return astype(x, dtype)
    if isinstance(x, np.ndarray):
        return x if x.dtype == dtype else x.astype(dtype)
    if isinstance(x, _SCALAR_TYPES):
        # astype wraps out-of-range ints (uint8 + -1) as torch does; asarray(dtype=) raises.
        return np.asarray(x).astype(dtype)
    return x


# Note [Python numbers as device scalars]
# A Python number in a promoted position (``x * 0.5``, ``x + 1``, an eps) is an argument
# of the op's executable (not a constant: the program is shared by every value). Handed
# over as a NumPy scalar, each call pays the conversion and a host-to-device transfer
# (about 3 us of a 1x1 multiply's 20); models repeat a few numbers (scales, eps, 1, -1),
# so the 0-d device array of each (type, value, dtype) is kept and passed instead. A
# float's key carries its sign (-0.0 == 0.0 as a key) and NaN is never kept (it misses
# every lookup); complex numbers are converted per call. Only plain eager calls take
# them: inside a trace (``torchjax.jit``) a device array would be a constant of the
# outer program, which jax passes as an extra argument (a NumPy scalar is a literal),
# and under a mesh it would be placed by the mesh. The arrays are never donated (only
# state buffers are: torchjax/compile/_donate.py).
_SCALAR_ARRAYS: dict = {}
_MAX_SCALAR_ARRAYS = 4096


def scalar_argument(x, dtype):
    """Python number ``x`` as the 0-d argument of computation dtype ``dtype`` (see the
    Note above): a kept device array, or ``cast(x, dtype)``."""
    if not plain_eager():
        return cast(x, dtype)
    if isinstance(x, float):
        if x != x:
            return cast(x, dtype)
        key = (x.__class__, x, dtype, math.copysign(1.0, x))
    elif isinstance(x, complex):
        return cast(x, dtype)
    else:
        key = (x.__class__, x, dtype)
    arr = _SCALAR_ARRAYS.get(key)
    if arr is None:
        arr = put_host(cast(x, dtype))
        if len(_SCALAR_ARRAYS) >= _MAX_SCALAR_ARRAYS:
            _SCALAR_ARRAYS.clear()
        _SCALAR_ARRAYS[key] = arr
    return arr


def cast_in(x, compute, inputs, exact=False):
    """A promoted argument in the computation dtype, rounded to ``inputs`` (a half type)
    first unless ``exact`` and it has one element (Note [Half-precision inputs are rounded
    first]); Python numbers go through the computation dtype, as c10 converts a double."""
    if inputs is None or getattr(x, "dtype", None) == inputs:
        return cast(x, compute)
    x = cast(x, compute)
    if isinstance(x, (jax.Array, np.ndarray)) and not (exact and x.size == 1):
        x = cast(x.astype(inputs), compute)
    return x


class Policy:
    """What promotion does around one overload's lowering, read once from its schema and
    registration: the promoted arguments (by position and by name) and the rules for
    numbers (Note [Half-precision inputs are rounded first]; ``Lowering.exact_scalars``,
    ``round_scalars``, ``checked_scalars`` in registry.py)."""

    __slots__ = (
        "kind",
        "names",
        "pidx",
        "pnames",
        "exact",
        "rounded",
        "checked",
        "checked_half",
        "opname",
    )

    def __init__(self, func, entry):
        self.kind = entry.promote
        self.names = [a.name for a in func._schema.arguments]
        self.pidx = promote_indices(func._schema, entry) if self.kind is not None else ()
        self.pnames = frozenset(self.names[i] for i in self.pidx)
        self.exact = frozenset(entry.exact_scalars)
        self.rounded = frozenset(entry.round_scalars)
        self.checked = frozenset(entry.checked_scalars)
        self.checked_half = entry.checked_half
        self.opname = func._opname

    def checks_promoted_numbers(self) -> bool:
        """Whether a Python number in a promoted position must fit the result dtype."""
        return any(self.names[i] in self.checked for i in self.pidx)

    def check_number(self, value, result) -> None:
        """torch's overflow error when the Python number ``value`` does not fit the result
        dtype ``result`` (a JAX dtype), for the types this op checks."""
        if self.checks_numbers_of(result):
            dtypes.check_scalar_fits(value, result, self.opname)

    def checks_numbers_of(self, result) -> bool:
        """Whether numbers named in ``checked_scalars`` are checked for result ``result``."""
        return bool(self.checked) and (self.checked_half or not dtypes.is_half(result))

    def cast_args(self, jargs, jkwargs, dts) -> None:
        """In place: numbers named in ``checked_scalars`` checked against the result dtype
        (Python numbers only: a promoted one the compiled path already cast was checked on
        the host), the promoted arguments in the computation dtype (rounded to a half
        input type first where CPU rounds), floats named in ``round_scalars`` rounded."""
        compute, result, inputs = dts
        names = self.names
        if self.checked:
            for name, v in zip(names, jargs):
                if name in self.checked:
                    self.check_number(v, result)
            for k in self.checked & jkwargs.keys():
                self.check_number(jkwargs[k], result)
        for i in self.pidx:
            if i < len(jargs):
                jargs[i] = cast_in(jargs[i], compute, inputs, names[i] in self.exact)
        for k in self.pnames & jkwargs.keys():
            jkwargs[k] = cast_in(jkwargs[k], compute, inputs, k in self.exact)
        if self.rounded and inputs is not None:
            # c10 converts a double through float.
            for i, name in enumerate(names[: len(jargs)]):
                if name in self.rounded:
                    jargs[i] = _rounded(jargs[i], inputs)
            for k in self.rounded & jkwargs.keys():
                jkwargs[k] = _rounded(jkwargs[k], inputs)


def _rounded(x, inputs):
    """A float read as a half type ``inputs`` through float, as c10 converts a double; a
    traced Python float (a jax scalar) alike, kept weakly typed."""
    if isinstance(x, float):
        return float(np.float32(x).astype(inputs))
    if isinstance(x, jax.Array) and x.ndim == 0 and jnp.issubdtype(x.dtype, jnp.floating):
        return weak_float(x.astype(jnp.float32).astype(inputs))
    return x


def cast_out(x, dtype):
    if isinstance(x, jax.Array):
        return x if x.dtype == dtype else x.astype(dtype)
    if isinstance(x, (tuple, list)):
        return type(x)(cast_out(y, dtype) for y in x)
    return x
