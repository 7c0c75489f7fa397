"""index_select, index_add, index_copy and index_fill: one 1-d index (or a scalar) naming
positions along ``dim``, every position off ``dim`` taken whole (split from indexing.py).

Each op checks its index as CPU does, with CPU's exception and text per op (``_index_1d``):
the index's rank, its dtype, ``dim``; index values are range-checked on the device
(indexing.py's ``_check_range``): ``index_fill`` wraps negative indices as CPU does,
``index_select``, ``index_add`` and ``index_copy`` refuse them. ``index_copy`` at a run of
positions is a dynamic-update-slice (Note [Index writes at a run of positions] in
torchjax/ops/index_runs.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from torchjax.ops import index_runs
from torchjax.ops.indexing import _check_range, _update
from torchjax.ops.registry import functional_handler, handler, lowering
from torchjax.ops.schema import arg
from torchjax.ops.view_ops import _dim
from torchjax.tensor import dtypes

aten = torch.ops.aten
_ALL = slice(None)


def _index_1d_texts(op, index):
    """CPU's (exception, text) for an index of more than one dim, and for one of a
    dtype it refuses, per op; and the index dtypes it takes."""
    name = dtypes.aten_type_name(index.dtype)
    if op == "index_select":
        return (
            (IndexError, "index_select(): Index is supposed to be a vector"),
            (RuntimeError, "index_select(): Expected dtype int32 or int64 for index"),
            (np.int32, np.int64),
        )
    if op == "index_add":
        return (
            (
                IndexError,
                f"index_add_(): Index is supposed to be a vector, but got dim: {index.ndim} "
                f"with type: {name} and size: {list(index.shape)}",
            ),
            (RuntimeError, f"index_add_(): Expected dtype int32/int64 for index but got: {name}"),
            (np.int32, np.int64),
        )
    if op == "index_fill":
        return (
            (RuntimeError, "Index has to be a vector/scalar"),
            (IndexError, "index_fill_(): Expected dtype int64 for index."),
            (np.int64,),
        )
    return (
        (IndexError, f"{op}(): Index is supposed to be a vector, got {index.ndim}-d"),
        (IndexError, f"{op}(): Expected dtype int32/int64 for index, got {index.dtype}"),
        (np.int32, np.int64),
    )


def _index_1d(self, dim, index, op, negative=False):
    vector, dtype, takes = _index_1d_texts(op, index)
    if index.ndim > 1:
        raise vector[0](vector[1])
    if index.dtype not in takes:
        raise dtype[0](dtype[1])
    arr = self.reshape(1) if self.ndim == 0 else self
    dim = _dim(dim, arr.ndim, op)
    index = index.reshape(-1)
    _check_range(index, arr.shape[dim], op, dim, negative=negative)
    return arr, dim, index


@lowering(aten.index_select.default, cpu_tensors=True)
def index_select(self, dim, index):
    """aten::index_select - the entries ``index`` (1-d) of ``self`` along ``dim``."""
    arr, dim, index = _index_1d(self, dim, index, "index_select")
    out = jnp.take(arr, index, axis=dim)
    return out.reshape(()) if self.ndim == 0 else out


def _index_update(self, dim, index, source, how, op):
    # index_fill wraps negative indices on CPU; index_add / index_copy refuse them.
    arr, dim, index = _index_1d(self, dim, index, op, negative=op == "index_fill")
    source = jnp.asarray(source).astype(arr.dtype)
    if source.ndim == 0 and self.ndim == 0:
        source = source.reshape(1)
    return _update(arr, (_ALL,) * dim + (index,), source, how).reshape(self.shape)


@lowering(aten.index_add.default, cpu_tensors=True)
def index_add(self, dim, index, source, alpha=1):
    """aten::index_add - ``self[..., index[i], ...] += alpha * source[..., i, ...]``;
    ``source`` of ``self``'s dtype, as CPU requires."""
    if source.dtype != self.dtype:
        raise RuntimeError(
            f"index_add_(): self ({dtypes.aten_type_name(self.dtype)}) and source "
            f"({dtypes.aten_type_name(source.dtype)}) must have the same scalar type"
        )
    d = dim % max(self.ndim, 1)
    off_dim = lambda shape: [n for i, n in enumerate(shape) if i != d]  # noqa: E731
    if self.ndim and source.ndim and off_dim(self.shape) != off_dim(source.shape):
        raise RuntimeError(
            "source tensor shape must match self tensor shape, excluding the specified "
            f"dimension. Got self.shape = {list(self.shape)} source.shape = "
            f"{list(source.shape)} (in aten::index_add)"
        )
    if alpha != 1:
        source = source * np.asarray(alpha).astype(source.dtype)
    return _index_update(self, dim, index, source, "add", "index_add")


