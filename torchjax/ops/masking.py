"""Selection by mask: masked_scatter (and its backward), masked_select, nonzero.

masked_scatter and its backward keep fixed shapes (a cumulative count places each
element), so they work under jit; masked_select and nonzero have data-dependent output
shapes: eager only (Note [One error layer]; ``torch.where(mask, ...)`` keeps the shape
fixed).

Note [nonzero on the host]
An eager ``nonzero`` must read its input's values anyway: the result's length is the
count of nonzero elements. Lowered to ``jnp.nonzero`` it ran op by op, some fifteen jax
primitives (cumsum, scatter-add, floor_divide, ...), each a program XLA compiles on first
use, and those after the count compiled again for every new count. Diffusers' flow-match
scheduler calls it to find its first step (``index_for_timestep``: ``(timesteps ==
t).nonzero()``), so a pipeline's first call paid ~17 compiles for it (SD3 tiny: 20 of
148). So an eager call reads the input to the host (one transfer, or none when the host
holds its values: Note [Host values of tensors made from host data]), runs CPU torch's
kernel there (the reference, with CPU's result layout) and copies the result back, as any
CPU tensor moves to tpu (a small result keeps its host values: the ``.item()`` that
usually follows reads no device). No program is compiled. Inside a trace, or for an
array spread over several devices, it is lowered as before (under a trace that raises the
data-dependent shape error).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax._compat.jax import trace_state_clean
from torchjax.ops.copy import to_cpu
from torchjax.ops.indexing import _concrete
from torchjax.ops.registry import functional_handler, handler, lowering
from torchjax.tensor import dtypes
from torchjax.tensor._memory_format import restrided

aten = torch.ops.aten


@lowering(aten.masked_scatter.default)
def masked_scatter(self, mask, source):
    """aten::masked_scatter - positions where ``mask`` is true (row-major) take
    consecutive elements of ``source``. Not data-dependent: works under jit."""
    if source.dtype != self.dtype:
        raise RuntimeError(
            "masked_scatter: expected self and source to have same dtypes but got"
            f"{dtypes.aten_type_name(self.dtype)} and {dtypes.aten_type_name(source.dtype)}"
        )
    if mask.dtype != np.bool_:
        raise RuntimeError(
            "masked_scatter_ only supports boolean masks, but got mask with dtype "
            f"{dtypes.aten_type_name(mask.dtype)} (in aten::masked_scatter)"
        )
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    arr, mask = jnp.broadcast_to(self, shape), jnp.broadcast_to(mask, shape)
    flat_mask = mask.reshape(-1)
    pos = jnp.cumsum(flat_mask.astype(np.int64)) - 1
    src = source.reshape(-1).astype(arr.dtype)
    if src.shape[0] == 0:
        return arr
    if _concrete(flat_mask) and int(flat_mask.sum()) > src.shape[0]:
        raise RuntimeError(
            "masked_scatter: expected source to have at least as many "
            f"elements as ones in mask ({int(flat_mask.sum())}), got "
            f"{src.shape[0]} (in aten::masked_scatter)"
        )
    taken = src[jnp.clip(pos, 0, src.shape[0] - 1)]
    return jnp.where(flat_mask, taken, arr.reshape(-1)).reshape(shape)


@lowering(aten.masked_select.default)
def masked_select(self, mask):
    """aten::masked_select - 1-d tensor of the elements where ``mask`` (broadcast) is true.
    Data-dependent shape: eager only."""
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    return jnp.broadcast_to(self, shape)[jnp.broadcast_to(mask, shape)]


def _coordinates_by_dim(self):
    """(ndim, n) int64: the coordinates of the nonzero elements, row-major, one row per
    dimension. Data-dependent shape: eager only."""
    coords = jnp.nonzero(self.reshape(1) if self.ndim == 0 else self)
    if self.ndim == 0:
        return jnp.zeros((0, coords[0].shape[0]), dtype=np.int64)
    return jnp.stack(coords, axis=0).astype(np.int64)


_coordinates = functional_handler(aten.nonzero.default, _coordinates_by_dim)


HOST_NONZERO_MAX = 1 << 24


def _coordinates_on_host(self):
    """(ndim, n) int64 coordinates made by CPU torch's kernel from ``self``'s values, on
    ``self``'s device; None inside a trace or for an array over several devices (Note
    [nonzero on the host])."""
    if not trace_state_clean() or self.numel() > HOST_NONZERO_MAX:
        return None
    arr = self._value()
    if isinstance(arr, jax.core.Tracer) or len(arr.devices()) != 1:
        return None
    # CPU's (n, ndim) result has strides (1, n): its transpose is contiguous, so the
    # copy to the device is one transfer, with no layout program to compile.
    return torch.nonzero(to_cpu(self)).t().to(self.device)


@handler(aten.nonzero.default)
def nonzero(args, kwargs):
    """aten::nonzero - (n, ndim) coordinates laid out as CPU's: dimension by dimension,
    strides (1, n), so ``nonzero(as_tuple=True)`` and ``torch.where(cond)`` give
    contiguous tensors, as on CPU. Eager calls run on the host (Note [nonzero on the
    host])."""
    by_dim = _coordinates_on_host(args[0])
    if by_dim is None:
        by_dim = _coordinates(args, kwargs)
    out = aten.t.default(by_dim)
    # An empty result reports CPU's (1, 0); its storage has no element to lay out.
    return restrided(out, (1, 0)) if out._size[0] == 0 else out


@lowering(aten.masked_scatter_backward.default)
def masked_scatter_backward(grad_output, mask, sizes):
    """aten::masked_scatter_backward - the gradient for masked_scatter's ``source``: the
    elements of ``grad_output`` where ``mask`` is true, in order, zero-padded to
    ``sizes``. Scatter into a fixed-size buffer, so it also works under jit."""
    shape = jnp.broadcast_shapes(grad_output.shape, mask.shape)
    flat_mask = jnp.broadcast_to(mask, shape).reshape(-1)
    grad = jnp.broadcast_to(grad_output, shape).reshape(-1)
    n = int(np.prod(sizes))
    pos = jnp.where(flat_mask, jnp.cumsum(flat_mask.astype(np.int64)) - 1, n)
    out = jnp.zeros((n,), dtype=grad.dtype).at[pos].set(grad, mode="drop")
    return out.reshape(tuple(sizes))
