"""Ops that rearrange elements into new tensors: joining, tiling, flipping, padding,
triangles, and the ``*_scatter`` ops (the functional inverses of the views, used by
their backward). View ops, whose results alias, are in view_ops.py.

``hstack``/``vstack``/``dstack``/``tile``/``F.pad`` (constant mode) are composite in
ATen and reach ``cat``/``repeat``/``constant_pad_nd`` here.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.ops import writeback
from torchjax.ops.registry import handler, lowering
from torchjax.ops.view_ops import _dim, _slice_bounds
from torchjax.ops.writeback import write_into
from torchjax.tensor import _errors, dtypes
from torchjax.tensor._storage import _plan

aten = torch.ops.aten


def _result_dtype(arrays):
    """torch.result_type over tensors (all dimensioned): torch's own promotion."""
    dt = dtypes.to_torch_dtype(arrays[0].dtype)
    for a in arrays[1:]:
        dt = torch.promote_types(dt, dtypes.to_torch_dtype(a.dtype))
    return dtypes.to_jax_dtype(dt)


@handler(aten.cat.out)
def cat_out(args, kwargs):
    """aten::cat.out - ``cat`` written into ``out`` (resized); an output type the inputs
    cannot be cast to raises TypeError, as torch.cat's own check does."""
    tensors, out = args[0], kwargs["out"]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    writeback.check_no_partial_overlap(aten.cat.out, [out], args, {})
    result = aten.cat.default(tensors, dim)
    if not torch.can_cast(result.dtype, out.dtype):
        raise _errors.deliberate(
            TypeError(
                "torch.cat(): input types can't be cast to the desired output type "
                f"{dtypes.aten_type_name(out.dtype)} (in aten::cat.out)"
            )
        )
    return write_into(aten.cat.out, out, result, resize=True)


@lowering(aten.cat.default)
def cat(tensors, dim=0):
    """aten::cat - join tensors along ``dim``.

    Dtypes: torch.result_type over all inputs. Shapes: all but ``dim`` equal; 1-d empty
    tensors (shape (0,)) are skipped, as torch's legacy rule does. Reference: torch.cat.
    """
    if not tensors:
        raise RuntimeError("torch.cat(): expected a non-empty list of Tensors (in aten::cat)")
    for i, t in enumerate(tensors):
        if t.ndim == 0:
            raise RuntimeError(
                f"zero-dimensional tensor (at position {i}) cannot be concatenated (in aten::cat)"
            )
    out_dt = _result_dtype(tensors)
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        return jnp.zeros((0,), dtype=out_dt)
    ref = kept[0]
    if ref.ndim == 0:
        raise RuntimeError(
            "zero-dimensional tensor (at position 0) cannot be concatenated (in aten::cat)"
        )
    dim = _dim(dim, ref.ndim, "cat")
    for i, t in enumerate(kept):
        if t.ndim != ref.ndim:
            raise RuntimeError(
                f"Tensors must have same number of dimensions: got {ref.ndim} "
                f"and {t.ndim} (in aten::cat)"
            )
        for d in range(ref.ndim):
            if d != dim and t.shape[d] != ref.shape[d]:
                raise RuntimeError(
                    f"Sizes of tensors must match except in dimension {dim}. Expected size "
                    f"{ref.shape[d]} but got size {t.shape[d]} for tensor number {i} in the "
                    "list. (in aten::cat)"
                )
    return jnp.concatenate([t.astype(out_dt) for t in kept], axis=dim)


@lowering(aten.stack.default)
def stack(tensors, dim=0):
    """aten::stack - join equal-shape tensors along a new ``dim``. Dtypes: result_type."""
    if not tensors:
        raise RuntimeError("stack expects a non-empty TensorList (in aten::stack)")
    shape = tensors[0].shape
    for i, t in enumerate(tensors):
        if t.shape != shape:
            raise RuntimeError(
                f"stack expects each tensor to be equal size, but got "
                f"{list(shape)} at entry 0 and {list(t.shape)} at entry {i} "
                "(in aten::stack)"
            )
    out_dt = _result_dtype(tensors)
    dim = _dim(dim, len(shape) + 1, "stack")
    return jnp.stack([t.astype(out_dt) for t in tensors], axis=dim)


