"""Strided views of a flat buffer: row-major strides, and the plans that read and write
a (size, stride, offset) view of a storage's flat array (Note [Aliasing through views]
in torchjax/tensor/_storage.py): one contiguous run, a slice of a stride grid with a
transpose, or a gather; each plan's read and write are one cached executable.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torchjax import _budget
from torchjax._compat.jax import trace_state_clean

# Elements up to which a value made from concrete arrays inside a trace is computed there
# and then (Note [Values made from constants inside a trace] in torchjax/ops/executables.py,
# which folds ops by the same bound): a view read here is one such value.
FOLD_ELEMENTS = 1 << 16


def contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``size`` (asked several times per op: cached)."""
    try:
        return _cached_strides(size)
    except TypeError:  # a list: unhashable
        return _strides(size)


def read_strides(size, stride) -> tuple[int, ...]:
    """``stride`` with each size-1 dimension's stride made the contiguous one: the strides
    that decide a read (a size-1 dimension's stride moves nothing), so views that read the
    same elements have one layout key (Note [Views of a growing storage] in
    torchjax/ops/view_signatures.py)."""
    if 1 not in size:
        return tuple(stride)
    return tuple(
        c if n == 1 else s for n, s, c in zip(size, stride, contiguous_strides(tuple(size)))
    )


def _strides(size) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


_cached_strides = functools.lru_cache(maxsize=8192)(_strides)


class _ContiguousPlan:
    """A view that is one contiguous run of the flat buffer."""

    def __init__(self, size, offset, numel):
        self.size, self.offset, self.numel = size, offset, numel

    def read(self, flat, offset=None):
        if offset is not None:  # Note [View offsets as arguments]
            return lax.dynamic_slice(flat, (offset,), (self.numel,)).reshape(self.size)
        run = (
            flat
            if (self.offset == 0 and self.numel == flat.shape[0])
            else (lax.slice(flat, (self.offset,), (self.offset + self.numel,)))
        )
        return run.reshape(self.size)

    def write(self, flat, value, offset=None):
        if offset is not None:  # Note [View offsets as arguments]
            return lax.dynamic_update_slice(flat, value.reshape(-1), (offset,))
        if self.offset == 0 and self.numel == flat.shape[0]:
            return value.reshape(-1)
        return lax.dynamic_update_slice(flat, value.reshape(-1), (np.int32(self.offset),))


