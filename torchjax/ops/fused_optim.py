"""The fused optimizer kernels: ``_fused_adam(w)_`` and ``_fused_sgd_``.

They follow ATen/native/cpu/Fused{Adam,SGD}Kernel.cpp: one jitted jax computation for
all parameters of the step (Note [One fused optimizer step]), with ``grad_scale`` (grads
unscaled and written back) and ``found_inf`` (a nonzero value skips the step; applied on
device, never read back).

torch.optim's default for tpu parameters is the single-tensor loop (foreach=False:
``_default_to_fused_or_foreach`` accepts only exact ``torch.Tensor``/``Parameter``
types); pass ``fused=True`` (one executable per step) or ``foreach=True``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torchjax.ops import executables
from torchjax.ops.pointwise_binary import exact_div
from torchjax.ops.pointwise_ternary import fma
from torchjax.ops.registry import handler
from torchjax.tensor import dtypes
from torchjax.tensor._tensor import JaxTensor

aten = torch.ops.aten


def _fused_prologue(param, grad, grad_scale, maximize):
    """Shared start of the fused optimizer kernels: opmath dtype (f16/bf16 -> float32),
    parameter and grad in it, grad unscaled by ``grad_scale``; returns (opmath, param,
    grad with ``maximize`` applied, unscaled grad to write back)."""
    opmath = jnp.promote_types(param.dtype, jnp.float32)
    p, g = param.astype(opmath), grad.astype(opmath)
    if grad_scale is not None:
        g = exact_div(g, grad_scale.astype(opmath))
    return opmath, p, (-g if maximize else g), g


# Note [Fused Adam as CPU computes it]
# ``_fused_adam(w)_`` follows the vectorised body of ATen's CPU kernel
# (native/cpu/FusedAdamKernel.cpp) operation by operation, so that parameters and moments
# equal CPU's bit for bit in float32 and the half types (float64: within one rounding):
# - hyperparameters are doubles rounded once to opmath (float32 for f16/bf16), and the
#   step size and bias corrections are computed in double;
# - AdamW decays as ``param * (1 - lr * weight_decay)``, Adam adds ``param * wd`` to the
#   grad in one FMA;
# - ``exp_avg.lerp_(grad, 1 - beta1)`` is a blend and an FMA: ``fma(w, g - m, m)`` for
#   ``|w| < 0.5``, else ``fma(w - 1, g - m, g)``;
# - ``exp_avg_sq`` is ``fma(c * g, g, v * beta2)``, the contraction CPU's compiler makes;
# - ``param + (-step_size * m) / (sqrt(v) / bias_correction2_sqrt + eps)``.
# XLA:CPU would otherwise rewrite some of these: it folds ``(1 - beta1) - 1`` to
# ``-beta1`` and its LLVM backend contracts other products into FMAs; ``_opaque`` hides
# those values behind a runtime no-op. Other platforms compute the same formulas as
# their compilers see fit.


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
    """One parameter's update as CPU's fused kernel computes it (Note [Fused Adam as
    CPU computes it]); in opmath (f16/bf16 -> float32)."""
    opmath, p, g, new_grad = _fused_prologue(param, grad, grad_scale, maximize)
    m, v = exp_avg.astype(opmath), exp_avg_sq.astype(opmath)

    def const(x):  # a double hyperparameter, rounded once to opmath as the kernel does
        return jnp.asarray(x, jnp.float64).astype(opmath)

    decay = None
    if weight_decay != 0:
        if adamw:
            decay = const(1 - lr * weight_decay)
        else:
            g = fma(p, const(weight_decay), g)
    # exp_avg.lerp_(grad, 1 - beta1), in CPU's blend-and-FMA form
    zero = (step < 0).astype(jnp.uint8)  # a runtime 0 (see _opaque)
    w = _opaque(const(1 - beta1), zero)
    small = jnp.abs(w) < 0.5
    m = fma(jnp.where(small, w, w - 1), g - m, jnp.where(small, m, g))
    v = fma(_opaque(const(1 - beta2) * g, zero), g, _opaque(v * const(beta2), zero))
    step = step.astype(jnp.float64)
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = jnp.sqrt(1 - beta2**step)
    vmax = None
    if amsgrad:
        vmax = jnp.maximum(max_exp_avg_sq.astype(opmath), v)
    denom = exact_div(jnp.sqrt(v if vmax is None else vmax), const(bias_correction2_sqrt))
    delta = exact_div(const(-step_size) * m, denom + const(eps))
    p = p + delta if decay is None else _opaque(p * decay, zero) + delta
    return p, new_grad, m, v, vmax


def _opaque(x, zero):
    """``x`` as a value XLA:CPU cannot rewrite: or-ing its bits with ``zero``, a runtime
    0, leaves it as it is. XLA folds ``(1 - beta1) - 1`` to ``-beta1`` (not the same
    double), and its LLVM backend fuses a product and the sum it feeds into one FMA,
    after folding a float64 detour or an optimization barrier away, where CPU's kernel
    rounds the product first."""

    def hide(x, zero):
        bits = jnp.uint64 if x.dtype == jnp.float64 else jnp.uint32
        word = jax.lax.bitcast_convert_type(x, bits) | zero.astype(bits)
        return jax.lax.bitcast_convert_type(word, x.dtype)

    return jax.lax.platform_dependent(x, zero, cpu=hide, default=lambda x, zero: x)


def _skip_if(found_inf, new, old):
    """``old`` where ``found_inf`` is nonzero (the kernels then return before writing
    anything), else ``new`` cast to ``old``'s dtype; chosen on device, no host read."""
    if new is None:
        return None
    new = new.astype(old.dtype)
    return new if found_inf is None else jnp.where(found_inf != 0, old, new)


