"""Indexing: advanced indexing (``x[idx]``, ``x[idx] = v``), masked_fill, take, put
(index_select, index_add, index_copy and index_fill: index_along_dim.py; masked_scatter,
masked_select and nonzero: masking.py; gather and scatter: scatter_gather.py).

Index tensors may be int64/int32 (or bool masks for ``index``/``index_put``) and may live
on CPU (torch allows CPU indices for a device tensor): these lowerings are registered
with ``cpu_tensors=True``.

Data-dependent behaviour:
- Out-of-range indices raise ``IndexError`` in eager, like torch, without reading the
  index values on the op: the range check runs on the device and raises at the next
  synchronisation point (``.item()``, ``.cpu()``, ``print``, ``torch.tpu.synchronize()``),
  or at the op in immediate mode (``TORCHJAX_SYNC_CHECKS=1``); Note [Device-side checks]
  in torchjax/device/_checks.py. Under ``torchjax.jit`` and ``torch.compile`` the check
  is an output of the program, raised the same way after the call (Note [Device checks
  of compiled programs]); only where no Python runs after the program (a user's own
  ``jax.jit``) do jax's gather/scatter semantics apply unchecked: ``x[idx]`` clamps,
  ``index_select``/``take`` fill NaN (jnp.take), scatters drop out-of-range updates,
  and ``index_copy``/``index_put`` at a run of positions clamp them (Note [Index writes
  at a run of positions] in torchjax/ops/index_runs.py).
- Bool masks in ``index``/``index_put``, ``masked_select``, ``nonzero`` and
  ``repeat_interleave`` (layout.py) have data-dependent output shapes: eager only; under
  jit they raise DataDependentError (Note [One error layer]; ``torch.where(mask, ...)``
  keeps the shape fixed). The exception: ``index_put`` with one mask whose selected
  elements all get the same values (``x[x < 0] = 0``) is a ``where`` (``_masked_put``).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax.device import _checks
from torchjax.ops import index_runs
from torchjax.ops.registry import functional_handler, handler, lowering, precheck
from torchjax.ops.schema import arg
from torchjax.ops.view_ops import _dim
from torchjax.tensor import dtypes
from torchjax.tensor._tensor import JaxTensor

aten = torch.ops.aten
_ALL = slice(None)


def _concrete(x) -> bool:
    return _checks.concrete(x)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _outside(idx, lo, hi):
    # (any index outside [lo, hi), the first such index: the largest if one is too
    # large, else the smallest): one executable op by op, fused into the op when traced.
    mn, mx = jnp.min(idx), jnp.max(idx)
    return (mn < lo) | (mx >= hi), jnp.where(mx >= hi, mx, mn)


def require_in_range(idx, lo, hi, exc, template, *, deferred: bool = True) -> None:
    """A device check (Note [Device-side checks]) that every index is in [lo, hi);
    ``template`` names the op and may have ``{value}`` for the offending index;
    ``deferred=False``: made at the op."""
    if idx.size == 0:
        return
    bad, value = _outside(jnp.asarray(idx), lo, hi)
    # A function of the bounds and the index alone: one check per distinct index within
    # a trace (Note [Device checks of compiled programs]).
    _checks.require(bad, value, exc, template, deferred=deferred, depends=((lo, hi), (idx,)))


def _check_range(idx, n, op, dim, exc=IndexError, negative=True):
    """``exc`` (IndexError, RuntimeError for gather/scatter, as torch) when any index is
    outside [-n, n), or [0, n) for the ops that do not wrap negative indices (gather,
    scatter, index_select, index_add, index_copy: CPU refuses -1 there), on the device."""
    require_in_range(
        idx,
        -n if negative else 0,
        n,
        exc,
        f"index {{value}} is out of bounds for dimension {dim} with size {n} (in aten::{op})",
    )


def _check_index_dtype(idx, op):
    if not (jnp.issubdtype(idx.dtype, jnp.integer) or idx.dtype == np.bool_):
        raise IndexError(
            f"tensors used as indices must be long, int, byte or bool tensors, "
            f"got {idx.dtype} (in aten::{op})"
        )


def _check_mask(mask, self, d, op):
    if d + mask.ndim > self.ndim:
        raise IndexError(
            f"too many indices for tensor of dimension {self.ndim} "
            f"(got {d + mask.ndim}) (in aten::{op})"
        )
    for k in range(mask.ndim):
        if mask.shape[k] != self.shape[d + k]:
            raise IndexError(
                f"The shape of the mask {list(mask.shape)} at index {k} does not "
                f"match the shape of the indexed tensor {list(self.shape)} at index "
                f"{d + k} (in aten::{op})"
            )


def _advanced_index(self, indices, op):
    """Torch's list of optional index tensors -> a jnp index tuple (masks expanded)."""
    if len(indices) > self.ndim:
        raise IndexError(
            f"too many indices for tensor of dimension {self.ndim} "
            f"(got {len(indices)}) (in aten::{op})"
        )
    out, d = [], 0
    for idx in indices:
        if idx is None:
            out.append(_ALL)
            d += 1
            continue
        _check_index_dtype(idx, op)
        if idx.dtype in (np.bool_, np.uint8):
            mask = idx.astype(np.bool_)
            _check_mask(mask, self, d, op)
            out.extend(jnp.nonzero(mask))  # data-dependent: eager only
            d += mask.ndim
            continue
        if self.shape[d] == 0 and idx.size:
            # Known from shapes alone: raised at the call, with CPU's text (JAX's gather
            # refused the slice with a TypeError).
            raise IndexError("index is out of bounds for dimension with size 0")
        _check_range(idx, self.shape[d], op, d)
        out.append(idx)
        d += 1
    shapes = [list(i.shape) for i in out if i is not _ALL]
    try:
        np.broadcast_shapes(*map(tuple, shapes))
    except ValueError:
        listed = ", ".join(map(str, shapes))
        raise IndexError(
            "shape mismatch: indexing tensors could not be broadcast together with "
            f"shapes {listed} (in aten::{op})"
        ) from None
    return tuple(out)


