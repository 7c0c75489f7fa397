"""The handler of a functional overload: tpu tensors in, the lowering run as one cached
executable (or op by op), tpu tensors out.

Arguments are unwrapped to jax arrays: 0-d CPU tensors and Python numbers are scalars,
any other CPU tensor is an error naming both devices (CUDA's rule); promoted arguments
are cast as ops/promotion.py says. Results are wrapped from their shape and dtype, never
from device data (Note [The eager hot path] in torchjax/ops/registry.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

from torchjax._compat.jax import put_host
from torchjax.device import _checks
from torchjax.ops import cached_compute, fused, layouts, promotion, traced_scalars
from torchjax.ops.schema import out_names
from torchjax.tensor import dtypes
from torchjax.tensor._tensor import JaxTensor, wrap


def device_error(func, t) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, "
        f"tpu:0 and {t.device}! (in aten::{func._opname}.{func._overloadname}; move the "
        f"{tuple(t.shape)} {t.dtype} tensor with .to('tpu'); only 0-d CPU tensors are "
        "accepted as scalars)"
    )


def cpu_to_jax(t: torch.Tensor) -> jax.Array:
    # A transfer compiles nothing (jnp.asarray compiles a copy per new shape); put_host
    # is jax.device_put's own transfer without its Python (Note [Host arrays onto a
    # device] in torchjax/_compat/jax.py).
    if t.dim() > 64:  # NumPy's limit, not XLA's: moved flat, shaped on the device
        return put_host(dtypes.cpu_tensor_to_numpy(t.reshape(-1))).reshape(t.shape)
    return put_host(dtypes.cpu_tensor_to_numpy(t))


def _check_traced_numbers(policy, args, kwargs, result) -> None:
    """A traced Python float where the op checks that the number fits its result dtype
    (clamp's bounds, add's alpha; Note [Traced Python floats]): for a float result, the
    check of ``dtypes.check_scalar_fits`` made on the device and raised when the program
    returns, with its text; for an integer result the graph is traced with static
    values (the conversion's rules need the number)."""
    named = list(zip(policy.names, args)) + list(kwargs.items())
    for name, v in named:
        if name not in policy.checked or not traced_scalars.is_traced(v):
            continue
        dt = dtypes.component_dtype(np.dtype(result))
        if not (dt.kind == "f" or dt.name == "bfloat16"):  # ints, bool, float8 (no inf)
            raise traced_scalars.NeedsValue(f"aten::{policy.opname} checks that {name} fits")
        x = traced_scalars.value_of(v)
        info = ml_dtypes.finfo(dt)
        bad = jnp.isfinite(x) & ((x < float(info.min)) | (x > float(info.max)))
        text = dtypes.overflow_text(np.dtype(result), policy.opname)  # names the result type
        _checks.require(bad, x, RuntimeError, text, deferred=False)


def unwrap(func, entry, x):
    if isinstance(x, JaxTensor):
        return x._value()
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 or entry.cpu_tensors:
            return cpu_to_jax(x)
        raise device_error(func, x)
    if isinstance(x, (list, tuple)):
        return type(x)(unwrap(func, entry, y) for y in x)
    if x.__class__ is torch.SymFloat:  # Note [Traced Python floats]
        return traced_scalars.value_of(x)
    return x


def device_index(args):
    for a in args:
        if isinstance(a, JaxTensor):
            return a._device_index
    return 0


def wrap_out(x, device_index):
    if isinstance(x, jax.Array):
        return wrap(x, device_index)
    if isinstance(x, (tuple, list)):
        return type(x)(wrap_out(y, device_index) for y in x)
    if isinstance(x, np.ndarray):
        return wrap(jnp.asarray(x), device_index)
    if x.__class__ is fused.Pending:  # recorded, not run (Note [Fused eager])
        return fused.wrap(x, device_index)
    return x


def make_compute(func, entry, strip_out):
    """fn(args, kwargs) -> jax arrays of the functional op (no wrapping): one cached
    jax.jit executable per call signature where the op allows it (Note [Compiled
    lowerings]), else the lowering run op by op."""
    eager = make_eager_compute(func, entry, strip_out)
    if not cached_compute.compilable(func, entry):
        info = cached_compute.cache_info_entry(func)

        def op_by_op(args, kwargs):
            info.op_by_op += 1
            return eager(args, kwargs)

        return op_by_op
    outs = frozenset(out_names(func._schema)) if strip_out else frozenset()
    policy = promotion.Policy(func, entry)
    return cached_compute.CompiledCompute(
        func, entry, outs, policy, eager, cpu_to_jax, lambda t: device_error(func, t)
    )


def make_eager_compute(func, entry, strip_out):
    """fn(args, kwargs) -> jax arrays of the functional op, the lowering run op by op."""
    fn = entry.fn
    outs = set(out_names(func._schema)) if strip_out else set()
    policy = promotion.Policy(func, entry)
    kind, pidx, pnames = policy.kind, policy.pidx, policy.pnames

    def compute(args, kwargs):
        if outs:
            kwargs = {k: v for k, v in kwargs.items() if k not in outs}
        jargs = [unwrap(func, entry, a) for a in args]
        jkwargs = {k: unwrap(func, entry, v) for k, v in kwargs.items()}
        if kind is None:
            return fn(*jargs, **jkwargs)
        vals = [args[i] for i in pidx if i < len(args) and args[i] is not None]
        vals += [v for k, v in kwargs.items() if k in pnames and v is not None]
        dts = promotion.promoted_dtypes(kind, vals)
        if policy.checks_numbers_of(dts[1]):
            _check_traced_numbers(policy, args, kwargs, dts[1])
        policy.cast_args(jargs, jkwargs, dts)
        return promotion.cast_out(fn(*jargs, **jkwargs), dts[1])

    return compute


def make_handler(func, entry, strip_out=False):
    """The handler of ``func``, a functional overload (or an out= one, its out
    arguments stripped) lowered by ``entry``."""
    compute = make_compute(func, entry, strip_out)
    # out= results take the out tensors' layout: no result layout of their own.
    result_layouts = None if strip_out else layouts.ResultLayouts(func)

    def functional(args, kwargs):
        out = compute(args, kwargs)
        a0 = args[0] if args else None
        index = a0._device_index if isinstance(a0, JaxTensor) else device_index(args)
        if out.__class__ is fused.Pending:  # recorded (Note [Fused eager])
            result = fused.wrap(out, index)
        else:
            result = wrap(out, index) if isinstance(out, jax.Array) else wrap_out(out, index)
        if result_layouts is not None and layouts.any_out_of_order(args, kwargs):
            # Note [Result layouts follow CPU]
            return result_layouts(args, kwargs, result)
        return result

    return functional
