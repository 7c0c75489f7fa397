"""The ``_foreach_*`` family and the fused Adam/AdamW steps.

``aten::_foreach_<op>`` applies ``<op>`` to each element of tensor lists. One generic
handler lowers every overload from its schema (no per-op code): ``Tensor[]`` and
``Scalar[]`` arguments are indexed per element, a ``Tensor scalars`` argument (the
``.Tensor`` overloads of addcmul/addcdiv) is read as one Python scalar per element, and
everything else is passed unchanged to the per-tensor aten op. In-place variants
(``_foreach_add_``) call the per-tensor in-place op (``aten.add_``) on each JaxTensor, so
views of the parameters see the writes and torch's casting rule applies per tensor.
``.out`` overloads write each result with the registry's out= rules.

This matches torch's ``foreach_tensor_*_slow`` kernels (ATen/native/ForeachOpsKernels.cpp),
which are what CPU runs too; the fast CUDA kernels compute the same values.

``_fused_adam(w)_`` and ``_fused_sgd_`` follow ATen/native/cpu/Fused{Adam,SGD}Kernel.cpp:
one jitted jax computation per parameter, with ``grad_scale`` (grads unscaled and written
back) and ``found_inf`` (a nonzero value skips the step; read eagerly with ``bool()``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import torch

from torchjax._compat.torch import all_op_schemas
from torchjax.ops.registry import handler, write_into
from torchjax.tensor import dtypes
from torchjax.tensor._tensor import JaxTensor

aten = torch.ops.aten

_PREFIX = "_foreach_"
_LIST_TYPES = ("List[Tensor]", "List[number]", "List[Optional[Tensor]]")


def _addc(op):
    return lambda self, tensor1, tensor2, value=1: op(self, tensor1, tensor2, value=value)


def _clamp_or(binary, clamp):
    # _foreach_maximum.Scalar has no per-tensor "maximum.Scalar": torch's slow kernel
    # calls clamp_min (resp. clamp_max), which also propagates NaN from self.
    def fn(self, other):
        return (binary if isinstance(other, torch.Tensor) else clamp)(self, other)

    return fn


def _binary_out_(op):
    # maximum/minimum have no in-place overload: write through out=self (same cast check).
    return lambda self, other: op(self, other, out=self)


def _norm(self, ord=2, dtype=None):
    # aten::linalg_vector_norm's lowering does not repeat the check torch.linalg does.
    torch._check(
        self.is_floating_point() or self.is_complex(),
        lambda: (
            "linalg.vector_norm: Expected a floating point or complex tensor as input. "
            f"Got {self.dtype} (in aten::_foreach_norm)"
        ),
    )
    return aten.linalg_vector_norm(self, ord, dtype=dtype)


def _powsum(self, ord=2, dtype=None):
    return aten.sum.dim_IntList(aten.pow(aten.abs(self), ord), [], dtype=dtype)


# Per-element functional ops whose name or calling convention differs from the foreach op.
_FUNCTIONAL = {
    "addcmul": _addc(aten.addcmul),
    "addcdiv": _addc(aten.addcdiv),
    "maximum": _clamp_or(aten.maximum, aten.clamp_min),
    "minimum": _clamp_or(aten.minimum, aten.clamp_max),
    "norm": _norm,
    "powsum": _powsum,
    "max": aten.max.default,
    "zero": aten.zeros_like.default,
    "copy": aten.copy.default,
}
_INPLACE = {
    "addcmul": _addc(aten.addcmul_),
    "addcdiv": _addc(aten.addcdiv_),
    "maximum": _clamp_or(_binary_out_(aten.maximum.out), aten.clamp_min_),
    "minimum": _clamp_or(_binary_out_(aten.minimum.out), aten.clamp_max_),
}


def _per_element_fn(base: str, inplace: bool):
    table, suffix = (_INPLACE, "_") if inplace else (_FUNCTIONAL, "")
    fn = table.get(base)
    if fn is None:
        fn = getattr(aten, base + suffix)
    return fn


def _foreach_handler(func):
    """fn(args, kwargs) running ``func`` (a ``_foreach_*`` overload) element by element."""
    schema = func._schema
    name = func._opname
    outs = [a.name for a in schema.arguments if a.kwarg_only and a.alias_info is not None]
    inplace = name.endswith("_") and not outs
    base = name[len(_PREFIX) :].rstrip("_")
    per_element = _per_element_fn(base, inplace)
    params = [a for a in schema.arguments if a.name not in outs]
    listed = {a.name for a in params if str(a.type) in _LIST_TYPES}
    if base in ("addcmul", "addcdiv") and func._overloadname.startswith("Tensor"):
        listed.add("scalars")
    # The list that sets the length: self, except for pow.ScalarAndTensor (Scalar self).
    lead = next(a.name for a in params if str(a.type) == "List[Tensor]")
    op_name = f"aten::{name}.{func._overloadname}" if func._overloadname else f"aten::{name}"

    def bind(args, kwargs):
        bound = {}
        for i, a in enumerate(params):
            if a.kwarg_only:
                continue
            if i < len(args):
                bound[a.name] = args[i]
            elif a.name in kwargs:
                bound[a.name] = kwargs[a.name]
            elif a.has_default_value():
                # keep later positional arguments in their place
                bound[a.name] = a.default_value
        kw = {a.name: kwargs[a.name] for a in params if a.kwarg_only and a.name in kwargs}
        return bound, kw

    def run(args, kwargs):
        bound, kw = bind(args, kwargs)
        n = len(bound[lead])
        torch._check(n > 0, lambda: f"{op_name}: Tensor list must have at least one tensor.")
        for k in listed & bound.keys():
            v = bound[k]
            if isinstance(v, torch.Tensor):
                v = bound[k] = v.tolist()
            torch._check(
                len(v) == n,
                lambda k=k, v=v: (
                    f"{op_name}: Tensor lists must have the same number of elements, got "
                    f"{n} in {lead} and {len(v)} in {k}"
                ),
            )
        results = []
        for i in range(n):
            pos = [bound[k][i] if k in listed else bound[k] for k in bound]
            results.append(per_element(*pos, **kw))
        return results

    if outs:

        def out(args, kwargs):
            results = run(args, {k: v for k, v in kwargs.items() if k not in outs})
            for o, r in zip(kwargs[outs[0]], results):
                write_into(func, o, r, resize=True)

        return out
    if inplace:

        def inplace_fn(args, kwargs):
            run(args, kwargs)

        return inplace_fn
    return run


def _register_foreach():
    for schema in all_op_schemas():
        if not schema.name.startswith("aten::" + _PREFIX):
            continue
        packet = getattr(aten, schema.name.removeprefix("aten::"))
        func = getattr(packet, schema.overload_name or "default")
        handler(func)(_foreach_handler(func))


_register_foreach()


# ---------------------------------------------------------------------------------------
# fused Adam / AdamW


def _fused_prologue(param, grad, grad_scale, maximize):
    """Shared start of the fused optimizer kernels: opmath dtype (f16/bf16 -> float32),
    parameter and grad in it, grad unscaled by ``grad_scale``; returns (opmath, param,
    grad with ``maximize`` applied, unscaled grad to write back)."""
    opmath = jnp.promote_types(param.dtype, jnp.float32)
    p, g = param.astype(opmath), grad.astype(opmath)
    if grad_scale is not None:
        g = g / grad_scale.astype(opmath)
    return opmath, p, (-g if maximize else g), g


@functools.partial(jax.jit, static_argnames=("weight_decay", "amsgrad", "maximize", "adamw"))
def _adam_step(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    max_exp_avg_sq,
    step,
    *,
    lr,
    beta1,
    beta2,
    weight_decay,
    eps,
    amsgrad,
    maximize,
    grad_scale,
    adamw,
):
    """One parameter's update, in opmath (f16/bf16 -> float32) as the CPU kernel does."""
    opmath, p, g, new_grad = _fused_prologue(param, grad, grad_scale, maximize)
    m, v = exp_avg.astype(opmath), exp_avg_sq.astype(opmath)
    if weight_decay != 0:
        if adamw:
            p = p - lr * weight_decay * p
        else:
            g = g + weight_decay * p
    m = m + (1 - beta1) * (g - m)
    v = beta2 * v + (1 - beta2) * g * g
    step = step.astype(jnp.float64)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = jnp.sqrt(1 - beta2**step)
    step_size = (lr / bias_correction1).astype(opmath)
    vmax = None
    if amsgrad:
        vmax = jnp.maximum(max_exp_avg_sq.astype(opmath), v)
        denom = jnp.sqrt(vmax) / bias_correction2_sqrt.astype(opmath) + eps
    else:
        denom = jnp.sqrt(v) / bias_correction2_sqrt.astype(opmath) + eps
    p = p - step_size * m / denom
    return p, new_grad, m, v, vmax