def index_copy(self, dim, index, source):
    """aten::index_copy - ``self[..., index[i], ...] = source[..., i, ...]``; ``source``
    of ``self``'s dtype, as CPU requires (its checks in its order, with its texts)."""
    _check_index_copy(self, dim, index, source)
    return _index_update(self, dim, index, source, "set", "index_copy")


def _index_copy_run(self, dim, index, source):
    """aten::index_copy where ``index`` names a run of positions (``index_runs.
    known_run``): a dynamic-update-slice (Note [Index writes at a run of positions]).
    The same checks as ``index_copy``, in its order."""
    _check_index_copy(self, dim, index, source)
    arr, d, index = _index_1d(self, dim, index, "index_copy")
    shape = (*arr.shape[:d], index.size, *arr.shape[d + 1 :])
    update = jnp.asarray(source).reshape(shape)
    return index_runs.write_run(arr, d, index, update, negative=False).reshape(self.shape)


def _check_index_copy(self, dim, index, source) -> None:
    if index.ndim >= 2:
        raise IndexError(f"index_copy_(): Index should have dimension 1 or 0 (got {index.ndim})")
    if source.ndim == 0 and index.size != 1:
        raise IndexError(
            "index_copy_(): When source is scalar, index should have one element "
            f"(got {index.size})"
        )
    if source.ndim != self.ndim and source.ndim and self.ndim:
        raise IndexError(
            "index_copy_(): When source and destination are not scalars, their "
            f"dimensionality must match. Source dimensionality ({source.ndim}), "
            f"destination dimensionality ({self.ndim})"
        )
    if index.dtype != np.int64:
        raise RuntimeError(
            "index_copy_(): Expected a long tensor for index, but got "
            f"{dtypes.aten_type_name(index.dtype)}"
        )
    if source.dtype != self.dtype:
        raise RuntimeError(
            "index_copy_(): self and source expected to have the same dtype, but got (self) "
            f"{dtypes.aten_type_name(self.dtype)} and (source) "
            f"{dtypes.aten_type_name(source.dtype)}"
        )
    d = _dim(dim, max(self.ndim, 1), "index_copy")
    mine, theirs = list(self.shape), list(source.shape)
    if mine:
        del mine[d]
    if theirs:
        del theirs[d]
    if mine != theirs:
        raise RuntimeError(
            "index_copy_(): Source/destination tensor must have same slice shapes. "
            f"Destination slice shape: {' '.join(map(str, mine))} at dimension {d} and "
            f"source slice shape: {' '.join(map(str, theirs))} at dimension 0."
        )
    if source.ndim and index.size != source.shape[d]:
        raise IndexError(
            f"index_copy_(): Number of indices ({index.size}) should be equal to "
            f"source.size(dim) ({source.shape[d]})"
        )


_INDEX_COPY = functional_handler(aten.index_copy.default, index_copy, cpu_tensors=True)
_INDEX_COPY_RUN = functional_handler(aten.index_copy.default, _index_copy_run, cpu_tensors=True)


@handler(aten.index_copy.default)
def index_copy_handler(args, kwargs):
    """aten::index_copy - ``index_copy``, or ``_index_copy_run`` where the index names a
    run of positions (Note [Index writes at a run of positions])."""
    self, dim = arg(args, kwargs, 0, "self"), arg(args, kwargs, 1, "dim")
    index = arg(args, kwargs, 2, "index")
    rank = self.dim()
    if rank == 0:
        size = 1
    elif isinstance(dim, int) and -rank <= dim < rank:
        size = self.shape[dim]
    else:
        return _INDEX_COPY(args, kwargs)  # its error
    run = index_runs.known_run(index, size, negative=False)
    return (_INDEX_COPY_RUN if run else _INDEX_COPY)(args, kwargs)


@lowering(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor, cpu_tensors=True)
def index_fill(self, dim, index, value):
    """aten::index_fill - ``self[..., index, ...] = value`` (scalar or 0-d tensor)."""
    if jnp.iscomplexobj(value) and not jnp.iscomplexobj(self):
        raise RuntimeError(  # CPU's kernel text, ahead of the range check
            "index_fill_(): Converting complex Scalar to non-complex type is not supported"
        )
    dtypes.check_scalar_fits(value, self.dtype, "index_fill")
    return _index_update(
        self, dim, index, jnp.asarray(value).astype(self.dtype), "set", "index_fill"
    )
