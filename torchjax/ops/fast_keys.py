"""The keys of the eager fast path (Note [Compiled lowerings] in
torchjax/ops/cached_compute.py): what a call's arguments give without the template
(``call_key``, ``tensors`` for a list of tensors), and what a new executable's template
gives (``key``), equal for the same call so the lookup finds that executable."""

from __future__ import annotations

import numpy as np
import torch

from torchjax.ops import fused as _fused
from torchjax.ops.deferred_casts import Cast, read_whole
from torchjax.ops.templates import (
    ARRAY,
    FAST_SCALARS,
    FLOAT,
    STATIC,
    Astype,
    Seq,
    View,
    static,
    static_entry,
)
from torchjax.tensor._shadows import HostValues
from torchjax.tensor._storage import _plan, contiguous_strides
from torchjax.tensor._tensor import JaxTensor

# Index dtypes that make an indexing op's result shape data-dependent.
MASK_DTYPES = frozenset({torch.bool, torch.uint8})
# The key's marker of a list of tensors, and the template entry of None.
TENSORS = object()
_NONE_ENTRY = static(None)
_default_dtype = torch.get_default_dtype


def tensors(seq, vals, masks: bool):
    """``(type, ((dtype, size) or None, ...))`` of a list of tpu tensors whose values
    are at hand (or None entries), their arrays appended to ``vals``; None for any
    other list (views still to read, masks of an indexing op (``masks``), CPU tensors)."""
    parts = []
    for y in seq:
        if y is None:
            parts.append(None)
            continue
        if y.__class__ is not JaxTensor:
            return None
        if masks and y.dtype in MASK_DTYPES:
            return None
        storage = y._storage
        if y._cache_version == storage.version:
            vals.append(y._cache)
        else:
            size, stride, offset = y._size, y._stride, y._offset
            if not (storage.covers(size, stride, offset) and stride == contiguous_strides(size)):
                return None
            lazy = _made(storage)
            if lazy is None:
                arr = storage.arr
                y._cache, y._cache_version = arr, storage.version
            elif lazy.__class__ is _fused.Pending and _fused.recording():
                arr = lazy  # a recorded value (Note [Fused eager])
            else:
                return None
            vals.append(arr)
        parts.append((y.dtype, y._size))
    return (seq.__class__, tuple(parts))


def _made(storage):
    """``storage.lazy`` once host values waiting for a first device read are put (Note
    [Host values put on the device when first read]): an op reading them reads the
    array, on the fast path as any other."""
    lazy = storage.lazy
    if lazy.__class__ is HostValues:
        storage.arr  # noqa: B018 - makes the array
        return None
    return lazy


def key(args, tmpl, pidx):
    """The key the fast path looks ``tmpl``'s executable up by: (dtype, size) per tensor
    read before the call, (dtype, (size, stride, offset or None when it is an argument,
    storage numel)) per view read inside it, (dtype, (size, source dtype)) per tensor
    converted inside it, (type, None) per Python number cast as an
    argument (positions ``pidx``), (float, FLOAT) per Python float passed as a value of
    the program, (template entry, STATIC) per static argument, a
    ``tensors`` part per list of tensors; None when an argument is none of these."""
    sig = [_default_dtype()]
    for i, (a, e) in enumerate(zip(args, tmpl)):
        cls = a.__class__
        if cls is JaxTensor and e is ARRAY:
            sig.append(a.dtype)
            sig.append(a._size)
        elif cls is JaxTensor and e.__class__ is View:
            sig.append(a.dtype)
            sig.append((a._size, a._stride, e.offset, a._storage.numel))
        elif cls is JaxTensor and e.__class__ is Astype:
            sig.append(a.dtype)
            sig.append((a._size, e.source))
        elif cls in FAST_SCALARS and i in pidx and e is ARRAY:
            sig.append(cls)
            sig.append(None)
        elif cls is float and e is FLOAT:
            sig.append(cls)
            sig.append(FLOAT)
        elif e is not ARRAY and static_entry(a) == e:
            sig.append(e)
            sig.append(STATIC)
        elif (cls is list or cls is tuple) and e.__class__ is Seq and e.cls is cls:
            parts = []
            for y, ye in zip(a, e.entries):
                if y is None and ye == _NONE_ENTRY:
                    parts.append(None)
                elif y.__class__ is JaxTensor and ye is ARRAY:
                    parts.append((y.dtype, y._size))
                else:
                    return None
            sig.append((cls, tuple(parts)))
            sig.append(TENSORS)
        else:
            return None
    return tuple(sig)