@precheck(aten.index.Tensor, aten.index_put, aten._index_put_impl)
def _uint8_masks_are_deprecated(args, kwargs):
    """ATen's warning for a uint8 index: at every such call, once per uint8 index tensor,
    with its text (trailing space included), as its TORCH_WARN in expandTensors."""
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    for i in indices or ():
        if isinstance(i, torch.Tensor) and i.dtype == torch.uint8:
            warnings.warn(
                "indexing with dtype torch.uint8 is now deprecated, please use a dtype "
                "torch.bool instead. ",
                UserWarning,
                stacklevel=4,
            )


@lowering(aten.index.Tensor, cpu_tensors=True)
def index(self, indices):
    """aten::index.Tensor - ``self[indices]`` with a list of optional index tensors.

    None keeps a dim; int tensors broadcast together (numpy placement rules, which torch
    shares); bool masks select their nonzero positions. Reference: torch.Tensor.__getitem__.
    """
    if not indices:
        raise IndexError("at least one index must be provided")  # CPU's check
    return self[_advanced_index(self, indices, "index.Tensor")]


def index_put(self, indices, values, accumulate=False, unsafe=False):
    """aten::index_put - ``self[indices] = values`` (or ``+=`` when ``accumulate``).

    ``values`` broadcasts to the indexed shape and must have ``self``'s dtype (torch's
    check). Duplicate indices without accumulate: one of the writes wins, as in torch.
    """
    _check_put_dtype(self, indices, values)
    masked = _masked_put(self, indices, values, accumulate)
    if masked is not None:
        return masked
    index = _advanced_index(self, indices, "index_put")
    _check_put_shape(self, index, values)
    return _update(self, index, values, "add" if accumulate else "set")


def _index_put_run(self, indices, values, accumulate=False, unsafe=False):
    """aten::index_put with one integer index, after leading full dims, known to name a
    run of positions (``index_runs.known_run``), without ``accumulate``: a
    dynamic-update-slice (Note [Index writes at a run of positions]). The same checks as
    ``index_put``, in its order."""
    _check_put_dtype(self, indices, values)
    index = _advanced_index(self, indices, "index_put")
    _check_put_shape(self, index, values)
    d, idx = len(index) - 1, index[-1]
    indexed = (*self.shape[:d], *idx.shape, *self.shape[d + 1 :])
    update = jnp.broadcast_to(values, indexed).reshape(
        (*self.shape[:d], idx.size, *self.shape[d + 1 :])
    )
    return index_runs.write_run(self, d, idx, update, negative=True)


def _check_put_dtype(self, indices, values) -> None:
    if values.dtype != self.dtype:
        arrays = (self, values, *(i for i in indices if i is not None))
        if not any(isinstance(a, jax.core.Tracer) for a in arrays):
            _check_put_shape(self, _advanced_index(self, indices, "index_put"), values)
        raise RuntimeError(  # after the shape, as CPU checks them
            f"Index put requires the source and destination dtypes match, got "
            f"{dtypes.aten_type_name(self.dtype)} for the destination and "
            f"{dtypes.aten_type_name(values.dtype)} for the source. (in aten::index_put)"
        )


def _put_at_run(self, indices, accumulate) -> bool:
    """Whether ``index_put`` writes one run of positions (Note [Index writes at a run of
    positions]): one integer index after leading full dims, no ``accumulate``."""
    if accumulate or not indices:
        return False
    lead = 0
    while lead < len(indices) and indices[lead] is None:
        lead += 1
    if lead != len(indices) - 1 or lead >= self.dim():
        return False
    return index_runs.known_run(indices[lead], self.shape[lead], negative=True)