@lowering(aten.repeat.default)
def repeat(self, repeats):
    """aten::repeat - tile ``self`` ``repeats`` times (len(repeats) >= ndim; new dims lead)."""
    if len(repeats) < self.ndim:
        raise RuntimeError(
            "Number of dimensions of repeat dims can not be smaller than "
            f"number of dimensions of tensor (got {len(repeats)} < "
            f"{self.ndim}) (in aten::repeat)"
        )
    return jnp.tile(self, tuple(int(r) for r in repeats))


@lowering(aten.repeat_interleave.self_int)
def repeat_interleave_int(self, repeats, dim=None, output_size=None):
    """aten::repeat_interleave.self_int - each element ``repeats`` times along ``dim``
    (flattened when None)."""
    if dim is None:
        return jnp.repeat(self.reshape(-1), int(repeats))
    return jnp.repeat(self, int(repeats), axis=_dim(dim, self.ndim, "repeat_interleave"))


@lowering(aten.repeat_interleave.Tensor, cpu_tensors=True)
def repeat_interleave(repeats, output_size=None):
    """aten::repeat_interleave.Tensor - ``i`` repeated ``repeats[i]`` times (int64).

    The output length is data-dependent: eager only unless ``output_size`` is given.
    """
    if output_size is None and repeats.size and int(repeats.min()) < 0:
        raise RuntimeError("repeats can not be negative (in aten::repeat_interleave)")
    n = int(repeats.sum()) if output_size is None else int(output_size)
    return jnp.repeat(
        jnp.arange(repeats.shape[0], dtype=repeats.dtype), repeats, total_repeat_length=n
    )


@lowering(aten.flip.default)
def flip(self, dims):
    """aten::flip - reverse the order along ``dims``.

    A 0-d tensor takes dims 0 and -1 (ATen wraps its dims as for 1-d) and is returned
    unchanged, as torch does; a repeated dim is torch's RuntimeError. Reference: torch.flip.
    """
    dims = tuple(_dim(d, self.ndim, "flip") for d in dims)
    for i, d in enumerate(dims):
        if d in dims[:i]:
            raise RuntimeError(
                f"dim {d} appears multiple times in the list of dims (in aten::flip, "
                f"dims={list(dims)}); pass each dim once"
            )
    return jnp.flip(self, dims) if dims and self.ndim else self


@lowering(aten.roll.default)
def roll(self, shifts, dims=()):
    """aten::roll - circular shift; no ``dims`` rolls the flattened tensor."""
    if not shifts:
        raise RuntimeError("`shifts` required (in aten::roll)")
    if not dims:
        return jnp.roll(self.reshape(-1), tuple(shifts)).reshape(self.shape)
    if len(shifts) != len(dims):
        raise RuntimeError(
            f"shifts and dimensions must align. shifts: {len(shifts)}, dims:"
            f"{len(dims)} (in aten::roll)"
        )
    return jnp.roll(self, tuple(shifts), tuple(_dim(d, self.ndim, "roll") for d in dims))


def _tri_mask(shape, diagonal, lower):
    if len(shape) < 2:
        op = "tril" if lower else "triu"
        raise RuntimeError(
            f"{op}: input tensor must have at least 2 dimensions "
            f"(got shape {list(shape)}) (in aten::{op})"
        )
    rows = lax.broadcasted_iota(np.int64, shape[-2:], 0)
    cols = lax.broadcasted_iota(np.int64, shape[-2:], 1)
    return cols - rows <= diagonal if lower else cols - rows >= diagonal


@lowering(aten.tril.default)
def tril(self, diagonal=0):
    """aten::tril - zero the elements above ``diagonal`` of the last two dims."""
    return jnp.where(_tri_mask(self.shape, diagonal, True), self, jnp.zeros((), self.dtype))


@lowering(aten.triu.default)
def triu(self, diagonal=0):
    """aten::triu - zero the elements below ``diagonal`` of the last two dims."""
    return jnp.where(_tri_mask(self.shape, diagonal, False), self, jnp.zeros((), self.dtype))


