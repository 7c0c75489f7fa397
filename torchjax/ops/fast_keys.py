"""The keys of the eager fast path (Note [Compiled lowerings] in
torchjax/ops/cached_compute.py): what a call's arguments give without the template
(``tensors`` for a list of tensors), and what a new executable's template gives
(``key``), equal for the same call so the lookup finds that executable."""

from __future__ import annotations

import torch

from torchjax.ops import fused as _fused
from torchjax.ops.templates import (
    ARRAY,
    FAST_SCALARS,
    STATIC,
    Astype,
    Seq,
    View,
    static,
    static_entry,
)
from torchjax.tensor._storage import contiguous_strides
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
            lazy = storage.lazy
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


def key(args, tmpl, pidx):
    """The key the fast path looks ``tmpl``'s executable up by: (dtype, size) per tensor
    read before the call, (dtype, (size, stride, offset or None when it is an argument,
    storage numel)) per view read inside it, (dtype, (size, source dtype)) per tensor
    converted inside it, (type, None) per Python number cast as an
    argument (positions ``pidx``), (template entry, STATIC) per static argument, a
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
