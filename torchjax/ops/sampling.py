"""Resampling lowerings: upsample (nearest, linear, cubic, antialiased), grid_sample, and
the replication pads, with their backward ops.

Upsampling is separable: per spatial dim a static (numpy, trace-time) table of source
indices and weights, shape (out, taps), computed in ATen's opmath dtype (float32, or
float64 for float64 input) with ATen's formulas, then one gather-and-weight per dim.
Backward ops are the ``jax.vjp`` of the forward lowering (every op here is linear in its
input; grid_sample's grid gradient comes from the same vjp).

Under jit: nothing reads array values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax._compat.torch import decomposition_table
from torchjax.ops.registry import handler, lowering

aten = torch.ops.aten


def _opmath(x):
    return x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x


def _np_opmath(dtype):
    return np.float64 if dtype == jnp.float64 else np.float32


def _vjp(fn, x, grad):
    _, pullback = jax.vjp(fn, x)
    return pullback(grad.astype(x.dtype))[0]


# ---------------------------------------------------------------------------------------
# separable tap tables (numpy, static)


def _scale_value(scale, n_in, n_out, ft):
    # ATen's compute_scales_value: 1/scale when the caller gave a positive scale.
    if scale is not None and scale > 0:
        return ft(1.0 / scale)
    return ft(n_in) / ft(n_out)


def _area_scale(n_in, n_out, align_corners, scale, ft):
    if align_corners:
        return ft(n_in - 1) / ft(n_out - 1) if n_out > 1 else ft(0)
    return _scale_value(scale, n_in, n_out, ft)


def _nearest_taps(n_in, n_out, scale, exact, ft):
    s = np.float32(_scale_value(scale, n_in, n_out, np.float32))
    dst = np.arange(n_out, dtype=np.float32)
    src = np.floor((dst + np.float32(0.5)) * s if exact else dst * s).astype(np.int64)
    return np.minimum(src, n_in - 1)[:, None], np.ones((n_out, 1), dtype=ft)


def _linear_taps(n_in, n_out, align_corners, scale, ft):
    s = _area_scale(n_in, n_out, align_corners, scale, ft)
    dst = np.arange(n_out).astype(ft)
    src = s * dst if align_corners else np.maximum(s * (dst + ft(0.5)) - ft(0.5), ft(0))
    # ATen's guard_index_and_lambda: a source index past the last row (a scale the caller
    # gave, larger than the sizes imply) reads the last row.
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    lam = np.clip(src - i0.astype(ft), ft(0), ft(1)).astype(ft)
    i1 = np.minimum(i0 + 1, n_in - 1)
    return np.stack([i0, i1], 1), np.stack([ft(1) - lam, lam], 1)


def _cubic_coeffs(t, ft):
    a = ft(-0.75)

    def c1(x):
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def c2(x):
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return np.stack([c2(t + 1), c1(t), c1(1 - t), c2(2 - t)], 1).astype(ft)


def _cubic_taps(n_in, n_out, align_corners, scale, ft):
    s = _area_scale(n_in, n_out, align_corners, scale, ft)
    dst = np.arange(n_out).astype(ft)
    src = s * dst if align_corners else s * (dst + ft(0.5)) - ft(0.5)
    i0 = np.floor(src).astype(np.int64)
    t = (src - i0.astype(ft)).astype(ft)
    idx = np.clip(i0[:, None] + np.arange(-1, 3)[None, :], 0, n_in - 1)
    return idx, _cubic_coeffs(t, ft)


def _triangle(x, ft):
    return np.maximum(ft(1) - np.abs(x), ft(0))


def _keys_cubic(x, ft):
    # ATen's HelperInterpCubic::aa_filter: Keys' cubic convolution with a = -0.5 (the
    # non-antialiased bicubic uses -0.75), zero from |x| = 2 on.
    a, x = ft(-0.5), np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, ft(0)))


def _aa_taps(filter_fn, interp_size):
    """ATen's _compute_weights_aa for one filter: the filter widened by the scale when
    downsampling (support ``interp_size / 2 * scale``), weights normalised to sum 1."""

    def taps(n_in, n_out, align_corners, scale, ft):
        s = _area_scale(n_in, n_out, align_corners, scale, ft)
        half = ft(interp_size * 0.5)
        support = half * s if s >= 1.0 else half
        invscale = ft(1.0) / s if s >= 1.0 else ft(1.0)
        rows = []
        for i in range(n_out):
            center = s * ft(i + 0.5)
            xmin = max(int(center - support + ft(0.5)), 0)
            xsize = min(int(center + support + ft(0.5)), n_in) - xmin
            j = np.arange(xsize)
            w = filter_fn((j + xmin - center + ft(0.5)).astype(ft) * invscale, ft).astype(ft)
            total = w.sum(dtype=ft)
            rows.append((xmin + j, w / total if total != 0 else w))
        k = max(len(r[0]) for r in rows)
        idx = np.full((n_out, k), -1, dtype=np.int64)  # -1: no tap (see _apply_taps)
        wts = np.zeros((n_out, k), dtype=ft)
        for i, (r, w) in enumerate(rows):
            idx[i, : len(r)], wts[i, : len(w)] = r, w
        return idx, wts

    return taps


def _apply_taps(x, tables):
    """out[..., o, ...] = sum_k x[..., idx[o, k], ...] * w[o, k], per trailing dim. A
    negative index pads a short row: it adds nothing (not ``x[0] * 0``, which is NaN for
    a NaN or inf ``x[0]`` that CPU's loop never reads)."""
    nd = len(tables)
    for d, (idx, w) in enumerate(tables):
        axis = x.ndim - nd + d
        if idx.shape[1] == 1:
            x = jnp.take(x, jnp.asarray(idx[:, 0]), axis=axis)
            continue
        g = jnp.take(x, jnp.asarray(np.maximum(idx, 0).reshape(-1)), axis=axis)
        g = g.reshape(*x.shape[:axis], *idx.shape, *x.shape[axis + 1 :])
        wshape = [1] * g.ndim
        wshape[axis], wshape[axis + 1] = idx.shape
        terms = g * jnp.asarray(w, dtype=x.dtype).reshape(wshape)
        if (idx < 0).any():
            terms = jnp.where(jnp.asarray(idx >= 0).reshape(wshape), terms, 0)
        x = terms.sum(axis=axis + 1)
    return x


def _upsample(op, self, output_size, tap_fn, scales):
    nd = len(output_size)
    if self.ndim != nd + 2 or any(n == 0 for n in self.shape[2:]) or min(output_size) <= 0:
        raise RuntimeError(
            f"{op}: expected a {nd + 2}D input with non-zero spatial sizes and positive "
            f"output_size, got input {tuple(self.shape)} and output_size {list(output_size)}"
        )
    x = _opmath(self)
    ft = _np_opmath(x.dtype)
    scales = list(scales) + [None] * (nd - len(scales))
    tables = [tap_fn(n, o, s, ft) for n, o, s in zip(self.shape[2:], output_size, scales)]
    out = _apply_taps(x, tables)
    return out.astype(self.dtype)


def _check_float(name, x):
    # CPU torch interpolates uint8 images with a fixed-point kernel (weights in integer
    # precision bits, its own rounding); float math then rounding differs from it by 1 in
    # a few percent of pixels (13 for bicubic), so refuse rather than answer differently.
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise NotImplementedError(
            f"aten::{name}: {x.dtype} input is not supported on tpu (CPU torch uses a "
            "fixed-point integer kernel torchjax does not reproduce); interpolate "
            "x.float() and round, or run this op on CPU with .cpu()"
        )


def _register_upsample(fwd, bwd, name, make_taps, has_align):
    """One forward lowering and its backward (the forward's vjp) for an upsample op."""

    if has_align:

        def forward(self, output_size, align_corners, *scales):
            _check_float(name, self)

            def taps(n, o, s, ft):
                return make_taps(n, o, align_corners, s, ft)

            return _upsample(f"aten::{name}", self, output_size, taps, scales)

        def backward(grad_output, output_size, input_size, align_corners, *scales):
            x = jnp.zeros(tuple(input_size), dtype=_opmath(grad_output).dtype)
            g = _vjp(
                lambda x: forward(x, output_size, align_corners, *scales), x, _opmath(grad_output)
            )
            return g.astype(grad_output.dtype)

    else:

        def forward(self, output_size, *scales):
            return _upsample(f"aten::{name}", self, output_size, make_taps, scales)

        def backward(grad_output, output_size, input_size, *scales):
            x = jnp.zeros(tuple(input_size), dtype=_opmath(grad_output).dtype)
            g = _vjp(lambda x: forward(x, output_size, *scales), x, _opmath(grad_output))
            return g.astype(grad_output.dtype)

    forward.__doc__ = f"""aten::{name} - separable resampling to output_size.

    Shapes: (N, C, *spatial) -> (N, C, *output_size). Dtypes: f16/bf16 computed in
    float32; source indices and weights follow ATen's UpSample.h formulas in opmath.
    Reference: ATen UpSampleKernel.cpp."""
    backward.__doc__ = f"aten::{name}_backward - the vjp of aten::{name} (linear in input)."
    lowering(fwd)(forward)
    lowering(bwd)(backward)


def _nearest(exact):
    return lambda n, o, s, ft: _nearest_taps(n, o, s, exact, ft)


for _nd in (1, 2, 3):
    _register_upsample(
        getattr(aten, f"upsample_nearest{_nd}d").default,
        getattr(aten, f"upsample_nearest{_nd}d_backward").default,
        f"upsample_nearest{_nd}d",
        _nearest(False),
        False,
    )
    _register_upsample(
        getattr(aten, f"_upsample_nearest_exact{_nd}d").default,
        getattr(aten, f"_upsample_nearest_exact{_nd}d_backward").default,
        f"_upsample_nearest_exact{_nd}d",
        _nearest(True),
        False,
    )
for _name, _taps in (
    ("upsample_linear1d", _linear_taps),
    ("upsample_bilinear2d", _linear_taps),
    ("upsample_trilinear3d", _linear_taps),
    ("upsample_bicubic2d", _cubic_taps),
    ("_upsample_bilinear2d_aa", _aa_taps(_triangle, 2)),
    ("_upsample_bicubic2d_aa", _aa_taps(_keys_cubic, 4)),
):
    _register_upsample(
        getattr(aten, _name).default,
        getattr(aten, f"{_name}_backward").default,
        _name,
        _taps,
        True,
    )


# ---------------------------------------------------------------------------------------
# replication pad


def _replication_pad(op, self, padding):
    nd = len(padding) // 2
    if self.ndim not in (nd + 1, nd + 2):
        raise RuntimeError(f"{op}: expected {nd + 1}D or {nd + 2}D input, got shape {self.shape}")
    x = self
    for d in range(nd):
        axis = self.ndim - 1 - d
        left, right = padding[2 * d], padding[2 * d + 1]
        n = x.shape[axis]
        out = n + left + right
        if out <= 0:
            raise RuntimeError(
                f"{op}: input size {n} with padding ({left}, {right}) gives output size {out}"
            )
        x = jnp.take(x, jnp.asarray(np.clip(np.arange(out) - left, 0, n - 1)), axis=axis)
    return x


def _register_replication(nd):
    name = f"replication_pad{nd}d"

    def forward(self, padding):
        return _replication_pad(f"aten::{name}", self, padding)

    def backward(grad_output, self, padding):
        x = _opmath(self)
        g = _vjp(
            lambda x: _replication_pad(f"aten::{name}_backward", x, padding),
            x,
            _opmath(grad_output),
        )
        return g.astype(grad_output.dtype)

    forward.__doc__ = f"""aten::{name} - pad the last {nd} dims by repeating edge values.

    padding is (left, right, ...) from the last dim; negative entries crop. Implemented as
    a gather at clip(i - left, 0, n - 1). Dtypes: any, kept."""
    backward.__doc__ = f"aten::{name}_backward - the vjp of aten::{name} (scatter-add)."
    lowering(getattr(aten, name).default)(forward)
    lowering(getattr(aten, f"{name}_backward").default)(backward)


for _nd in (1, 2, 3):
    _register_replication(_nd)


# ---------------------------------------------------------------------------------------
# grid_sample

_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2


def _reflect(x, twice_low, twice_high):
    if twice_low == twice_high:
        return jnp.zeros_like(x)
    lo = twice_low / 2
    span = (twice_high - twice_low) / 2
    x = jnp.abs(x - lo)
    extra = jnp.fmod(x, span)
    flips = jnp.floor(x / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + lo, span - extra + lo)


def _pad_coord(x, size, padding_mode, align_corners):
    if padding_mode == _BORDER:
        return jnp.clip(x, 0, size - 1)
    if padding_mode == _REFLECTION:
        if align_corners:
            x = _reflect(x, 0, 2 * (size - 1))
        else:
            x = _reflect(x, -1, 2 * size - 1)
        return jnp.clip(x, 0, size - 1)
    return x


def _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners):
    nd = grid.shape[-1]
    n, c = input.shape[:2]
    sizes = input.shape[2:]
    out_spatial = grid.shape[1:-1]
    flat_in = input.reshape(n, c, -1)
    # grid's last dim is (x, y[, z]) = (W, H[, D]): reverse to match the spatial dims.
    coords = []
    for d in range(nd):
        size = sizes[d]
        g = grid[..., nd - 1 - d].reshape(n, -1)
        if align_corners:
            g = (g + 1) / 2 * (size - 1)
        else:
            g = ((g + 1) * size - 1) / 2
        if interpolation_mode != _BICUBIC:
            g = _pad_coord(g, size, padding_mode, align_corners)
        coords.append(g)

    def gather(idx):
        # idx: per-dim integer coordinates (N, Q); out-of-range taps contribute zero.
        valid, flat = None, None
        for i, size in zip(idx, sizes):
            v = (i >= 0) & (i < size)
            valid = v if valid is None else valid & v
            ic = jnp.clip(i, 0, size - 1)
            flat = ic if flat is None else flat * size + ic
        vals = jnp.take_along_axis(flat_in, flat[:, None, :], axis=2)
        return vals * valid[:, None, :].astype(vals.dtype)

    if interpolation_mode == _NEAREST:
        out = gather([jnp.round(g).astype(jnp.int64) for g in coords])
    elif interpolation_mode == _BILINEAR:
        base = [jnp.floor(g) for g in coords]
        frac = [g - b for g, b in zip(coords, base)]
        out = 0
        for corner in np.ndindex(*(2,) * nd):
            w = 1
            for k, f in zip(corner, frac):
                w = w * (f if k else 1 - f)
            out = (
                out
                + gather([b.astype(jnp.int64) + k for b, k in zip(base, corner)]) * w[:, None, :]
            )
    else:
        base = [jnp.floor(g) for g in coords]
        coeffs = [_cubic_coeffs_jnp(g - b) for g, b in zip(coords, base)]
        out = 0
        for tap in np.ndindex(*(4,) * nd):
            w = 1
            idx = []
            for k, b, cf, size in zip(tap, base, coeffs, sizes):
                w = w * cf[k]
                i = _pad_coord(b + (k - 1), size, padding_mode, align_corners)
                idx.append(i.astype(jnp.int64))
            out = out + gather(idx) * w[:, None, :]
    return out.reshape(n, c, *out_spatial)