def _put_handler(func):
    general = functional_handler(func, index_put, cpu_tensors=True)
    at_run = functional_handler(func, _index_put_run, cpu_tensors=True)

    def put(args, kwargs):
        """aten::index_put - ``index_put``, or ``_index_put_run`` where the index names a
        run of positions (Note [Index writes at a run of positions])."""
        self, indices = arg(args, kwargs, 0, "self"), arg(args, kwargs, 1, "indices")
        accumulate = arg(args, kwargs, 3, "accumulate", False)
        return (at_run if _put_at_run(self, indices, accumulate) else general)(args, kwargs)

    return put


for _ov in (aten.index_put.default, aten._index_put_impl.default):
    handler(_ov)(_put_handler(_ov))


def _check_put_shape(self, index, values) -> None:
    """ATen's check that ``values`` broadcasts to the indexed shape."""
    indexed = jax.eval_shape(lambda a: a[index], jax.ShapeDtypeStruct(self.shape, self.dtype))
    try:
        fits = np.broadcast_shapes(values.shape, indexed.shape) == indexed.shape
    except ValueError:
        fits = False
    if not fits:
        raise RuntimeError(
            f"shape mismatch: value tensor of shape {list(values.shape)} cannot be "
            f"broadcast to indexing result of shape {list(indexed.shape)} (in aten::index_put)"
        )


def _cpu_scalar_mask(self, indices, values):
    """ATen's ``canDispatchToMaskedFill``: ``index_put_`` of a one-element CPU value at
    one bool (or uint8) mask on the device is ``masked_fill_`` with the value as a
    number, so its dtype need not be ``self``'s (``y[mask] = torch.tensor(0)``, CPU's
    and CUDA's way). The mask unsqueezed over the dims after it, or None."""
    if isinstance(values, JaxTensor) or not isinstance(values, torch.Tensor):
        return None
    if values.numel() != 1:
        return None
    mask, lead, n = None, 0, 0
    for idx in indices:
        if idx is None:
            n += 1
            continue
        if mask is not None or not isinstance(idx, JaxTensor):
            return None
        if idx.dtype not in (torch.bool, torch.uint8):
            return None
        _check_mask(idx, self, n, "index_put_")
        mask, lead, n = idx, n, n + idx.dim()
    if mask is None:
        return None
    if mask.dtype != torch.bool:  # ATen's masked_fill_ then refuses it
        raise RuntimeError(
            "masked_fill_ only supports boolean masks, but got mask with dtype unsigned char"
        )
    # At its own dims: ones for the dims before it (leading None) and after it.
    after = self.dim() - lead - mask.dim()
    return aten.view.default(mask, [1] * lead + list(mask.shape) + [1] * after)


@functools.cache
def _index_put_in_place():
    from torchjax.ops import registry, writeback  # the registry imports this module

    func = aten.index_put_.default
    return writeback.inplace_handler(func, registry._handler_for(aten.index_put.default))


@handler(aten.index_put_.default)
def index_put_(args, kwargs):
    """aten::index_put_ - ``self[indices] = values``; a one-element CPU value at one mask
    is ``masked_fill_`` (``_cpu_scalar_mask``), else the in-place form of ``index_put``."""
    self, indices, values = args[0], args[1], args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if not accumulate:
        mask = _cpu_scalar_mask(self, indices, values)
        if mask is not None:
            return aten.masked_fill_.Scalar(self, mask, values.item())
    return _index_put_in_place()(args, kwargs)


def _masked_put(self, indices, values, accumulate):
    """``self[..., mask] = values`` where every selected element gets the same values
    (a scalar, or values broadcasting over the dims after the mask) as a ``where``: the
    same result as a scatter at ``nonzero(mask)``, with a fixed shape, so it runs under
    ``torchjax.jit`` and reads nothing back to the host. None when it does not apply."""
    lead = 0
    while lead < len(indices) and indices[lead] is None:
        lead += 1
    if lead != len(indices) - 1:
        return None
    mask = indices[lead]
    if mask.dtype not in (np.bool_, np.uint8) or mask.ndim == 0:
        return None
    rest = self.shape[lead + mask.ndim :]
    shape = values.shape
    while len(shape) > len(rest) and shape[0] == 1:
        shape = shape[1:]
    try:
        if len(shape) > len(rest) or np.broadcast_shapes(shape, rest) != tuple(rest):
            return None  # one value per selected element: the count is data-dependent
    except ValueError:
        return None  # refused with the indexed shape by the general path
    _check_mask(mask, self, lead, "index_put")
    full = mask.astype(np.bool_).reshape((1,) * lead + mask.shape + (1,) * len(rest))
    values = values.reshape(shape)
    if accumulate:
        return self + jnp.where(full, values, jnp.zeros((), self.dtype))
    return jnp.where(full, values, self)


