"""Convolution (1d/2d/3d, strided, dilated, grouped, transposed) and its backward.

``conv1d/2d/3d``, ``conv_transpose*`` and ``padding='same'`` are CompositeImplicitAutograd
in torch: they reach us as ``aten::convolution`` (after ``constant_pad_nd`` for an
asymmetric 'same' padding); autograd then calls ``aten::convolution_backward``.

Both lower to ``lax.conv_general_dilated`` at the float32 precision torch's
``torch.get_float32_matmul_precision()`` selects (HIGHEST by default, so float32 matches
CPU torch on GPU/TPU too; Note [Matmul precision] in matmul.py), accumulating
float16/bfloat16 in float32. A transposed convolution
is the gradient of a strided one: the input is dilated by ``stride``
(``lhs_dilation``), padded by ``dilation * (k - 1) - padding`` (plus ``output_padding`` at
the high end), and convolved with the spatially flipped kernel whose in/out channel axes
are swapped per group. The backward is ``jax.vjp`` of that same forward, so the two can
not disagree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torchjax.ops.matmul import HIGHEST, precision_for, precision_lowering

aten = torch.ops.aten

_SPATIAL = "DHW"


def _dimension_numbers(nd: int):
    sp = _SPATIAL[-nd:] if nd <= 3 else "".join(chr(ord("a") + i) for i in range(nd))
    return ("NC" + sp, "OI" + sp, "NC" + sp)


def _expand(v, nd):
    v = list(v)
    return v * nd if len(v) == 1 else v


def _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups, precision):
    """The convolution without bias, in the accumulation dtype."""
    precision = precision_for(input.dtype, precision)
    nd = weight.ndim - 2
    stride, padding = _expand(stride, nd), _expand(padding, nd)
    dilation, output_padding = _expand(dilation, nd), _expand(output_padding, nd)
    acc = jnp.float32 if input.dtype in (jnp.bfloat16, jnp.float16) else input.dtype
    if not transposed:
        return lax.conv_general_dilated(
            input,
            weight,
            window_strides=stride,
            padding=[(p, p) for p in padding],
            rhs_dilation=dilation,
            dimension_numbers=_dimension_numbers(nd),
            feature_group_count=groups,
            precision=precision,
            preferred_element_type=acc,
        )
    # weight is (C_in, C_out / groups, *k): make it (C_out, C_in / groups, *k), flipped.
    cin, cout_g, ks = weight.shape[0], weight.shape[1], weight.shape[2:]
    w = weight.reshape((groups, cin // groups, cout_g) + ks)
    w = jnp.swapaxes(w, 1, 2).reshape((groups * cout_g, cin // groups) + ks)
    w = jnp.flip(w, axis=tuple(range(2, 2 + nd)))
    pads = [
        (d * (k - 1) - p, d * (k - 1) - p + op)
        for k, p, d, op in zip(ks, padding, dilation, output_padding)
    ]
    return lax.conv_general_dilated(
        input,
        w,
        window_strides=(1,) * nd,
        padding=pads,
        lhs_dilation=stride,
        rhs_dilation=dilation,
        dimension_numbers=_dimension_numbers(nd),
        feature_group_count=groups,
        precision=precision,
        preferred_element_type=acc,
    )


def _check_params(stride, padding, dilation, groups):
    # torch's checks and texts (ConvParams in ATen's Convolution.cpp); jax would raise a
    # TypeError or a lowering error for these, or compute with negative padding.
    if any(s <= 0 for s in stride):
        raise RuntimeError("non-positive stride is not supported (in aten::convolution)")
    if any(p < 0 for p in padding):
        raise RuntimeError("negative padding is not supported (in aten::convolution)")
    if any(d <= 0 for d in dilation):
        raise RuntimeError(
            f"dilation should be greater than zero, but got {list(dilation)} (in aten::convolution)"
        )
    if groups <= 0:
        raise RuntimeError("non-positive groups is not supported (in aten::convolution)")


def _check_kernel_fits(input, weight, padding, dilation):
    # torch's check: jax would return an empty output instead.
    nd = weight.ndim - 2
    padding, dilation = _expand(padding, nd), _expand(dilation, nd)
    padded = [n + 2 * p for n, p in zip(input.shape[2:], padding)]
    kernel = [d * (k - 1) + 1 for k, d in zip(weight.shape[2:], dilation)]
    if any(p < k for p, k in zip(padded, kernel)):
        raise RuntimeError(
            f"Calculated padded input size per channel: ({' x '.join(map(str, padded))}). "
            f"Kernel size: ({' x '.join(map(str, kernel))}). Kernel size can't be greater "
            "than actual input size (in aten::convolution)"
        )


def _check(input, weight, transposed, groups):
    # check_shape_forward's checks and texts (ATen's Convolution.cpp).
    if weight.ndim < 3:
        raise RuntimeError("weight should have at least three dimensions")
    if input.ndim != weight.ndim:
        raise RuntimeError(
            f"Expected {weight.ndim}-dimensional input for {weight.ndim}-dimensional weight "
            f"{list(weight.shape)}, but got {input.ndim}-dimensional input of size "
            f"{list(input.shape)} instead"
        )
    cin = weight.shape[0] if transposed else weight.shape[1] * groups
    if input.shape[1] != cin:
        given = "transposed=1" if transposed else f"groups={groups}"
        raise RuntimeError(
            f"Given {given}, weight of size {list(weight.shape)}, expected "
            f"input{list(input.shape)} to have {cin} channels, but got {input.shape[1]} "
            "channels instead"
        )
    if input.dtype != weight.dtype:
        raise RuntimeError(
            f"aten::convolution: input type ({input.dtype}) and weight type ({weight.dtype}) "
            "should be the same"
        )


@precision_lowering(aten.convolution, aten._convolution)
def convolution(
    input,
    weight,
    bias,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    *_cudnn_flags,
    precision=HIGHEST,
):
    """aten::convolution - N-d (transposed) convolution with optional bias.

    Shapes: input (N, C_in, *spatial); weight (C_out, C_in / groups, *k) or, transposed,
    (C_in, C_out / groups, *k); bias (C_out,). Dtypes: input and weight equal (torch
    raises otherwise); f16/bf16 accumulate in float32. ``_convolution``'s cuDNN flags
    (benchmark, deterministic, cudnn_enabled, allow_tf32) do not apply here.
    Reference: torch.nn.functional.conv2d / conv_transpose2d; lax.conv_general_dilated.
    """
    _check_params(stride, padding, dilation, groups)
    _check(input, weight, transposed, groups)
    if not transposed:
        _check_kernel_fits(input, weight, padding, dilation)
    out = _conv(
        input, weight, stride, padding, dilation, transposed, output_padding, groups, precision
    )
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape((-1,) + (1,) * (out.ndim - 2))
    return out.astype(input.dtype)


@precision_lowering(aten.convolution_backward)
def convolution_backward(
    grad_output,
    input,
    weight,
    bias_sizes,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    output_mask,
    *,
    precision=HIGHEST,
):
    """aten::convolution_backward - (grad_input, grad_weight, grad_bias), each None where
    ``output_mask`` is False.

    grad_input/grad_weight: ``jax.vjp`` of the forward lowering; grad_bias: grad_output
    summed over all but the channel axis. Dtypes: those of input, weight, grad_output.
    Reference: torch/csrc/autograd derivatives.yaml (convolution)."""

    def fwd(x, w):
        return _conv(x, w, stride, padding, dilation, transposed, output_padding, groups, precision)

    out, vjp = jax.vjp(fwd, input, weight)
    gi, gw = vjp(grad_output.astype(out.dtype))
    grad_bias = None
    if output_mask[2]:
        axes = (0,) + tuple(range(2, grad_output.ndim))
        acc = jnp.float32 if grad_output.dtype in (jnp.bfloat16, jnp.float16) else None
        grad_bias = jnp.sum(grad_output, axis=axes, dtype=acc).astype(grad_output.dtype)
    return (
        gi.astype(input.dtype) if output_mask[0] else None,
        gw.astype(weight.dtype) if output_mask[1] else None,
        grad_bias,
    )
