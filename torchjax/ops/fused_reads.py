"""Reads of recorded values in fused eager mode: a view or a dtype change of a pending
value recorded as one more node of its segment (Note [Fused eager] in
torchjax/ops/fused.py)."""

from __future__ import annotations

import math

import numpy as np

from torchjax._compat.jax import trace_state_clean
from torchjax.ops import fused as _fused
from torchjax.ops.promotion import astype
from torchjax.tensor._storage import Storage, layout_plan

# Reads recorded from the copy handlers and from compiled calls that read their views
# first (``.to(dtype)``, ``clone()``, ``cat`` of a growing cache's new slice, when the
# tensor's storage is pending): one traceable function per (storage layout, view layout,
# target dtype), its offset an argument (Note [View offsets as arguments] in
# torchjax/tensor/_storage.py), so segment keys are stable and a decode step's
# ``logits[:, -1, :].float()`` does not end the segment.
_READS: dict = {}


class _Read:
    """A traceable view read and ``astype`` with the per-op executable's calling
    convention."""

    def __init__(self, layout, jdt):
        self.fused_shapes = {}
        plan = layout_plan(*layout) if layout is not None else None

        def read(a, offset=None):
            if plan is not None:
                a = plan.read(a.reshape(-1), offset)
            if jdt is not None and a.dtype != jdt:
                a = astype(a, jdt)
            return a, None

        self.__wrapped__ = read


def _reader(key, layout, jdt):
    reader = _READS.get(key)
    if reader is None:
        if len(_READS) > 4096:
            _READS.clear()
        reader = _READS[key] = _Read(layout, jdt)
    return reader


def record_convert(p: _fused.Pending, jdt):
    """``p.astype(jdt)`` recorded in this thread's segment (a ``Pending``)."""
    return _fused.record(_reader((p.shape, p.dtype, None, jdt), None, jdt), [p])


def record_read(t, jdt=None):
    """The value of tpu tensor ``t`` (cast to ``jdt`` if given) recorded in this
    thread's segment, as a ``Pending``; None when ``t``'s storage is not a pending value of
    a recording thread (the caller reads ``t`` as usual)."""
    s = t._storage
    p = s.lazy
    if p.__class__ is not _fused.Pending or s.__class__ is not Storage or not _fused.recording():
        return None
    if not trace_state_clean():  # Note [Nothing is recorded under a trace]
        return None
    size, stride, offset = t._size, t._stride, t._offset
    if _fused.whole(t):
        if jdt is None or jdt == p.dtype:
            return p  # arrays are immutable: the same value serves a copy
        return record_convert(p, jdt)
    if math.prod(size) == 0 or offset >= 2**31:
        return None
    layout = (s.numel, size, stride)
    key = (p.shape, p.dtype, layout, jdt)
    out = _fused.record(_reader(key, layout, jdt), [p, np.int32(offset)])
    if out.segment is not None:
        # Held by no storage until the caller wraps or consumes it: kept through a flush.
        out.segment.keep.append(out)
    return out