_AT_METHODS = {
    "set": "set",
    "add": "add",
    "multiply": "multiply",
    "sum": "add",
    "prod": "multiply",
    "amax": "max",
    "amin": "min",
}


def _update(arr, index, values, how):
    """``arr.at[index].<how>(values)``; bool add/multiply run in int32 and map back to
    bool (torch's bool sum is logical or, prod logical and)."""
    method = _AT_METHODS[how]
    if arr.dtype == np.bool_ and method in ("add", "multiply"):
        out = getattr(arr.astype(np.int32).at[index], method)(values.astype(np.int32))
        return out != 0
    return getattr(arr.at[index], method)(values)


# ATen's names for the C++ type a fill value is converted to.
_CPP_TYPES = {"float32": "float", "float64": "double", "int64": "int64_t", "int32": "int"}


def _check_fill_value(self, value):
    # torch's checks: a 0-d value tensor, and no complex value into a real tensor.
    ndim = getattr(value, "ndim", 0)
    if ndim:
        raise RuntimeError(
            "masked_fill_ only supports a 0-dimensional value tensor, but got tensor with "
            f"{ndim} dimension(s). (in aten::masked_fill)"
        )
    complex_value = isinstance(value, complex) or jnp.iscomplexobj(value)
    if complex_value and not jnp.issubdtype(self.dtype, jnp.complexfloating):
        name = _CPP_TYPES.get(str(self.dtype), str(self.dtype))
        raise RuntimeError(
            f"value cannot be converted to type {name} without overflow (in aten::masked_fill)"
        )


@lowering(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(self, mask, value):
    """aten::masked_fill - ``value`` where ``mask`` (bool, broadcast with self)."""
    if mask.dtype != np.bool_:
        raise RuntimeError(
            f"masked_fill_ only supports boolean masks, but got mask with "
            f"dtype {mask.dtype} (in aten::masked_fill)"
        )
    _check_fill_value(self, value)
    dtypes.check_scalar_fits(value, self.dtype, "masked_fill")
    return jnp.where(mask, jnp.asarray(value).astype(self.dtype), self)


@lowering(aten.take.default, cpu_tensors=True)
def take(self, index):
    """aten::take - ``self.flatten()[index]`` (negative wraps); result has index's shape."""
    flat = self.reshape(-1)
    _check_range(index, flat.shape[0], "take", 0)
    return flat[index]


@lowering(aten.take_along_dim.default)
def take_along_dim(self, indices, dim=None):
    """aten::take_along_dim - ``gather`` after broadcasting self and indices off ``dim``
    (None: both flattened). A gather in torch: negative indices are refused."""
    if dim is None:
        flat = self.reshape(-1)
        _check_range(indices, flat.shape[0], "take_along_dim", 0, RuntimeError, negative=False)
        return jnp.take_along_axis(flat, indices.reshape(-1) % flat.shape[0], axis=0)
    dim = _dim(dim, self.ndim, "take_along_dim")
    # torch.take_along_dim is a gather: a negative index is refused, not wrapped.
    _check_range(indices, self.shape[dim], "take_along_dim", dim, RuntimeError, negative=False)
    return jnp.take_along_axis(self, indices % self.shape[dim], axis=dim, mode="clip")


@lowering(aten.put.default, cpu_tensors=True)
def put(self, index, source, accumulate=False):
    """aten::put - ``self.flatten()[index] = source`` (``+=`` when ``accumulate``);
    negative indices wrap. The backward of ``take``. CPU's checks, in its order."""
    if index.dtype != np.int64:
        got = dtypes.aten_type_name(index.dtype)
        raise RuntimeError(f"put_(): Expected a long tensor for index, but got {got}")
    if source.dtype != self.dtype:
        raise RuntimeError(
            "put_(): self and source expected to have the same dtype, but got self.dtype = "
            f"{dtypes.aten_type_name(self.dtype)} and source.dtype = "
            f"{dtypes.aten_type_name(source.dtype)}"
        )
    if source.size != index.size:
        raise IndexError(
            "put_(): Expected source and index to have the same number of elements, but got "
            f"source.numel() = {source.size}, index.numel() = {index.size}"
        )
    if self.size == 0 and index.size:
        raise IndexError("put_(): Tried to put elements into an empty tensor")
    flat = self.reshape(-1)
    _check_range(index, flat.shape[0], "put", 0)
    how = "add" if accumulate else "set"
    return _update(flat, index.reshape(-1), source.reshape(-1), how).reshape(self.shape)