def _fused_adam_handler(func, adamw: bool):
    inplace = func._opname.endswith("_")

    def run(args, kwargs):
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps = args[:6]
        grad_scale, found_inf = kwargs.get("grad_scale"), kwargs.get("found_inf")
        if not inplace:
            clone = aten.clone.default
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs = (
                [clone(t) for t in ts]
                for ts in (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
            )
        result = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
        if found_inf is not None and bool(_host_value(found_inf)):
            return None if inplace else result
        lr = kwargs["lr"]
        if isinstance(lr, torch.Tensor):
            lr = float(_host_value(lr))
        scale = None if grad_scale is None else _host_value(grad_scale)
        for i, p in enumerate(params):
            amsgrad = kwargs["amsgrad"]
            p_new, g_new, m, v, vmax = _adam_step(
                p._value(),
                grads[i]._value(),
                exp_avgs[i]._value(),
                exp_avg_sqs[i]._value(),
                max_exp_avg_sqs[i]._value() if amsgrad else None,
                _host_value(state_steps[i]),
                lr=lr,
                beta1=kwargs["beta1"],
                beta2=kwargs["beta2"],
                weight_decay=kwargs["weight_decay"],
                eps=kwargs["eps"],
                amsgrad=amsgrad,
                maximize=kwargs["maximize"],
                grad_scale=scale,
                adamw=adamw,
            )
            _write(p, p_new)
            _write(exp_avgs[i], m)
            _write(exp_avg_sqs[i], v)
            if amsgrad:
                _write(max_exp_avg_sqs[i], vmax)
            if grad_scale is not None:
                _write(grads[i], g_new)
        return None if inplace else result

    return run


@functools.partial(
    jax.jit, static_argnames=("weight_decay", "momentum", "nesterov", "maximize", "first")
)
def _sgd_step(
    param,
    grad,
    buf,
    *,
    lr,
    dampening,
    weight_decay,
    momentum,
    nesterov,
    maximize,
    first,
    grad_scale,
):
    """One parameter's fused SGD update (ATen/native/cpu/FusedSGDKernel.cpp), in opmath."""
    opmath, p, g, new_grad = _fused_prologue(param, grad, grad_scale, maximize)
    if weight_decay != 0:
        g = g + weight_decay * p
    if momentum != 0:
        buf = g if first else momentum * buf.astype(opmath) + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    return p - lr * g, new_grad, buf


def _fused_sgd_handler(func):
    inplace = func._opname.endswith("_")

    def run(args, kwargs):
        params, grads, bufs = args[:3]
        grad_scale, found_inf = kwargs.get("grad_scale"), kwargs.get("found_inf")
        if not inplace:
            params, grads, bufs = ([aten.clone.default(t) for t in ts] for ts in args[:3])
        result = (params, grads, bufs)
        if found_inf is not None and bool(_host_value(found_inf)):
            return None if inplace else result
        lr = kwargs["lr"]
        if isinstance(lr, torch.Tensor):
            lr = float(_host_value(lr))
        momentum = kwargs["momentum"]
        scale = None if grad_scale is None else _host_value(grad_scale)
        for i, p in enumerate(params):
            p_new, g_new, buf = _sgd_step(
                p._value(),
                grads[i]._value(),
                bufs[i]._value() if momentum != 0 else None,
                lr=lr,
                dampening=kwargs["dampening"],
                weight_decay=kwargs["weight_decay"],
                momentum=momentum,
                nesterov=kwargs["nesterov"],
                maximize=kwargs["maximize"],
                first=kwargs["is_first_step"],
                grad_scale=scale,
            )
            _write(p, p_new)
            if momentum != 0:
                _write(bufs[i], buf)
            if grad_scale is not None:
                _write(grads[i], g_new)
        return None if inplace else result

    return run


def _host_value(t: torch.Tensor):
    if isinstance(t, JaxTensor):
        return t._value()
    return jnp.asarray(dtypes.cpu_tensor_to_numpy(t))


def _write(t: JaxTensor, arr) -> None:
    t._write(arr.astype(dtypes.to_jax_dtype(t.dtype)))


for _packet, _adamw in (
    (aten._fused_adam_, False),
    (aten._fused_adam, False),
    (aten._fused_adamw_, True),
    (aten._fused_adamw, True),
):
    for _ov in _packet.overloads():
        if not _ov.endswith("out"):
            _func = getattr(_packet, _ov)
            handler(_func)(_fused_adam_handler(_func, _adamw))

for _packet in (aten._fused_sgd_, aten._fused_sgd):
    for _ov in _packet.overloads():
        if not _ov.endswith("out"):
            _func = getattr(_packet, _ov)
            handler(_func)(_fused_sgd_handler(_func))