# Note [One fused optimizer step]
# ``_fused_adam(w)_`` and ``_fused_sgd_`` update every parameter of a param group in one
# executable of the overload's table (Note [One executable table]; the lists are its
# arguments, keyed by their tree, shapes and dtypes): one
# XLA dispatch per optimizer step instead of one per tensor. Hyperparameters that change
# the computation (weight_decay == 0, amsgrad, maximize, momentum, nesterov, first step)
# are static; lr (float or tensor), betas, eps and the state steps are arguments, so an
# lr schedule does not recompile. ``found_inf`` is applied on device with a select
# (nothing is read back to the host): the values written are the old ones.


_ADAM_STATIC = ("weight_decay", "amsgrad", "maximize", "adamw")


def _adam_multi(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, grad_scale, found_inf, **hyper
):
    outs = [
        _adam_step(p, g, m, v, vm, st, grad_scale=grad_scale, **hyper)
        for p, g, m, v, vm, st in zip(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
    ]
    return [
        tuple(_skip_if(found_inf, new, old) for new, old in zip(out, (p, g, m, v, vm)))
        for out, p, g, m, v, vm in zip(outs, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
    ]


def _fused_adam_handler(func, adamw: bool):
    inplace = func._opname.endswith("_")
    adam_multi = executables.TreeRun(func, _adam_multi, _ADAM_STATIC)

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
        if not params:
            return None if inplace else result
        if _shared_across_elements(result):
            # Note [A fused step over shared tensors runs tensor by tensor]
            for i in range(len(params)):
                amsgrad_i = [max_exp_avg_sqs[i]] if max_exp_avg_sqs else []
                one = ([params[i]], [grads[i]], [exp_avgs[i]], [exp_avg_sqs[i]], amsgrad_i)
                run(one + ([state_steps[i]],), kwargs)
            return None if inplace else result
        lr = kwargs["lr"]
        if isinstance(lr, torch.Tensor):
            lr = _host_value(lr)
        amsgrad = kwargs["amsgrad"]
        outs = adam_multi(
            [t._value() for t in params],
            [t._value() for t in grads],
            [t._value() for t in exp_avgs],
            [t._value() for t in exp_avg_sqs],
            [t._value() for t in max_exp_avg_sqs] if amsgrad else [None] * len(params),
            [_host_value(t) for t in state_steps],
            None if grad_scale is None else _host_value(grad_scale),
            None if found_inf is None else _host_value(found_inf),
            lr=lr,
            beta1=kwargs["beta1"],
            beta2=kwargs["beta2"],
            weight_decay=kwargs["weight_decay"],
            eps=kwargs["eps"],
            amsgrad=amsgrad,
            maximize=kwargs["maximize"],
            adamw=adamw,
        )
        for i, (p_new, g_new, m, v, vmax) in enumerate(outs):
            params[i]._write(p_new)
            exp_avgs[i]._write(m)
            exp_avg_sqs[i]._write(v)
            if amsgrad:
                max_exp_avg_sqs[i]._write(vmax)
            if grad_scale is not None:
                grads[i]._write(g_new)
        return None if inplace else result

    return run


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
    """One parameter's fused SGD update as CPU's vectorised kernel computes it
    (ATen/native/cpu/FusedSGDKernel.cpp), in opmath, with its FMAs (Note [Fused Adam as
    CPU computes it] says why the products are hidden)."""
    opmath, p, g, new_grad = _fused_prologue(param, grad, grad_scale, maximize)

    def const(x):  # a double hyperparameter, rounded once to opmath as the kernel does
        return jnp.asarray(x, jnp.float64).astype(opmath)

    zero = jnp.isnan(lr).astype(jnp.uint8)  # a runtime 0 (see _opaque)
    if weight_decay != 0:
        g = fma(p, const(weight_decay), g)
    if momentum != 0:
        if not first:
            kept = _opaque(buf.astype(opmath) * const(momentum), zero)
            buf = fma(const(1 - dampening), g, kept)
        else:
            buf = g
        g = fma(buf, const(momentum), g) if nesterov else buf
    return fma(g, const(-lr), p), new_grad, buf


_SGD_STATIC = ("weight_decay", "momentum", "nesterov", "maximize", "first")


def _sgd_multi(params, grads, bufs, grad_scale, found_inf, **hyper):
    """Every parameter's fused SGD update (Note [One fused optimizer step])."""
    out = []
    for p, g, b in zip(params, grads, bufs):
        p_new, g_new, b_new = _sgd_step(p, g, b, grad_scale=grad_scale, **hyper)
        out.append(
            (
                _skip_if(found_inf, p_new, p),
                _skip_if(found_inf, g_new, g),
                None if b is None else _skip_if(found_inf, b_new, b),
            )
        )
    return out


def _fused_sgd_handler(func):
    inplace = func._opname.endswith("_")
    sgd_multi = executables.TreeRun(func, _sgd_multi, _SGD_STATIC)

    def run(args, kwargs):
        params, grads, bufs = args[:3]
        grad_scale, found_inf = kwargs.get("grad_scale"), kwargs.get("found_inf")
        if not inplace:
            params, grads, bufs = ([aten.clone.default(t) for t in ts] for ts in args[:3])
        result = (params, grads, bufs)
        if not params:
            return None if inplace else result
        if _shared_across_elements(result):
            # Note [A fused step over shared tensors runs tensor by tensor]
            for i in range(len(params)):
                one = ([params[i]], [grads[i]], [bufs[i]] if bufs else [])
                run(one, kwargs)
            return None if inplace else result
        lr = kwargs["lr"]
        if isinstance(lr, torch.Tensor):
            lr = _host_value(lr)
        momentum = kwargs["momentum"]
        outs = sgd_multi(
            [t._value() for t in params],
            [t._value() for t in grads],
            [t._value() for t in bufs] if momentum != 0 else [None] * len(params),
            None if grad_scale is None else _host_value(grad_scale),
            None if found_inf is None else _host_value(found_inf),
            lr=lr,
            dampening=kwargs["dampening"],
            weight_decay=kwargs["weight_decay"],
            momentum=momentum,
            nesterov=kwargs["nesterov"],
            maximize=kwargs["maximize"],
            first=kwargs["is_first_step"],
        )
        for i, (p_new, g_new, buf) in enumerate(outs):
            params[i]._write(p_new)
            if momentum != 0:
                bufs[i]._write(buf)
            if grad_scale is not None:
                grads[i]._write(g_new)
        return None if inplace else result

    return run


# Note [A fused step over shared tensors runs tensor by tensor]
# CPU's fused Adam, AdamW and SGD kernels update their lists' tensors one after another,
# so a tensor listed twice (a parameter group naming a parameter twice, which torch.optim
# only warns about) is updated twice, the second time from the first's result, and a
# tensor that is another element's gradient reads that element's update. One program
# over the lists reads every old value first: the duplicate got one update, silently.
# So when a tensor's storage appears at two positions of the lists, the step runs as one
# call per position, in order. (The functional overloads clone every list first: nothing
# is shared there, and each element is updated from the old values, as on CPU.)
def _shared_across_elements(lists) -> bool:
    owner: dict = {}
    for ts in lists:
        for i, t in enumerate(ts):
            s = getattr(t, "_storage", None)
            if s is not None and owner.setdefault(id(s), i) != i:
                return True
    return False


def _host_value(t: torch.Tensor):
    if isinstance(t, JaxTensor):
        return t._value()
    return jnp.asarray(dtypes.cpu_tensor_to_numpy(t))


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
