"""Memory formats: the strides of a new tensor, and a storage laid out to match them.

Note [Memory formats on tpu]
torch gives a new tensor made "like" another (``clone``, ``contiguous``, ``empty_like``
and the ``*_like`` factories, ``_to_copy``) strides chosen by its ``memory_format``:
``contiguous_format``, ``channels_last`` / ``channels_last_3d`` (channels innermost), or
``preserve_format`` (the default), which keeps the input's strides when the input is
dense and non-overlapping (``x.t()``, a permute, a channels_last tensor) and otherwise
picks dense strides in the input's dimension order (``at::empty_like`` in
aten/src/ATen/native/TensorFactories.cpp). Code reads those strides (``is_contiguous``,
``view(-1)`` refusing a transposed clone), so a tpu result reports CPU's.

The rule is torch's own: ``result_strides`` runs ``clone`` on a meta tensor of the
input's sizes and strides, which runs the same C++ as CPU (``empty_like`` and
``_to_copy`` follow the same rule; checked against CPU for every format and layout in
tests/ops/test_copy.py). A result with non-contiguous strides is a storage holding the
data in memory order (the logical array transposed, dimensions by decreasing stride)
viewed at those strides: the representation a transpose of a contiguous tensor already
has (Note [Aliasing through views] in torchjax/tensor/_storage.py). The contiguous case,
by far the most common, is decided by a tuple comparison and never reaches the meta call.
"""

from __future__ import annotations

import functools
import math

import jax
import torch

from torchjax._compat.jax import x64_enter, x64_exit
from torchjax.tensor import dtypes
from torchjax.tensor._storage import Storage, contiguous_strides
from torchjax.tensor._tensor import make, view_of

_KEEPS_CONTIGUOUS = (None, torch.preserve_format, torch.contiguous_format)


def result_strides(size, stride, memory_format) -> tuple[int, ...]:
    """The strides torch gives ``empty_like`` (and ``clone``, ``_to_copy``) of a tensor
    of ``size`` and ``stride`` with ``memory_format`` (None: preserve_format)."""
    size, stride = tuple(size), tuple(stride)
    contiguous = contiguous_strides(size)
    if memory_format is torch.contiguous_format or (
        memory_format in _KEEPS_CONTIGUOUS and stride == contiguous
    ):
        return contiguous
    return _meta_strides(size, stride, memory_format)


@functools.lru_cache(maxsize=1024)
def _meta_strides(size, stride, memory_format) -> tuple[int, ...]:
    # clone, not empty_like: meta's empty_like is a Python reference that gives an empty
    # tensor contiguous strides where CPU keeps the input's; meta's clone runs ATen's.
    meta = torch.empty_strided(size, stride, device="meta")
    return tuple(meta.clone(memory_format=memory_format).stride())


@functools.lru_cache(maxsize=256)
def format_strides(size, memory_format) -> tuple[int, ...]:
    """The strides of ``torch.empty(size, memory_format=...)`` (torch's errors for a
    format that does not fit the rank, or for preserve_format)."""
    return tuple(torch.empty(size, device="meta", memory_format=memory_format).stride())


def memory_order(size, stride) -> list[int]:
    """Dimensions from outermost to innermost in memory (by decreasing stride; ties, which
    only size-1 dimensions of a dense tensor have, keep their order)."""
    return sorted(range(len(size)), key=lambda d: -stride[d])


def is_dense_permutation(size, stride) -> bool:
    """Whether ``stride`` is the contiguous strides of ``size`` with its dimensions
    permuted (size-1 dimensions may have any stride): dense, non-overlapping."""
    order = memory_order(size, stride)
    physical = contiguous_strides(tuple(size[d] for d in order))
    return all(size[d] == 1 or stride[d] == physical[i] for i, d in enumerate(order))


def in_row_major_order(size, stride) -> bool:
    """Whether ``stride`` differs from contiguous strides only at size-1 dimensions (the
    data sits in row-major order; only the reported strides differ)."""
    return all(n == 1 or a == b for n, a, b in zip(size, stride, contiguous_strides(size)))


# Note [Size-1 strides in fused eager]
# For a dense input, preserve_format keeps its strides also at size-1 dimensions
# (``x[:, -1].clone()`` of a (1, 6, 10) tensor has strides (60, 1)); the data is still in
# row-major order, so eager mode makes the contiguous copy and only reports CPU's
# strides (``restrided``). In fused eager mode (Note [Fused eager] in
# torchjax/ops/fused.py) a recorded copy reports them the same way; a later op reads it
# through a recorded view read, so the segment goes on.


def restrided(t, stride):
    """``t`` (a new tensor in row-major order) reporting ``stride``, which differs only
    at size-1 dimensions (``x[:, -1].clone()`` keeps ``x``'s stride there, as on CPU)."""
    if t._stride == stride:
        return t
    r = make(t._storage, t._size, stride, t._offset, t.dtype, t._device_index)
    r._cache, r._cache_version = t._cache, t._cache_version
    return r


def laid_out(t, stride, convert=None, device_index=None):
    """A new tpu tensor holding ``t``'s values (``convert``-ed: a cast, a device move) at
    ``stride``, a dense permutation of dimensions (Note [Memory formats on tpu]).

    The data in memory order is ``t`` read through its own strides permuted, one view
    read (a cached program; no copy for a transpose of a contiguous tensor)."""
    size, stride = t._size, tuple(stride)
    device_index = t._device_index if device_index is None else device_index
    if math.prod(size) == 0:  # any strides suit no elements (CPU's can be 0 or overlap)
        physical = t._value().reshape(0)
    elif is_dense_permutation(size, stride):
        order = memory_order(size, stride)
        permuted = tuple(size[d] for d in order), tuple(t._stride[d] for d in order)
        physical = view_of(t, *permuted, t._offset)._value()
    else:
        raise AssertionError(f"torchjax: strides {stride} of size {size} are not dense")
    if convert is not None:
        physical = convert(physical)
    dtype = dtypes.to_torch_dtype(physical.dtype)
    return make(Storage(physical), size, stride, 0, dtype, device_index)


# Note [Storages in memory order, made on first read]
# A result whose strides torch gives in another memory order (Note [Result layouts
# follow CPU] in torchjax/ops/layouts.py) holds its value, the logical array, as its read
# cache; its storage, the same data in memory order (the array transposed), is made only
# when something reads the storage itself: a view of it, ``as_strided``, a partial
# write. An op reading the tensor whole takes the read cache, so an eager op on a
# transposed or channels_last input costs no second XLA program for the layout.
class _Transposed:
    """The lazy value of a storage: ``value`` (the logical array) in memory order."""

    __slots__ = ("value", "order", "dtype")

    def __init__(self, value, order):
        self.value, self.order, self.dtype = value, order, value.dtype

    def resolve(self):
        token = x64_enter()  # an int64/float64 value stays 64-bit
        try:
            return jax.lax.transpose(self.value, self.order)
        finally:
            x64_exit(token)


def in_memory_order(value, size, stride, dtype, device_index):
    """A new tpu tensor of ``value`` (a jax array of ``size``) at ``stride``, a dense
    permutation of dimensions; its storage is ``value`` in memory order, made when first
    read (Note [Storages in memory order, made on first read])."""
    order = tuple(memory_order(size, stride))
    storage = Storage.made_later([size[d] for d in order], _Transposed(value, order))
    t = make(storage, size, stride, 0, dtype, device_index)
    t._cache, t._cache_version = value, 0
    return t
