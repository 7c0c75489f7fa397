"""gather, scatter, scatter_add and scatter_reduce: an index tensor with one entry per
element addressed along ``dim``, iota elsewhere (split from indexing.py).

Shapes are checked at the op as torch's ScatterGatherChecks.h does, with its texts: the
index may be no larger than ``self`` off ``dim`` (and, for a scatter from a tensor, no
larger than ``src`` anywhere). jax's gather clamps and its scatter drops what falls
outside, so an index past ``self`` off ``dim`` gave made-up rows (gather) or silently
dropped writes (scatter) where CPU raises. Index values are range-checked on the device
(indexing.py's ``_check_range``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax.ops.indexing import _check_range, _update
from torchjax.ops.registry import lowering
from torchjax.ops.view_ops import _dim
from torchjax.tensor import dtypes

aten = torch.ops.aten


def _sizes(shape) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def _nonempty(shape) -> tuple:
    """torch's ``ensure_nonempty_size``: a 0-d tensor counts as one of size 1."""
    return tuple(shape) or (1,)


def _gather_shape_check(self, index, dim):
    """torch's ``gather_shape_check`` (dims already equal)."""
    have, want = _nonempty(self.shape), _nonempty(index.shape)
    for d, n in enumerate(want):
        if d != dim and n > have[d]:
            raise RuntimeError(
                f"Size does not match at dimension {d} expected index {_sizes(index.shape)} "
                f"to be no larger than self {_sizes(self.shape)} apart from dimension {dim}"
            )


def _scatter_shape_check(self, index, dim, src):
    """torch's ``scatter_shape_check`` (``src``: the source tensor, None for a value)."""
    have, want = _nonempty(self.shape), _nonempty(index.shape)
    wrong = any(n > have[d] for d, n in enumerate(want) if d != dim)
    if src is None:
        if wrong:
            raise RuntimeError(
                f"Expected index {_sizes(index.shape)} to be no larger than self "
                f"{_sizes(self.shape)} apart from dimension {dim}"
            )
        return
    given = _nonempty(src.shape)
    if not wrong:
        for d, n in enumerate(want):
            if d >= len(given):  # ensure_nonempty_size's own dim wrap refuses it
                raise IndexError(
                    f"Dimension out of range (expected to be in range of "
                    f"[{-len(given)}, {len(given) - 1}], but got {d})"
                )
            if n > given[d]:
                wrong = True
                break
    if len(given) != len(want):
        raise RuntimeError("Index tensor must have the same number of dimensions as src tensor")
    if wrong:
        raise RuntimeError(
            f"Expected index {_sizes(index.shape)} to be no larger than self "
            f"{_sizes(self.shape)} apart from dimension {dim} and to be no larger size "
            f"than src {_sizes(src.shape)}"
        )


def _scatter_index(index, dim):
    """Full coordinates for gather/scatter: ``index`` along ``dim``, iota elsewhere."""
    coords = []
    for d in range(index.ndim):
        if d == dim:
            coords.append(index)
        else:
            shape = [1] * index.ndim
            shape[d] = index.shape[d]
            coords.append(jnp.arange(index.shape[d], dtype=np.int64).reshape(shape))
    return tuple(coords)


def _as_nd(self, index, op, dim, src=None):
    self = self.reshape(1) if self.ndim == 0 else self
    index = index.reshape(1) if index.ndim == 0 else index
    if index.ndim != self.ndim:
        raise RuntimeError(
            f"Index tensor must have the same number of dimensions as input "
            f"tensor (got {index.ndim} and {self.ndim}) (in aten::{op})"
        )
    # Any integer index is taken: torch's decompositions gather with the index they get
    # (nll_loss's uint8 target, which CPU's own kernel takes); a float one is refused.
    if not jnp.issubdtype(index.dtype, jnp.integer):
        family = "gather" if op == "gather" else "scatter"  # CPU's text names the family
        raise RuntimeError(f"{family}(): Expected dtype int32/int64 for index")
    dim = _dim(dim, self.ndim, op)
    if op == "gather":
        _gather_shape_check(self, index, dim)
    else:
        _scatter_shape_check(self, index, dim, src)
    _check_range(index, self.shape[dim], op, dim, RuntimeError, negative=False)
    return self, index, dim


@lowering(aten.gather.default, cpu_tensors=True)
def gather(self, dim, index, sparse_grad=False):
    """aten::gather - ``out[i][j] = self[index[i][j]][j]`` (for dim=0); out has index's
    shape (index may be smaller than self off ``dim``)."""
    out_shape = index.shape
    if index.size == 0:  # torch skips every check for an empty index
        return jnp.zeros(out_shape, dtype=self.dtype)
    arr, index, dim = _as_nd(self, index, "gather", dim)
    return arr[_scatter_index(index, dim)].reshape(out_shape)


