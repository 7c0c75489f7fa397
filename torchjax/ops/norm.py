"""Normalizations (layer, group, RMS, batch) and softmax / log_softmax, with backwards.

All statistics are computed in float32 for float16/bfloat16 inputs (torch's opmath) and
the results cast back; the biased variance normalizes, as in ATen. The ``*_backward``
lowerings use the closed form over the saved mean/rstd (one helper, ``_norm_backward``):
the backward ops do not receive ``eps``, so the forward cannot be recomputed exactly.

How the functional forms arrive: ``F.layer_norm`` -> ``native_layer_norm``;
``F.group_norm`` -> ``native_group_norm``; ``F.batch_norm`` -> ``native_batch_norm``
(training: running stats updated in place); ``F.rms_norm`` is CompositeImplicitAutograd
down to pointwise ops on a non-CUDA device (``_fused_rms_norm`` is lowered here for direct
calls and compiled graphs); ``F.softmax`` -> ``_softmax`` (``half_to_float`` when a
``dtype`` upcasts a half input).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torchjax.ops.registry import handler, lowering
from torchjax.ops.writeback import write_into
from torchjax.tensor import dtypes
from torchjax.tensor._tensor import JaxTensor, wrap

aten = torch.ops.aten


def _opmath(dtype):
    return jnp.float32 if dtype in (jnp.bfloat16, jnp.float16) else dtype


def _affine(y, weight, bias, shape):
    if weight is not None:
        y = y * weight.astype(y.dtype).reshape(shape)
    if bias is not None:
        y = y + bias.astype(y.dtype).reshape(shape)
    return y


# ---------------------------------------------------------------------------------------
# layer norm


def _layer_norm(input, normalized_shape, weight, bias, eps):
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    x = input.astype(_opmath(input.dtype))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + jnp.asarray(eps, x.dtype))
    y = _affine((x - mean) * rstd, weight, bias, tuple(normalized_shape))
    return y.astype(input.dtype), mean, rstd


@lowering(aten.native_layer_norm)
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    """aten::native_layer_norm - (out, mean, rstd) over the trailing ``normalized_shape``.

    Shapes: mean/rstd are input.shape[:axis] + (1,) * len(normalized_shape). Dtypes: all
    three in input's dtype (as ATen's CPU kernel), stats computed in opmath.
    Reference: torch.nn.functional.layer_norm; torch/_decomp native_layer_norm."""
    normalized_shape = tuple(normalized_shape)
    if not normalized_shape:
        raise RuntimeError(
            "Expected normalized_shape to be at least 1-dimensional, i.e., containing at "
            "least one element, but got normalized_shape = [] (in aten::native_layer_norm)"
        )
    if tuple(input.shape[input.ndim - len(normalized_shape) :]) != normalized_shape:
        raise RuntimeError(
            f"aten::native_layer_norm: given normalized_shape={list(normalized_shape)}, "
            f"expected input with shape [*, {', '.join(map(str, normalized_shape))}], but "
            f"got input of size {list(input.shape)}"
        )
    y, mean, rstd = _layer_norm(input, normalized_shape, weight, bias, eps)
    return y, mean.astype(input.dtype), rstd.astype(input.dtype)


def _norm_backward(grad_out, xhat, rstd, g, axes, param_axes, output_mask):
    """Closed-form backward of ``y = xhat * w + b`` with ``xhat = (x - mean) * rstd``
    normalized over ``axes``: grad_x = rstd * (g - mean(g) - xhat * mean(g * xhat)), where
    ``g`` is grad_out * w. grad_w / grad_b reduce ``grad_out * xhat`` / ``grad_out`` over
    ``param_axes``. Everything in opmath; callers cast and reshape."""
    gi = gw = gb = None
    if output_mask[0]:
        gi = rstd * (
            g
            - jnp.mean(g, axis=axes, keepdims=True)
            - xhat * jnp.mean(g * xhat, axis=axes, keepdims=True)
        )
    if output_mask[1]:
        gw = jnp.sum(grad_out * xhat, axis=param_axes)
    if output_mask[2]:
        gb = jnp.sum(grad_out, axis=param_axes)
    return gi, gw, gb


def _cast_grads(grads, dtypes_):
    return tuple(None if g is None else g.astype(d) for g, d in zip(grads, dtypes_))


@lowering(aten.native_layer_norm_backward)
def native_layer_norm_backward(
    grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask
):
    """aten::native_layer_norm_backward - (grad_input, grad_weight, grad_bias), None where
    ``output_mask`` is False. Dtypes: those of input, weight, bias."""
    k = len(normalized_shape)
    axes = tuple(range(input.ndim - k, input.ndim))
    acc = _opmath(input.dtype)
    go = grad_out.astype(acc)
    xhat = (input.astype(acc) - mean.astype(acc)) * rstd.astype(acc)
    g = go if weight is None else go * weight.astype(acc)
    grads = _norm_backward(
        go, xhat, rstd.astype(acc), g, axes, tuple(range(input.ndim - k)), output_mask
    )
    wdt = input.dtype if weight is None else weight.dtype
    bdt = input.dtype if bias is None else bias.dtype
    return _cast_grads(grads, (input.dtype, wdt, bdt))


# ---------------------------------------------------------------------------------------
# group norm


@lowering(aten.native_group_norm)
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    """aten::native_group_norm - (out, mean, rstd); input (N, C, *) normalized per
    (sample, group of C / group channels). mean/rstd: (N, group), input's dtype.
    Reference: torch.nn.functional.group_norm."""
    if C % group:
        raise RuntimeError(
            f"aten::native_group_norm: expected number of channels in input to be divisible "
            f"by num_groups, but got input of shape {list(input.shape)} and num_groups={group}"
        )
    acc = _opmath(input.dtype)
    # The group size is spelled out: an empty batch (N = 0) leaves -1 nothing to infer from.
    x = input.astype(acc).reshape(N, group, (C // group) * HxW)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    rstd = lax.rsqrt(var + jnp.asarray(eps, acc))
    y = ((x - mean) * rstd).reshape(input.shape)
    y = _affine(y, weight, bias, (C,) + (1,) * (input.ndim - 2))
    return (
        y.astype(input.dtype),
        mean.reshape(N, group).astype(input.dtype),
        rstd.reshape(N, group).astype(input.dtype),
    )


@lowering(aten.native_group_norm_backward)
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    """aten::native_group_norm_backward - (grad_input, grad_weight, grad_bias) per
    ``output_mask``. Dtypes: input's (weight's for the parameter grads)."""
    acc = _opmath(input.dtype)
    go = grad_out.astype(acc).reshape(N, C, HxW)
    m = mean.astype(acc).reshape(N, group, 1, 1)
    r = rstd.astype(acc).reshape(N, group, 1, 1)
    x = input.astype(acc).reshape(N, group, C // group, HxW)
    xhat = (x - m) * r
    g = go if weight is None else go * weight.astype(acc).reshape(1, C, 1)
    gi, gw, gb = _norm_backward(
        go.reshape(N, group, C // group, HxW),
        xhat,
        r,
        g.reshape(N, group, C // group, HxW),
        (2, 3),
        (0, 3),
        output_mask,
    )
    pdt = input.dtype if weight is None else weight.dtype
    return (
        None if gi is None else gi.reshape(input.shape).astype(input.dtype),
        None if gw is None else gw.reshape(C).astype(pdt),
        None if gb is None else gb.reshape(C).astype(pdt),
    )


# ---------------------------------------------------------------------------------------
# RMS norm


@lowering(aten._fused_rms_norm)
def _fused_rms_norm(input, normalized_shape, weight, eps):
    """aten::_fused_rms_norm - (out, rstd): x * rsqrt(mean(x^2) + eps) * weight over the
    trailing ``normalized_shape``; eps None means finfo(dtype).eps. rstd in opmath, shape
    input.shape[:axis] + (1,) * k. Reference: torch.nn.functional.rms_norm."""
    k = len(normalized_shape)
    axes = tuple(range(input.ndim - k, input.ndim))
    acc = _opmath(input.dtype)
    if eps is None:
        eps = float(jnp.finfo(input.dtype).eps)
    x = input.astype(acc)
    rstd = lax.rsqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True) + jnp.asarray(eps, acc))
    y = _affine(x * rstd, weight, None, tuple(normalized_shape))
    return y.astype(input.dtype), rstd


@lowering(aten._fused_rms_norm_backward)
def _fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    """aten::_fused_rms_norm_backward - (grad_input, grad_weight) per ``output_mask``."""
    k = len(normalized_shape)
    axes = tuple(range(input.ndim - k, input.ndim))
    acc = _opmath(input.dtype)
    go, r = grad_out.astype(acc), rstd.astype(acc)
    xhat = input.astype(acc) * r
    g = go if weight is None else go * weight.astype(acc)
    gi = gw = None
    if output_mask[0]:
        gi = (r * (g - xhat * jnp.mean(g * xhat, axis=axes, keepdims=True))).astype(input.dtype)
    if output_mask[1] and weight is not None:
        gw = jnp.sum(go * xhat, axis=tuple(range(input.ndim - k))).astype(weight.dtype)
    return gi, gw


@lowering(aten._weight_norm_interface_backward)
def _weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    """aten::_weight_norm_interface_backward - (grad_v, grad_g) of w = v * g / ||v||, the
    norm over every dim but ``dim`` (0 or the last, as ATen's fused kernel allows):
    s = sum(grad_w * v) / ||v||, grad_g = s, grad_v = g / ||v|| * (grad_w - v * s / ||v||).
    Accumulated in opmath, as ATen's kernel."""
    ndim = saved_v.ndim
    if dim not in (0, ndim - 1, -1):
        raise RuntimeError("fused kernels can only be applied for first or last dim")
    dim = dim % max(ndim, 1)
    axes = tuple(a for a in range(ndim) if a != dim)
    acc = _opmath(saved_v.dtype)
    gw, v = grad_w.astype(acc), saved_v.astype(acc)
    norms = saved_norms.astype(acc).reshape([n if a == dim else 1 for a, n in enumerate(v.shape)])
    g = saved_g.astype(acc).reshape(norms.shape)
    s = jnp.sum(gw * v, axis=axes, keepdims=True) / norms
    grad_v = g / norms * (gw - v * (s / norms))
    return grad_v.astype(saved_v.dtype), s.reshape(saved_g.shape).astype(saved_g.dtype)


# ---------------------------------------------------------------------------------------
# batch norm


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """(out, save_mean, save_invstd, new_running_mean, new_running_var) in opmath.

    Training: batch statistics; the running variance is updated with the unbiased
    estimate (n / (n - 1)), as ATen. Eval: the running statistics; save_* are empty."""
    acc = _opmath(input.dtype)
    x = input.astype(acc)
    axes = (0,) + tuple(range(2, input.ndim))
    shape = (-1,) + (1,) * (input.ndim - 2)
    new_rm, new_rv = running_mean, running_var
    if training:
        mean = jnp.mean(x, axis=axes)
        var = jnp.mean(jnp.square(x - mean.reshape(shape)), axis=axes)
        invstd = lax.rsqrt(var + jnp.asarray(eps, acc))
        n = x.size // x.shape[1]
        if running_mean is not None:
            new_rm = (1 - momentum) * running_mean.astype(acc) + momentum * mean
        if running_var is not None:
            unbiased = var * (n / max(n - 1, 1))
            new_rv = (1 - momentum) * running_var.astype(acc) + momentum * unbiased
        save_mean, save_invstd = mean, invstd
    else:
        mean = running_mean.astype(acc)
        invstd = lax.rsqrt(running_var.astype(acc) + jnp.asarray(eps, acc))
        save_mean = save_invstd = jnp.zeros((0,), acc)
    y = (x - mean.reshape(shape)) * invstd.reshape(shape)
    y = _affine(y, weight, bias, shape)
    return y.astype(input.dtype), save_mean, save_invstd, new_rm, new_rv


def _check_batch_norm(name, input, training):
    if training and input.size // max(input.shape[1], 1) <= 1 and input.size:
        raise ValueError(
            f"aten::{name}: expected more than 1 value per channel when training, got input "
            f"size {list(input.shape)}"
        )


def _stat_dtype(input, weight, running_mean):
    # ATen's CPU kernel keeps the statistics in the parameters' dtype for mixed inputs
    # (bf16 input, float32 weight/running stats) and in the input's dtype otherwise.
    for p in (weight, running_mean):
        if p is not None and p.dtype != input.dtype:
            return p.dtype
    return input.dtype


_BN_ARGS = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")


def _batch_norm_handler(name, arg_names):
    """fn(args, kwargs) for the batch-norm overloads that update the running statistics
    in place: computed by ``_batch_norm``, written back through the registry (so views of
    the running buffers see the update)."""
    func = getattr(aten, name)
    with_update = "training" not in arg_names  # _batch_norm_with_update: always training

    def run(args, kwargs):
        bound = dict(zip(arg_names, args), **kwargs)
        if with_update:
            bound["training"] = True
        arrs = {k: v._value() if isinstance(v, JaxTensor) else v for k, v in bound.items()}
        for k, v in arrs.items():
            if isinstance(v, torch.Tensor):
                raise RuntimeError(
                    f"aten::{name}: expected {k} on tpu like input, got a {v.device} tensor; "
                    "move it with .to('tpu')"
                )
        _check_batch_norm(name, arrs["input"], bound["training"])
        y, sm, si, rm, rv = _batch_norm(
            arrs["input"],
            arrs["weight"],
            arrs["bias"],
            arrs["running_mean"],
            arrs["running_var"],
            bound["training"],
            bound["momentum"],
            bound["eps"],
        )
        if bound["training"]:
            for t, new in ((bound["running_mean"], rm), (bound["running_var"], rv)):
                if t is not None:
                    write_into(func, t, wrap(new.astype(dtypes.to_jax_dtype(t.dtype))))
        sdt = _stat_dtype(arrs["input"], arrs["weight"], arrs["running_mean"])
        index = bound["input"]._device_index
        out = (wrap(y, index), wrap(sm.astype(sdt), index), wrap(si.astype(sdt), index))
        if with_update:
            out += (wrap(jnp.zeros((0,), jnp.uint8), index),)
        return out

    return run


handler(aten.native_batch_norm.default)(_batch_norm_handler("native_batch_norm", _BN_ARGS))
handler(aten._native_batch_norm_legit.default)(
    _batch_norm_handler("_native_batch_norm_legit", _BN_ARGS)
)
handler(aten._batch_norm_with_update.default)(
    _batch_norm_handler("_batch_norm_with_update", tuple(a for a in _BN_ARGS if a != "training"))
)


@lowering(aten._batch_norm_no_update)
def _batch_norm_no_update(input, weight, bias, running_mean, running_var, momentum, eps):
    """aten::_batch_norm_no_update - eval-mode batch norm; 4th output an empty uint8
    reserve (cuDNN workspace in ATen), statistics outputs empty."""
    y, sm, si = _native_batch_norm_legit_no_training(
        input, weight, bias, running_mean, running_var, momentum, eps
    )
    return y, sm, si, jnp.zeros((0,), jnp.uint8)


@lowering(aten._native_batch_norm_legit.no_stats)
def _native_batch_norm_legit_no_stats(input, weight, bias, training, momentum, eps):
    """aten::_native_batch_norm_legit.no_stats - batch norm without running statistics."""
    _check_batch_norm("_native_batch_norm_legit", input, training)
    y, sm, si, _, _ = _batch_norm(input, weight, bias, None, None, True, momentum, eps)
    sdt = _stat_dtype(input, weight, None)
    return y, sm.astype(sdt), si.astype(sdt)


@lowering(aten._native_batch_norm_legit_functional)
def _native_batch_norm_legit_functional(
    input, weight, bias, running_mean, running_var, training, momentum, eps
):
    """aten::_native_batch_norm_legit_functional - batch norm returning the updated running
    statistics instead of writing them (what compiled graphs use)."""
    _check_batch_norm("_native_batch_norm_legit_functional", input, training)
    y, sm, si, rm, rv = _batch_norm(
        input, weight, bias, running_mean, running_var, training, momentum, eps
    )
    sdt = _stat_dtype(input, weight, running_mean)
    return (
        y,
        sm.astype(sdt),
        si.astype(sdt),
        rm.astype(running_mean.dtype),
        rv.astype(running_var.dtype),
    )


@lowering(aten._native_batch_norm_legit_no_training)
def _native_batch_norm_legit_no_training(
    input, weight, bias, running_mean, running_var, momentum, eps
):
    """aten::_native_batch_norm_legit_no_training - eval-mode batch norm (running stats)."""
    y, sm, si, _, _ = _batch_norm(
        input, weight, bias, running_mean, running_var, False, momentum, eps
    )
    sdt = _stat_dtype(input, weight, running_mean)
    return y, sm.astype(sdt), si.astype(sdt)


@lowering(aten.native_batch_norm_backward)
def native_batch_norm_backward(
    grad_out,
    input,
    weight,
    running_mean,
    running_var,
    save_mean,
    save_invstd,
    train,
    eps,
    output_mask,
):
    """aten::native_batch_norm_backward - (grad_input, grad_weight, grad_bias) per
    ``output_mask``. Training: through the batch statistics (save_mean/save_invstd); eval:
    the running statistics are constants, so grad_input = grad_out * w * invstd."""
    acc = _opmath(input.dtype)
    shape = (-1,) + (1,) * (input.ndim - 2)
    axes = (0,) + tuple(range(2, input.ndim))
    go, x = grad_out.astype(acc), input.astype(acc)
    if train:
        mean, invstd = save_mean.astype(acc), save_invstd.astype(acc)
    else:
        mean = running_mean.astype(acc)
        invstd = lax.rsqrt(running_var.astype(acc) + jnp.asarray(eps, acc))
    mean, invstd = mean.reshape(shape), invstd.reshape(shape)
    xhat = (x - mean) * invstd
    g = go if weight is None else go * weight.astype(acc).reshape(shape)
    gi, gw, gb = _norm_backward(go, xhat, invstd, g, axes, axes, output_mask)
    if gi is not None and not train:
        gi = g * invstd
    pdt = input.dtype if weight is None else weight.dtype
    return _cast_grads((gi, gw, gb), (input.dtype, pdt, pdt))


@lowering(aten.batch_norm_backward)
def batch_norm_backward(
    grad_out,
    input,
    weight,
    running_mean,
    running_var,
    save_mean,
    save_var,
    update,
    eps,
    output_mask,
    reserve,
):
    """aten::batch_norm_backward - backward of ``_batch_norm_with_update`` /
    ``_batch_norm_no_update``; ``save_var`` holds the inverse std, as in ATen's CPU kernel."""
    return native_batch_norm_backward(
        grad_out,
        input,
        weight,
        running_mean,
        running_var,
        save_mean,
        save_var,
        update,
        eps,
        output_mask,
    )


# ---------------------------------------------------------------------------------------
# softmax


def _softmax_dtype(self, half_to_float):
    if half_to_float and self.dtype not in (jnp.bfloat16, jnp.float16):
        raise RuntimeError(
            f"aten::_softmax: conversion from {self.dtype} to float32 (half_to_float=True) is "
            "only supported for float16/bfloat16 inputs"
        )
    return jnp.float32 if half_to_float else self.dtype


def _check_dim(name, self, dim):
    n = max(self.ndim, 1)
    if not -n <= dim < n:
        raise IndexError(
            f"aten::{name}: dimension out of range (expected to be in range of "
            f"[{-n}, {n - 1}], but got {dim})"
        )
    return dim % n


@lowering(aten._softmax)
def _softmax(self, dim, half_to_float):
    """aten::_softmax - exp(x - max) / sum along ``dim``; 0-d allowed (dim 0 or -1).

    Dtypes: floating; f16/bf16 computed in float32, result float32 when ``half_to_float``
    else the input dtype. Reference: torch.softmax; jax.nn.softmax."""
    out_dtype = _softmax_dtype(self, half_to_float)
    dim = _check_dim("_softmax", self, dim)
    x = self.astype(_opmath(self.dtype)).reshape(self.shape or (1,))
    return jax.nn.softmax(x, axis=dim).reshape(self.shape).astype(out_dtype)


@lowering(aten._log_softmax)
def _log_softmax(self, dim, half_to_float):
    """aten::_log_softmax - x - logsumexp(x) along ``dim``; dtypes as ``_softmax``."""
    out_dtype = _softmax_dtype(self, half_to_float)
    dim = _check_dim("_log_softmax", self, dim)
    x = self.astype(_opmath(self.dtype)).reshape(self.shape or (1,))
    return jax.nn.log_softmax(x, axis=dim).reshape(self.shape).astype(out_dtype)


@lowering(aten._softmax_backward_data)
def _softmax_backward_data(grad_output, output, dim, input_dtype):
    """aten::_softmax_backward_data - y * (g - sum(g * y, dim)); result ``input_dtype``."""
    acc = _opmath(output.dtype)
    g, y = grad_output.astype(acc), output.astype(acc)
    dim = _check_dim("_softmax_backward_data", output, dim) if output.ndim else None
    gi = y * (g - jnp.sum(g * y, axis=dim, keepdims=True))
    return gi.astype(dtypes.to_jax_dtype(input_dtype))


@lowering(aten._log_softmax_backward_data)
def _log_softmax_backward_data(grad_output, output, dim, input_dtype):
    """aten::_log_softmax_backward_data - g - exp(y) * sum(g, dim); result ``input_dtype``."""
    acc = _opmath(output.dtype)
    g, y = grad_output.astype(acc), output.astype(acc)
    dim = _check_dim("_log_softmax_backward_data", output, dim) if output.ndim else None
    gi = g - jnp.exp(y) * jnp.sum(g, axis=dim, keepdims=True)
    return gi.astype(dtypes.to_jax_dtype(input_dtype))