def _cubic_coeffs_jnp(t):
    a = -0.75

    def c1(x):
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def c2(x):
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return [c2(t + 1), c1(t), c1(1 - t), c2(2 - t)]


def _check_grid(op, input, grid, nd, interpolation_mode):
    if input.ndim != nd + 2 or grid.ndim != nd + 2 or grid.shape[-1] != nd:
        raise RuntimeError(
            f"{op}: expected {nd + 2}D input and grid with grid.shape[-1] == {nd}, got "
            f"input {tuple(input.shape)} and grid {tuple(grid.shape)}"
        )
    if input.shape[0] != grid.shape[0]:
        raise RuntimeError(
            f"{op}: expected grid and input to have the same batch size, got "
            f"{grid.shape[0]} and {input.shape[0]}"
        )
    if nd == 3 and interpolation_mode == _BICUBIC:
        raise RuntimeError(f"{op}: bicubic interpolation only supports 4D input")


def _register_grid_sampler(nd):
    name = f"grid_sampler_{nd}d"

    def forward(input, grid, interpolation_mode, padding_mode, align_corners):
        _check_grid(f"aten::{name}", input, grid, nd, interpolation_mode)
        out = _grid_sample(
            _opmath(input), _opmath(grid), interpolation_mode, padding_mode, align_corners
        )
        return out.astype(input.dtype)

    def backward(
        grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask
    ):
        _check_grid(f"aten::{name}_backward", input, grid, nd, interpolation_mode)
        _, pullback = jax.vjp(
            lambda x, g: _grid_sample(x, g, interpolation_mode, padding_mode, align_corners),
            _opmath(input),
            _opmath(grid),
        )
        gi, gg = pullback(_opmath(grad_output))
        return gi.astype(input.dtype), gg.astype(grid.dtype)

    forward.__doc__ = f"""aten::{name} - sample input at the normalized grid coordinates.

    Shapes: input (N, C, *in_spatial), grid (N, *out_spatial, {nd}) with (x, y[, z])
    ordered W, H[, D] -> (N, C, *out_spatial). interpolation_mode 0 bilinear, 1 nearest
    (round half to even, as nearbyint), 2 bicubic (2-d only); padding_mode 0 zeros,
    1 border, 2 reflection. Dtypes: f16/bf16 computed in float32.
    Reference: ATen GridSampler.h."""
    backward.__doc__ = f"""aten::{name}_backward - (grad_input, grad_grid), the vjp of
    aten::{name}; output_mask is ignored (both are computed)."""
    lowering(getattr(aten, name).default)(forward)
    lowering(getattr(aten, f"{name}_backward").default)(backward)


_register_grid_sampler(2)
_register_grid_sampler(3)


# ---------------------------------------------------------------------------------------
# reflection pad: torch's decomposition, after torch's size check (the decomposition
# would reflect past the edge and compute silently)


def _reflection_checked(nd, decomposed):
    def run(args, kwargs):
        self, padding = args[0], args[1]
        for i in range(nd):
            dim = self.dim() - 1 - i
            lo, hi = padding[2 * i], padding[2 * i + 1]
            if lo >= self.shape[dim] or hi >= self.shape[dim]:
                raise RuntimeError(
                    f"Argument #4: Padding size should be less than the corresponding input "
                    f"dimension, but got: padding ({lo}, {hi}) at dimension {dim} of input "
                    f"{list(self.shape)} (in aten::reflection_pad{nd}d)"
                )
        return decomposed(*args, **kwargs)

    return run


for _nd in (1, 2, 3):
    _op = getattr(torch.ops.aten, f"reflection_pad{_nd}d").default
    handler(_op)(_reflection_checked(_nd, decomposition_table[_op]))