def _scatter(self, dim, index, src, how, op, check_src=True):
    shape = self.shape
    if index.size == 0:  # torch skips every check for an empty index
        return self
    # A tensor source (not a fill: a number, or a Python float entering the executable
    # as a float64 value, Note [Python floats as values of an op's program]).
    if check_src and isinstance(src, jax.Array) and src.dtype != self.dtype:
        raise RuntimeError(f"{op}(): Expected self.dtype to be equal to src.dtype (in aten::{op})")
    tensor_src = src if isinstance(src, (jax.Array, np.ndarray)) and check_src else None
    arr, index, dim = _as_nd(self, index, op, dim, tensor_src)
    if isinstance(src, (jax.Array, np.ndarray)) and src.ndim:
        src = src[tuple(slice(0, n) for n in index.shape)]
    elif isinstance(src, (jax.Array, np.ndarray)):
        src = jnp.broadcast_to(src, index.shape)
    src = jnp.asarray(src).astype(arr.dtype)
    src = jnp.broadcast_to(src, index.shape)
    return _update(arr, _scatter_index(index, dim), src, how).reshape(shape)


@lowering(
    aten.scatter.src,
    aten.scatter.value,
    aten.scatter.reduce,
    aten.scatter.value_reduce,
    cpu_tensors=True,
)
def scatter(self, dim, index, src=None, value=None, reduce=None):
    """aten::scatter - ``self[index[i][j]][j] = src[i][j]`` (dim=0); ``reduce`` 'add' /
    'multiply' combines instead. Overloads: src tensor or scalar value."""
    src = value if src is None else src  # .value overloads pass the number positionally
    dtypes.check_scalar_fits(src, self.dtype, "scatter")
    # A Python float reaches here as a weakly typed 0-d value (Note [Python floats as
    # values of an op's program]); a tensor source is never weakly typed.
    fill = not isinstance(src, jax.Array) or (src.ndim == 0 and src.weak_type)
    return _scatter(self, dim, index, src, reduce or "set", "scatter", check_src=not fill)


@lowering(aten.scatter_add.default, cpu_tensors=True)
def scatter_add(self, dim, index, src):
    """aten::scatter_add - ``self[index[i][j]][j] += src[i][j]`` (dim=0)."""
    return _scatter(self, dim, index, src, "add", "scatter_add")


@lowering(aten.scatter_reduce.two, cpu_tensors=True)
def scatter_reduce(self, dim, index, src, reduce, include_self=True):
    """aten::scatter_reduce.two - combine ``src`` into ``self`` at ``index`` with sum /
    prod / mean / amax / amin; ``include_self=False`` ignores self's old values at the
    scattered positions. Integer mean rounds down (torch's floor division)."""
    if not include_self:
        if index.size:  # the source's checks before the fill's
            _as_nd(self, index, "scatter_reduce", dim, src)
        ident = {"sum": 0, "mean": 0, "prod": 1}.get(reduce)
        if ident is None:
            info = jnp.finfo if jnp.issubdtype(self.dtype, jnp.inexact) else jnp.iinfo
            info = info(self.dtype) if self.dtype != np.bool_ else None
            ident = (
                (True if reduce == "amin" else False)
                if info is None
                else (info.max if reduce == "amin" else info.min)
            )
            if jnp.issubdtype(self.dtype, jnp.floating):
                ident = np.inf if reduce == "amin" else -np.inf
        base = _scatter(
            self, dim, index, np.asarray(ident), "set", "scatter_reduce", check_src=False
        )
    else:
        base = self
    if reduce != "mean":
        return _scatter(base, dim, index, src, reduce, "scatter_reduce")
    if self.dtype == jnp.bool_:
        raise NotImplementedError(
            'aten::scatter_reduce: "scatter_gather_tensor_cpu_reduce_mean" not '
            "implemented for 'Bool'"
        )
    total = _scatter(base, dim, index, src, "sum", "scatter_reduce")
    ones = np.ones((), dtype=self.dtype)
    count = _scatter(
        jnp.full(self.shape, 1 if include_self else 0, dtype=self.dtype),
        dim,
        index,
        ones,
        "add",
        "scatter_reduce",
        check_src=False,
    )
    count = jnp.where(count == 0, jnp.ones((), self.dtype), count)
    if jnp.issubdtype(self.dtype, jnp.inexact):
        return total / count
    return jnp.floor_divide(total, count)