class _SlicePlan:
    """A non-overlapping view expressible as reshape -> slice -> transpose -> expand.

    Dimensions of size 1 are dropped and stride-0 (expanded) dimensions are broadcast.
    The remaining strides, sorted descending, must each divide the previous one with room
    for the dimension (s[i-1] >= n[i] * s[i]); then the flat run starting at ``offset``
    reshaped to (n0, s0/s1, ..., s_k) and sliced to [:n0, :n1, ..., :n_k, 0] is the view
    with its dimensions sorted by stride.
    """

    def __init__(self, storage_numel, size, stride, offset):
        real = [d for d in range(len(size)) if size[d] != 1 and stride[d] != 0]
        order = sorted(real, key=lambda d: -stride[d])
        s = [stride[d] for d in order]
        n = [size[d] for d in order]
        for i in range(1, len(s)):
            if s[i - 1] % s[i] or s[i - 1] < n[i] * s[i]:
                raise _NoPlan
        self.size = size
        self.order = order
        self.offset = offset
        if not order:
            self.span, self.shape, self.index = 1, (1,), (0,)
        else:
            inner = s[-1]
            self.shape = (n[0],) + tuple(s[i - 1] // s[i] for i in range(1, len(s))) + (inner,)
            self.span = n[0] * s[0]
            self.index = tuple(slice(0, k) for k in n) + (0,)
        self.pad = max(0, offset + self.span - storage_numel)
        # How far the window can run past the view's last element: the padding a read at
        # any offset needs (Note [View offsets as arguments]).
        self.tail = self.span - (sum((k - 1) * st for k, st in zip(n, s)) + 1)
        self.sorted_size = tuple(size[d] for d in order)
        # Transpose from stride order back to dim order (over the real dims only).
        self.perm = tuple(sorted(range(len(order)), key=lambda i: order[i]))
        self.real_size = tuple(size[d] for d in sorted(order))
        self.expand = any(stride[d] == 0 and size[d] != 1 for d in range(len(size)))
        self.keep_shape = tuple(size[d] if d in set(order) else 1 for d in range(len(size)))
        self.grid = self._grid(storage_numel, n, s, offset) if self.pad else None

    @staticmethod
    def _grid(numel, n, s, offset):
        """(grid shape, start, limit) reading the view as a slice of the whole storage
        reshaped by the view's strides, where the storage is a whole number of the largest
        stride and the view crosses no row of that grid; else None (Note [View offsets
        inside a trace]: a window running past the storage's end needs no padding then)."""
        if not n or numel % s[0]:
            return None
        shape = (numel // s[0], *(s[i - 1] // s[i] for i in range(1, len(s))), s[-1])
        start, rest = [], offset
        for size in (*s, 1):
            start.append(rest // size)
            rest %= size
        limit = tuple(b + k for b, k in zip(start, (*n, 1)))
        if any(lim > dim for lim, dim in zip(limit, shape)):
            return None
        return shape, tuple(start), limit

    def _window(self, flat, offset=None):
        if offset is not None:  # Note [View offsets as arguments]
            if self.tail:
                flat = jnp.pad(flat, (0, self.tail))
            return lax.dynamic_slice(flat, (offset,), (self.span,)).reshape(self.shape)
        if self.pad:
            flat = jnp.pad(flat, (0, self.pad))
        return lax.slice(flat, (self.offset,), (self.offset + self.span,)).reshape(self.shape)

    def read(self, flat, offset=None):
        if offset is None and self.grid is not None:
            shape, start, limit = self.grid
            part = lax.slice(flat.reshape(shape), start, limit)[..., 0]
        else:
            part = self._window(flat, offset)[self.index]
        part = jnp.transpose(part, self.perm) if self.perm != tuple(range(len(self.perm))) else part
        part = part.reshape(self.keep_shape)
        return jnp.broadcast_to(part, self.size) if self.expand else part

    def write(self, flat, value, offset=None):
        if self.expand:
            raise _NoPlan
        value = value.reshape(self.real_size)
        inv = tuple(np.argsort(self.perm))
        value = jnp.transpose(value, inv) if inv != tuple(range(len(inv))) else value
        window = self._window(flat, offset).at[self.index].set(value).reshape(-1)
        if offset is not None:  # Note [View offsets as arguments]
            # The window as read: past the end by up to ``tail`` padded elements.
            n = flat.shape[0]
            padded = jnp.pad(flat, (0, self.tail)) if self.tail else flat
            return lax.dynamic_update_slice(padded, window, (offset,))[:n]
        if self.pad:
            head = lax.slice(flat, (0,), (self.offset,))
            body = lax.slice(window, (0,), (flat.shape[0] - self.offset,))
            return jnp.concatenate([head, body])
        return lax.dynamic_update_slice(flat, window, (np.int32(self.offset),))


class _GatherPlan:
    """Any strided view: explicit flat indices (used when no slice plan exists)."""

    def __init__(self, size, stride, offset):
        self.offset = offset
        idx = np.full(size, offset, dtype=np.int64)
        for d, (n, st) in enumerate(zip(size, stride)):
            shape = [1] * len(size)
            shape[d] = n
            idx = idx + (np.arange(n, dtype=np.int64) * st).reshape(shape)
        self.idx = idx
        self.overlapping = len(np.unique(idx)) != idx.size

    def read(self, flat, offset=None):
        if offset is not None:
            return flat[(self.idx - self.offset) + offset]
        return flat[self.idx]

    def write(self, flat, value, offset=None):
        if self.overlapping:
            # torch's text for a zero stride. CPU runs other overlapping views (rows
            # of an as_strided window) element by element, each write seeing the last
            # (an order-dependent result); an op here computes every element at once.
            raise RuntimeError(
                "unsupported operation: more than one element of the written-to tensor "
                "refers to a single memory location. Please clone() the tensor before "
                "performing the operation. (On tpu an in-place op computes all elements "
                "at once, so a write through a view whose elements share memory has no "
                "defined result; CPU applies it element by element in memory order.)"
            )
        idx = self.idx if offset is None else (self.idx - self.offset) + offset
        return flat.at[idx.reshape(-1)].set(value.reshape(-1))


class _NoPlan(Exception):
    pass


class _Plan:
    def __init__(self, storage_numel, size, stride, offset):
        numel = math.prod(size)
        self.gather = None
        self._read = self._write = None
        if numel == 0:
            self.kind = "empty"
        elif stride == contiguous_strides(size) or numel == 1:
            self.kind = "contiguous"
            self.impl = _ContiguousPlan(size, offset, numel)
        else:
            self.size, self.stride, self.offset = size, stride, offset
            try:
                self.impl = _SlicePlan(storage_numel, size, stride, offset)
                self.kind = "slice"
            except _NoPlan:
                self.kind = "gather"
                self.impl = _GatherPlan(size, stride, offset)
        self.size = size
        # Whether the offset can be an argument of the read (Note [View offsets as
        # arguments]): up to int32's range.
        self.dynamic = self.kind != "empty" and offset < 2**31

    def read(self, flat, offset=None):
        if self.kind == "empty":
            return jnp.zeros(self.size, flat.dtype)
        return self.impl.read(flat, offset)

    # Op by op, a read or write is several jax primitives, each its own XLA dispatch and,
    # at a new shape or position, its own compile, kept in jax's op-by-op cache (up to
    # 4096 executables, outside any budget of ours); as one cached executable per plan
    # (jax's cache covers the storage's shape and dtype) it is one dispatch and at most
    # one compile, from the first use. Reads may take the offset as an argument: one
    # executable per layout, shared by every offset (Note [View offsets as arguments]).
    # Inside a trace (torchjax.jit, compiled lowerings) the jitted call inlines. Each
    # per-plan program is an entry of the process-wide budget (Note [Executable cache
    # budget] in torchjax/_budget.py); evicted, the plan compiles again on its next use.
    def read_array(self, arr, offset=None):
        """The view's values from the storage array ``arr`` (the storage's shape).
        ``offset``: this plan's layout read at that offset (a ``dynamic`` plan)."""
        if not trace_state_clean() and self._folds(arr):
            # Concrete inside a trace, as the op reading the view in its own program
            # would give (Note [Values made from constants inside a trace]).
            with jax.ensure_compile_time_eval():
                return self._read_array(arr, offset)
        return self._read_array(arr, offset)

    def _folds(self, arr) -> bool:
        """Whether a read of concrete ``arr`` inside a trace is computed now: small
        (``FOLD_ELEMENTS``) and outside a mesh, as an op from constants is."""
        return (
            not isinstance(arr, jax.core.Tracer)
            and arr.size <= FOLD_ELEMENTS
            and math.prod(self.size) <= FOLD_ELEMENTS
            and jax.sharding.get_abstract_mesh().empty
        )

    def _read_array(self, arr, offset):
        if offset is not None:
            return _offset_reader(self._layout)(arr, np.int32(offset))
        read = self._read
        if read is None:
            read = self._read = jax.jit(lambda arr: self.read(arr.reshape(-1)))
            _budget.admit(read, lambda: self._evict("_read", read))
        else:
            _budget.hit(read)
        return read(arr)

    def write_array(self, arr, value, offset=None):
        """The storage array ``arr`` with ``value`` written at the view. ``offset``: this
        plan's layout written at that offset (a ``dynamic`` plan)."""
        if offset is not None:
            return _offset_writer(self._layout)(arr, value, np.int32(offset))
        write = self._write
        if write is None:
            write = self._write = jax.jit(
                lambda arr, v: self.write(arr.reshape(-1), v).reshape(arr.shape)
            )
            _budget.admit(write, lambda: self._evict("_write", write))
        else:
            _budget.hit(write)
        return write(arr, value)

    def _evict(self, name, program):
        if getattr(self, name) is program:
            setattr(self, name, None)

    def write(self, flat, value, offset=None):
        if self.kind == "empty":
            return flat
        try:
            return self.impl.write(flat, value, offset)
        except _NoPlan:
            return _GatherPlan(self.size, self.stride, self.offset).write(flat, value, offset)


@functools.lru_cache(maxsize=4096)
def _plan(storage_numel, size, stride, offset) -> _Plan:
    plan = _Plan(storage_numel, tuple(size), tuple(stride), offset)
    plan._layout = (storage_numel, tuple(size), tuple(stride))
    return plan


# Note [View offsets as arguments]
# A view's storage offset is a run-time value of its read (``lax.dynamic_slice`` from a
# traced offset), not a constant of the program: ``t[:, i]`` for every ``i`` of a loop
# (a test comparing positions one by one, a decode step reading its slot) reads through
# one executable per layout (storage numel, size, stride), where a constant offset
# compiled one program per position, for the read and for every compiled op taking the
# view (ops/cached_compute.py keys views the same way). dynamic_slice clamps a start that would
# run past the end, so the window must lie inside the array: a slice plan's window can
# run past the view's last element by ``tail`` elements (a row-major block of a wider
# storage), so its dynamic read pads the flat storage by that constant first (XLA fuses
# the pad into the slice). Writes take the offset the same way (``x[i] = row`` in a loop
# is one program per layout, not one per ``i``): dynamic_update_slice of the window read
# at the offset, into the storage padded by the same ``tail``, then cut back.
# Note [View offsets inside a trace]
# Inside a trace (``torchjax.jit``, the Dynamo backend) the offset of a view of a traced
# storage is a constant of the read, not an argument: the program is traced once per
# signature, so nothing is shared by making it one, and as an argument it reached XLA as
# a constant fed through ``dynamic_slice`` of the storage padded by ``tail`` (the clamp
# guard above), which XLA does not fold back to a slice: in a Llama's compiled forward
# each rotary ``rotate_half`` (``-x[..., half:]``, ``cat``) kept a pad of the whole
# projection, a dynamic slice and its index arithmetic per read, four pads a layer. A
# static read is a ``lax.slice`` of the storage; where its window would run past the
# storage's end (``x[..., half:]`` of a row-major block) it is a slice of the storage
# reshaped by the view's strides (``_SlicePlan._grid``), still no pad.
def layout_plan(storage_numel, size, stride) -> _Plan:
    """The read plan of a layout at any offset (built at offset 0: the kind, window
    shape and permutation do not depend on the offset)."""
    return _plan(storage_numel, tuple(size), tuple(stride), 0)


# One reader per layout, each an entry of the process-wide budget (Note [Executable cache
# budget] in torchjax/_budget.py): a loop over many shapes evicts the old ones.
_OFFSET_READERS: dict = {}


def _offset_reader(layout):
    def build():
        plan = layout_plan(*layout)
        return jax.jit(lambda arr, offset: plan.read(arr.reshape(-1), offset))

    return _budget.cached(_OFFSET_READERS, layout, build)


_OFFSET_WRITERS: dict = {}


def _offset_writer(layout):
    def build():
        plan = layout_plan(*layout)
        return jax.jit(
            lambda arr, v, offset: plan.write(arr.reshape(-1), v, offset).reshape(arr.shape)
        )

    return _budget.cached(_OFFSET_WRITERS, layout, build)