def call_key(args, pidx, masks: bool, tidx=()):
    """``(key, executable arguments, indices of Python numbers among them or None,
    indices of Python floats passed as values or None)`` of a call without keyword
    arguments, read from ``args`` alone: the ``key`` its executable's template gave, so
    one dict lookup finds it. Floats at positions ``tidx`` are keyed as values of the
    program (Note [Python floats as values of an op's program] in
    torchjax/ops/cached_compute.py): a key whose executable took them as constants
    instead is not found here. None when an argument needs the template (a tensor whose
    array is not made yet, a list holding a view)."""
    # The default dtype decides some promotions (int * 0.5, int / int).
    sig = [_default_dtype()]
    vals = []
    scalars = floats = None
    for i, a in enumerate(args):
        cls = a.__class__
        if cls is JaxTensor:
            storage = a._storage
            if a._cache_version == storage.version:  # its value at hand
                sig.append(a.dtype)
                sig.append(a._size)
                vals.append(a._cache)
                continue
            lazy = _made(storage)
            if lazy is None:
                arr = storage.arr
            elif lazy.__class__ is _fused.Pending and _fused.recording():
                size = a._size
                if a._offset == 0 and size == lazy.shape and a._stride == lazy.out.strides:
                    # A whole recorded value (Note [Fused eager]), as below.
                    sig += (a.dtype, size)
                    vals.append(lazy)
                    continue
                arr = lazy
            elif lazy.__class__ is Cast and read_whole(a):
                # Its source, converted inside (as _entry passes it).
                sig += (a.dtype, (a._size, lazy.src.dtype))
                vals.append(lazy.src)
                continue
            else:
                return None
            size, stride, offset = a._size, a._stride, a._offset
            sig.append(a.dtype)
            vals.append(arr)
            if storage.covers(size, stride, offset) and stride == contiguous_strides(size):
                # The whole storage: its array, as _entry passes it.
                sig.append(size)
                if lazy is None:
                    a._cache, a._cache_version = arr, storage.version
                continue
            # A view still to read, read inside the executable (as _entry
            # passes it): keyed by its layout, its offset an argument if the
            # plan reads at a dynamic offset.
            numel = storage.numel
            if _plan(numel, size, stride, offset).dynamic:
                sig.append((size, stride, None, numel))
                vals.append(np.int32(offset))
            else:
                sig.append((size, stride, offset, numel))
        elif cls in FAST_SCALARS and i in pidx:
            # A Python number in a promoted position: keyed by its type, passed
            # cast to the computation dtype (as _call does).
            sig.append(cls)
            sig.append(None)
            scalars = (scalars or []) + [len(vals)]
            vals.append(a)
        elif cls is float and i in tidx:
            sig.append(cls)
            sig.append(FLOAT)
            floats = (floats or []) + [len(vals)]
            vals.append(a)
        else:
            # A static argument (eps, a dim list): keyed by its template entry.
            part = static_entry(a)
            if part is not None:
                sig.append(part)
                sig.append(STATIC)
                continue
            # A list of tensors (cat's inputs, an index list): keyed by each
            # one's (dtype, size), their arrays passed in order.
            part = tensors(a, vals, masks) if cls is list or cls is tuple else None
            if part is None:
                return None
            sig.append(part)
            sig.append(TENSORS)
    return tuple(sig), vals, scalars, floats
