"""Pooling lowerings: max / avg / adaptive / fractional pools and their backward ops.

All pools here are N-d over the trailing 1-3 spatial dims of a (N, C, *spatial) or
(C, *spatial) input. Windows are gathered with static index arrays (one per spatial dim,
numpy, computed at trace time), so max pools get torch's argmax-in-window indices for free;
average pools sum with ``lax.reduce_window`` and divide by a static count array. Backward
ops: max-type pools scatter-add ``grad_output`` at the saved indices; average pools are the
``jax.vjp`` of the forward lowering (they are linear).

Under jit: nothing here reads array values; the fractional pools' window starts depend on
``random_samples`` and are computed with jnp. ``max_unpool2d``/``max_unpool3d`` (torch's
decompositions) check their indices on the device (``_max_unpool_indices``): deferred, as
CUDA's kernels assert, with CPU's text; under ``torchjax.jit`` the compiled call reports it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.device import _checks
from torchjax.ops.registry import lowering, precheck
from torchjax.ops.schema import arg
from torchjax.tensor._tensor import JaxTensor

aten = torch.ops.aten


def _tuple(v, nd, default=None):
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return tuple(default) if default is not None else None
    if isinstance(v, int):
        return (v,) * nd
    v = tuple(v)
    return v * nd if len(v) == 1 else v


def _opmath(x):
    return x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x


def _lowest(dtype):
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.array(-jnp.inf, dtype=dtype)
    return jnp.array(jnp.iinfo(dtype).min, dtype=dtype)


def _pool_out_size(size, k, s, p, d, ceil_mode, op):
    num = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)
    out = num // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    if out <= 0:
        raise RuntimeError(
            f"{op}: given input spatial size {size} with kernel {k}, stride {s}, padding {p}, "
            f"dilation {d}, the output size {out} is too small"
        )
    return out


def _check_pool_args(op, x, nd, k, s, p):
    if x.ndim not in (nd + 1, nd + 2) or any(n == 0 for n in x.shape[-nd:]):
        raise RuntimeError(
            f"{op}: expected {nd + 1}D or {nd + 2}D input with non-zero spatial sizes, "
            f"got shape {tuple(x.shape)}"
        )
    if any(pi > ki // 2 for pi, ki in zip(p, k)):
        raise RuntimeError(
            f"{op}: pad should be at most half of effective kernel size, "
            f"got padding={list(p)}, kernel_size={list(k)}"
        )
    if any(si <= 0 for si in s) or any(ki <= 0 for ki in k):
        raise RuntimeError(
            f"{op}: kernel_size and stride must be positive, got {list(k)}, {list(s)}"
        )


def _window_max(x, index_arrays, valid_masks, op):
    """Max over windows given per-dim (out_d, K_d) index arrays into the spatial dims.

    Returns (values, flat spatial indices as int64), torch's first-max-in-window rule.
    """
    nd = len(index_arrays)
    spatial = x.shape[-nd:]
    lead = x.shape[:-nd]
    # Broadcast the per-dim index arrays to (o_1..o_nd, k_1..k_nd).
    idx, mask = [], None
    for d, (ia, m) in enumerate(zip(index_arrays, valid_masks)):
        shape = [1] * (2 * nd)
        shape[d] = ia.shape[0]
        shape[nd + d] = ia.shape[1]
        idx.append(ia.reshape(shape))
        mm = m.reshape(shape)
        mask = mm if mask is None else mask & mm
    patches = x[(Ellipsis, *[jnp.asarray(np.clip(i, 0, n - 1)) for i, n in zip(idx, spatial)])]
    patches = jnp.where(jnp.asarray(mask), patches, _lowest(x.dtype))
    out_shape = patches.shape[len(lead) : len(lead) + nd]
    patches = patches.reshape(*lead, *out_shape, -1)
    arg = jnp.argmax(patches, axis=-1)
    values = jnp.take_along_axis(patches, arg[..., None], axis=-1)[..., 0]
    flat = np.zeros(mask.shape, dtype=np.int64)
    for i, n in zip(idx, spatial):
        flat = flat * n + i
    flat = jnp.asarray(np.broadcast_to(flat, mask.shape).reshape(*out_shape, -1))
    flat = jnp.broadcast_to(flat, (*lead, *out_shape, flat.shape[-1]))
    indices = jnp.take_along_axis(flat, arg[..., None], axis=-1)[..., 0]
    return values, indices


def _max_pool_with_indices(op, nd, self, kernel_size, stride, padding, dilation, ceil_mode):
    k = _tuple(kernel_size, nd)
    s = _tuple(stride, nd, default=k)
    p = _tuple(padding, nd)
    d = _tuple(dilation, nd)
    _check_pool_args(op, self, nd, k, s, p)
    arrays, masks = [], []
    for n, ki, si, pi, di in zip(self.shape[-nd:], k, s, p, d):
        out = _pool_out_size(n, ki, si, pi, di, ceil_mode, op)
        ia = np.arange(out)[:, None] * si - pi + np.arange(ki)[None, :] * di
        arrays.append(ia)
        masks.append((ia >= 0) & (ia < n))
    return _window_max(self, arrays, masks, op)


@lowering(aten.max_pool2d_with_indices)
def max_pool2d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """aten::max_pool2d_with_indices - 2-d max pool and the flat (H*W) argmax per window.

    Shapes: (N, C, H, W) or (C, H, W) -> (N, C, Ho, Wo) twice. Dtypes: values keep self's
    dtype, indices int64. Ties pick the first element in window order, as ATen's CPU kernel.
    Padding never wins (it is -inf). Reference: ATen DilatedMaxPool2d.cpp.
    """
    return _max_pool_with_indices(
        "aten::max_pool2d_with_indices", 2, self, kernel_size, stride, padding, dilation, ceil_mode
    )


@lowering(aten.max_pool3d_with_indices)
def max_pool3d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """aten::max_pool3d_with_indices - 3-d max pool and the flat (D*H*W) argmax per window.

    Shapes: (N, C, D, H, W) or (C, D, H, W). Dtypes: as max_pool2d_with_indices.
    Reference: ATen DilatedMaxPool3d.cpp.
    """
    return _max_pool_with_indices(
        "aten::max_pool3d_with_indices", 3, self, kernel_size, stride, padding, dilation, ceil_mode
    )


def _max_backward(nd):
    """grad_input for a max-type pool: grad_output added at the saved flat indices."""

    def fn(grad_output, self, indices):
        n_lead = self.ndim - nd
        rows = math.prod(self.shape[:n_lead])
        plane = math.prod(self.shape[n_lead:])
        g = grad_output.reshape(rows, -1)
        idx = indices.reshape(rows, -1)
        out = jnp.zeros((rows, plane), dtype=grad_output.dtype)
        out = out.at[jnp.arange(rows)[:, None], idx].add(g, mode="drop")
        return out.reshape(self.shape)

    return fn


def _max_pool_backward(nd):
    def fn(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
        """aten::max_pool{2,3}d_with_indices_backward - scatter-add grad_output at indices.

        Shapes: grad_output/indices as the forward outputs; result has self's shape and
        grad_output's dtype. Windows that picked the same element add up, as in ATen.
        """
        return _max_backward(nd)(grad_output, self, indices)

    return fn


lowering(aten.max_pool2d_with_indices_backward)(_max_pool_backward(2))
lowering(aten.max_pool3d_with_indices_backward)(_max_pool_backward(3))


@lowering(aten.adaptive_max_pool2d_backward)
def adaptive_max_pool2d_backward(grad_output, self, indices):
    """aten::adaptive_max_pool2d_backward - scatter-add grad_output at the saved indices."""
    return _max_backward(2)(grad_output, self, indices)


@lowering(aten.adaptive_max_pool3d_backward)
def adaptive_max_pool3d_backward(grad_output, self, indices):
    """aten::adaptive_max_pool3d_backward - scatter-add grad_output at the saved indices."""
    return _max_backward(3)(grad_output, self, indices)


@lowering(aten.fractional_max_pool2d_backward)
def fractional_max_pool2d_backward(grad_output, self, kernel_size, output_size, indices):
    """aten::fractional_max_pool2d_backward - scatter-add grad_output at the saved indices."""
    return _max_backward(2)(grad_output, self, indices)


@lowering(aten.fractional_max_pool3d_backward)
def fractional_max_pool3d_backward(grad_output, self, kernel_size, output_size, indices):
    """aten::fractional_max_pool3d_backward - scatter-add grad_output at the saved indices."""
    return _max_backward(3)(grad_output, self, indices)


# ---------------------------------------------------------------------------------------
# average pools


def _avg_pool(
    op, nd, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
):
    k = _tuple(kernel_size, nd)
    s = _tuple(stride, nd, default=k)
    p = _tuple(padding, nd)
    for pi in p:
        if pi < 0:
            raise RuntimeError(f"pad must be non-negative, but got pad: {pi} (in {op})")
    _check_pool_args(op, self, nd, k, s, p)
    if divisor_override is not None and divisor_override == 0:
        raise RuntimeError(f"{op}: divisor must be not zero")
    lead = self.ndim - nd
    pads, counts = [(0, 0, 0)] * lead, []
    for n, ki, si, pi in zip(self.shape[-nd:], k, s, p):
        out = _pool_out_size(n, ki, si, pi, 1, ceil_mode, op)
        pads.append((pi, (out - 1) * si + ki - n - pi, 0))
        start = np.arange(out) * si - pi
        end = np.minimum(start + ki, n + pi)
        if not count_include_pad:
            start, end = np.maximum(start, 0), np.minimum(end, n)
        counts.append(end - start)
    x = _opmath(self)
    summed = lax.reduce_window(
        lax.pad(x, np.array(0, dtype=x.dtype), pads),
        np.array(0, dtype=x.dtype),
        lax.add,
        (1,) * lead + k,
        (1,) * lead + s,
        "VALID",
    )
    if divisor_override is not None:
        div = np.asarray(divisor_override)
    else:
        div = counts[0]
        for c in counts[1:]:
            div = np.multiply.outer(div, c)
    if jnp.issubdtype(x.dtype, jnp.integer):
        # ATen divides integer sums with C++ integer division (truncation toward zero).
        return lax.div(summed, jnp.asarray(div, dtype=x.dtype) + jnp.zeros_like(summed))
    return (summed / jnp.asarray(div, dtype=x.dtype)).astype(self.dtype)


@lowering(aten.avg_pool2d)
def avg_pool2d(
    self,
    kernel_size,
    stride=(),
    padding=0,
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
):
    """aten::avg_pool2d - 2-d average pool.

    Shapes: (N, C, H, W) or (C, H, W). Dtypes: f16/bf16 summed in float32; integers divide
    with truncation as ATen. The divisor counts padding (count_include_pad, clipped at the
    padded edge under ceil_mode) or only real elements, or is divisor_override.
    Reference: ATen AvgPoolKernel.cpp.
    """
    return _avg_pool(
        "aten::avg_pool2d",
        2,
        self,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
    )


@lowering(aten.avg_pool3d)
def avg_pool3d(
    self,
    kernel_size,
    stride=(),
    padding=0,
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
):
    """aten::avg_pool3d - 3-d average pool; as avg_pool2d over (D, H, W)."""
    return _avg_pool(
        "aten::avg_pool3d",
        3,
        self,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
    )


def _vjp(fn, x, grad):
    _, pullback = jax.vjp(fn, x)
    return pullback(grad.astype(x.dtype))[0]


def _avg_pool_backward(nd):
    def fn(
        grad_output,
        self,
        kernel_size,
        stride,
        padding,
        ceil_mode,
        count_include_pad,
        divisor_override,
    ):
        """aten::avg_pool{2,3}d_backward - the vjp of the (linear) forward lowering.

        Dtypes: computed in float32 for f16/bf16, result in grad_output's dtype.
        """
        op = f"aten::avg_pool{nd}d_backward"
        g = _vjp(
            lambda x: _avg_pool(
                op,
                nd,
                x,
                kernel_size,
                stride,
                padding,
                ceil_mode,
                count_include_pad,
                divisor_override,
            ),
            _opmath(self),
            _opmath(grad_output),
        )
        return g.astype(grad_output.dtype)

    return fn


lowering(aten.avg_pool2d_backward)(_avg_pool_backward(2))
lowering(aten.avg_pool3d_backward)(_avg_pool_backward(3))


# ---------------------------------------------------------------------------------------
# adaptive pools


def _adaptive_bounds(n, out):
    o = np.arange(out)
    return (o * n) // out, -((-(o + 1) * n) // out)


def _check_adaptive(op, self, output_size, nd):
    if self.ndim not in (nd + 1, nd + 2) or any(n == 0 for n in self.shape[-nd:]):
        raise RuntimeError(
            f"{op}: expected {nd + 1}D or {nd + 2}D input with non-zero spatial sizes, "
            f"got shape {tuple(self.shape)}"
        )
    if len(output_size) != nd:
        raise RuntimeError(f"{op}: output_size must be {nd}, got {list(output_size)}")


def _adaptive_avg(op, self, output_size):
    """Each output is the sum of its window divided by the window's size per dim, as
    ATen's kernel computes it. The windows are gathered (padding masked out), so a NaN
    or inf reaches only the windows that hold it."""
    nd = len(output_size)
    _check_adaptive(op, self, output_size, nd)
    lead = self.ndim - nd
    if 0 in output_size:  # no windows: an empty result, as CPU
        return jnp.zeros((*self.shape[:lead], *output_size), self.dtype)
    x = _opmath(self)
    masks, counts = [], []
    for d, out in enumerate(output_size):
        axis = lead + 2 * d  # each earlier dim became (out, window)
        start, end = _adaptive_bounds(self.shape[lead + d], out)
        taps = start[:, None] + np.arange(int((end - start).max()))
        inside = taps < end[:, None]
        x = jnp.take(x, jnp.asarray(np.where(inside, taps, start[:, None]).reshape(-1)), axis)
        x = x.reshape(*x.shape[:axis], *taps.shape, *x.shape[axis + 1 :])
        masks.append(inside)
        counts.append(end - start)
    mask = masks[0]
    for m in masks[1:]:
        mask = mask.reshape(*mask.shape, 1, 1) & m
    total = jnp.where(jnp.asarray(mask), x, 0).sum(axis=tuple(lead + 2 * d + 1 for d in range(nd)))
    for d, count in enumerate(counts):
        shape = [1] * total.ndim
        shape[lead + d] = len(count)
        total = total / jnp.asarray(count.reshape(shape), dtype=total.dtype)
    return total.astype(self.dtype)


@lowering(aten._adaptive_avg_pool2d, aten._adaptive_avg_pool3d)
def _adaptive_avg_pool(self, output_size):
    """aten::_adaptive_avg_pool{2,3}d - mean over windows [floor(i*n/o), ceil((i+1)*n/o)).

    Shapes: (N, C, *spatial) or (C, *spatial) -> (..., *output_size). Dtypes: f16/bf16 in
    float32. A window mean per dim is an exact (HIGHEST precision) contraction with a static
    averaging matrix, separable over the dims. Reference: ATen AdaptiveAveragePooling.cpp.
    """
    return _adaptive_avg(f"aten::_adaptive_avg_pool{len(output_size)}d", self, output_size)


def _adaptive_avg_backward(nd):
    def fn(grad_output, self):
        """aten::_adaptive_avg_pool{2,3}d_backward - vjp of the forward lowering.

        The output size is grad_output's trailing dims; result in grad_output's dtype.
        """
        op = f"aten::_adaptive_avg_pool{nd}d_backward"
        out = grad_output.shape[-nd:]
        g = _vjp(lambda x: _adaptive_avg(op, x, out), _opmath(self), _opmath(grad_output))
        return g.astype(grad_output.dtype)

    return fn


lowering(aten._adaptive_avg_pool2d_backward)(_adaptive_avg_backward(2))
lowering(aten._adaptive_avg_pool3d_backward)(_adaptive_avg_backward(3))


def _adaptive_max(op, self, output_size):
    nd = len(output_size)
    _check_adaptive(op, self, output_size, nd)
    arrays, masks = [], []
    for n, out in zip(self.shape[-nd:], output_size):
        start, end = _adaptive_bounds(n, out)
        # Windows differ in length: pad each to the longest by repeating its last element,
        # which never changes the max nor the first-max index.
        ia = np.minimum(
            start[:, None] + np.arange(int((end - start).max()))[None, :], end[:, None] - 1
        )
        arrays.append(ia)
        masks.append(np.ones(ia.shape, dtype=bool))
    return _window_max(self, arrays, masks, op)


@lowering(aten.adaptive_max_pool2d, aten.adaptive_max_pool3d)
def adaptive_max_pool(self, output_size):
    """aten::adaptive_max_pool{2,3}d - max over adaptive windows, with flat indices.

    Shapes: (N, C, *spatial) or (C, *spatial) -> values and int64 indices of shape
    (..., *output_size). Windows [floor(i*n/o), ceil((i+1)*n/o)) per dim; first max wins.
    Reference: ATen AdaptiveMaxPooling2d.cpp.
    """
    return _adaptive_max(f"aten::adaptive_max_pool{len(output_size)}d", self, output_size)


def _fractional_max(op, self, kernel_size, output_size, random_samples):
    nd = len(output_size)
    if self.ndim not in (nd + 1, nd + 2):
        raise RuntimeError(f"{op}: expected {nd + 1}D or {nd + 2}D input, got {self.ndim}D")
    batched = self.ndim == nd + 2
    x = self if batched else self[None]
    n, c = x.shape[:2]
    spatial = x.shape[2:]
    # ATen's bounds differ by rank: 2-d allows a last window ending at the edge
    # (out + k - 1 <= size), 3-d does not (< size); the texts are ATen's.
    names = ("height", "width") if nd == 2 else ("time", "height", "width")
    prefix = "fractional_max_pool2d()" if nd == 2 else "fractional_max_pool3d_out()"
    for size, k, out, name in zip(spatial, kernel_size, output_size, names):
        if out + k - 1 > size or (nd == 3 and out + k - 1 == size):
            raise RuntimeError(
                f"{prefix}: pool {name} {k} too large relative to input {name} {size} (in {op})"
            )
    # ATen draws the samples W-first for 2-d (sample 0 -> W, 1 -> H) and T-first for 3-d.
    order = (1, 0) if nd == 2 else (0, 1, 2)
    flat = jnp.zeros((n, c) + tuple(output_size) + tuple(kernel_size), dtype=jnp.int64)
    for d, (size, k, out) in enumerate(zip(spatial, kernel_size, output_size)):
        sample = random_samples[:, :, order[d]][..., None]
        i = jnp.arange(out, dtype=sample.dtype)
        if out > 1:
            alpha = jnp.asarray((size - k) / (out - 1), dtype=sample.dtype)
            seq = ((i + sample) * alpha).astype(jnp.int64) - (sample * alpha).astype(jnp.int64)
            seq = seq.at[..., -1].set(size - k)
        else:
            seq = jnp.full((n, c, out), size - k, dtype=jnp.int64)
        shape = [n, c] + [1] * (2 * nd)
        shape[2 + d] = out
        kshape = [1] * (2 + 2 * nd)
        kshape[2 + nd + d] = k
        idx = seq.reshape(shape) + jnp.arange(k, dtype=jnp.int64).reshape(kshape)
        flat = flat * size + idx
    # explicit sizes, not -1: an empty batch (n == 0) leaves -1 nothing to infer from
    window, plane = math.prod(kernel_size), math.prod(spatial)
    flat = flat.reshape(n, c, *output_size, window)
    patches = jnp.take_along_axis(
        x.reshape(n, c, plane), flat.reshape(n, c, math.prod(output_size) * window), axis=2
    ).reshape(flat.shape)
    arg = jnp.argmax(patches, axis=-1)[..., None]
    values = jnp.take_along_axis(patches, arg, axis=-1)[..., 0]
    indices = jnp.take_along_axis(flat, arg, axis=-1)[..., 0]
    if not batched:
        values, indices = values[0], indices[0]
    return values, indices


@lowering(aten.fractional_max_pool2d, aten.fractional_max_pool3d)
def fractional_max_pool(self, kernel_size, output_size, random_samples):
    """aten::fractional_max_pool{2,3}d - max pool over pseudo-random window starts.

    Shapes: (N, C, *spatial) or (C, *spatial); random_samples (N or 1, C, nd) in [0, 1).
    Window starts per dim: int((i + u) * alpha) - int(u * alpha), the last one n - k,
    alpha = (n - k) / (out - 1), computed in the samples' dtype as ATen does.
    Dtypes: values keep self's dtype, indices int64. Reference: FractionalMaxPool2d.cpp.
    """
    nd = len(output_size)
    return _fractional_max(
        f"aten::fractional_max_pool{nd}d", self, kernel_size, output_size, random_samples
    )


# ---------------------------------------------------------------------------------------
# max_unpool: torch's decompositions, with the index check they lack


@jax.jit
def _last_outside(idx, n):
    """(any index of ``idx`` outside [0, n), the last such in memory order): the one CPU's
    serial loop reports (its threads race for the report where several are bad)."""
    flat = idx.reshape(-1)
    bad = (flat < 0) | (flat >= n)
    last = jnp.max(jnp.where(bad, jnp.arange(flat.size), 0))
    return jnp.any(bad), flat[last]


def _max_unpool_indices(nd):
    def check(args, kwargs) -> None:
        """CPU's max_unpool kernels raise ``Found an invalid max index`` for an index
        outside its plane of the output (the decomposition would write it into another
        channel's plane, or index_put would name a flat index): checked on the device,
        deferred as CUDA's ``CUDA_KERNEL_ASSERT``. Made only when the decomposition's
        own argument checks pass, so a refused call leaves no check pending."""
        self, indices = arg(args, kwargs, 0, "self"), arg(args, kwargs, 1, "indices")
        output_size = list(arg(args, kwargs, 2, "output_size"))
        if not (
            isinstance(indices, JaxTensor)
            and isinstance(self, torch.Tensor)
            and indices.dtype == torch.int64
            and self.shape == indices.shape
            and self.dim() in (nd + 1, nd + 2)
            and len(output_size) == nd
            and all(isinstance(n, int) and n > 0 for n in output_size)
            and all(n > 0 for n in self.shape[1:])
            and indices.numel() > 0
        ):
            return
        if nd == 3:
            stride, padding = arg(args, kwargs, 3, "stride"), arg(args, kwargs, 4, "padding")
            if len(stride) != 3 or len(padding) != 3 or min(stride) <= 0:
                return
        plane = math.prod(output_size)
        sizes = "x".join(str(n) for n in output_size)
        bad, value = _last_outside(indices._value(), plane)
        _checks.require(
            bad,
            value,
            RuntimeError,
            f"Found an invalid max index: {{value}} (output volumes are of size {sizes}) "
            f"(in aten::max_unpool{nd}d)",
        )

    return check


precheck(aten.max_unpool2d)(_max_unpool_indices(2))
precheck(aten.max_unpool3d)(_max_unpool_indices(3))