@lowering(aten.constant_pad_nd.default)
def constant_pad_nd(self, pad, value=0):
    """aten::constant_pad_nd - pad (or crop, if negative) the last len(pad)//2 dims.

    ``pad`` is (last_lo, last_hi, second_last_lo, ...), as F.pad. ``value`` is cast to
    ``self``'s dtype. Reference: torch.constant_pad_nd; jax.lax.pad.
    """
    if len(pad) % 2 or len(pad) // 2 > self.ndim:
        raise RuntimeError(
            f"Length of pad must be even but instead it equals {len(pad)}, or "
            f"pad too long for a {self.ndim}-d input (in aten::constant_pad_nd)"
        )
    dtypes.check_scalar_fits(value, self.dtype, "constant_pad_nd")
    config = [(0, 0, 0)] * self.ndim
    for i in range(len(pad) // 2):
        config[self.ndim - 1 - i] = (int(pad[2 * i]), int(pad[2 * i + 1]), 0)
    for d, (lo, hi, _) in enumerate(config):
        if self.shape[d] + lo + hi < 0:
            raise RuntimeError(
                f"The input size {self.shape[d]}, plus negative padding {lo} "
                f"and {hi} resulted in a negative output size, which is "
                "invalid. (in aten::constant_pad_nd)"
            )
    return lax.pad(self, np.asarray(value).astype(self.dtype), config)


def _src_cast(self, src):
    return src.astype(self.dtype) if src.dtype != self.dtype else src


@lowering(aten.slice_scatter.default)
def slice_scatter(self, src, dim=0, start=None, end=None, step=1):
    """aten::slice_scatter - ``self`` with ``self[..., start:end:step]`` (on dim) = src."""
    dim = _dim(dim, self.ndim, "slice_scatter")
    start, end = _slice_bounds(self.shape[dim], start, end, step)
    index = (np.s_[:],) * dim + (np.s_[start:end:step],)
    return self.at[index].set(_src_cast(self, src))


@lowering(aten.select_scatter.default)
def select_scatter(self, src, dim, index):
    """aten::select_scatter - ``self`` with ``self.select(dim, index)`` = src."""
    dim = _dim(dim, self.ndim, "select_scatter")
    n = self.shape[dim]
    if not -n <= index < n:
        raise IndexError(
            f"select_scatter(): index {index} out of range for tensor of size "
            f"{list(self.shape)} at dimension {dim} (in aten::select_scatter)"
        )
    return self.at[(np.s_[:],) * dim + (index % n,)].set(_src_cast(self, src))


@lowering(aten.diagonal_scatter.default)
def diagonal_scatter(self, src, offset=0, dim1=0, dim2=1):
    """aten::diagonal_scatter - ``self`` with ``self.diagonal(offset, dim1, dim2)`` = src
    (src's last dim runs along the diagonal)."""
    d1, d2 = _dim(dim1, self.ndim, "diagonal_scatter"), _dim(dim2, self.ndim, "diagonal_scatter")
    n1, n2 = self.shape[d1], self.shape[d2]
    length = max(0, min(n1, n2 - offset) if offset >= 0 else min(n1 + offset, n2))
    k = np.arange(length, dtype=np.int64)
    rows, cols = (k, k + offset) if offset >= 0 else (k - offset, k)
    moved = jnp.moveaxis(self, (d1, d2), (-2, -1))
    moved = moved.at[..., rows, cols].set(_src_cast(self, src))
    return jnp.moveaxis(moved, (-2, -1), (d1, d2))


@lowering(aten.as_strided_scatter.default)
def as_strided_scatter(self, src, size, stride, storage_offset=None):
    """aten::as_strided_scatter - ``self`` (as a contiguous buffer) with its
    as_strided(size, stride, storage_offset) elements = src."""
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    offset = 0 if storage_offset is None else int(storage_offset)
    flat = self.reshape(-1)
    plan = _plan(flat.shape[0], size, stride, offset)
    return plan.write(flat, _src_cast(self, src).reshape(size)).reshape(self.shape)
