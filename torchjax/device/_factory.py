"""PrivateUse1 kernels for the ops that create tpu tensors from nothing.

``torch.empty(..., device="tpu")`` and ``empty_strided`` (used by ``x.to("tpu")``) have no
tensor input for ``__torch_dispatch__`` to catch, so they are registered for the
PrivateUse1 dispatch key with ``torch.library``. Every other factory (zeros, ones, full,
arange, randn, tensor) is composite in torch and reaches these, then an in-place or
``out=`` op on the new tensor.
"""

from __future__ import annotations

import torch

from torchjax.device._module import jax_device
from torchjax.tensor import dtypes
from torchjax.tensor._memory_format import format_strides
from torchjax.tensor._storage import Storage, contiguous_strides
from torchjax.tensor._tensor import make, wrap

_LIB = None


def _device_index(device) -> int:
    if device is None:
        return 0
    device = torch.device(device)
    return 0 if device.index is None else device.index


def new_storage(size, dtype, device) -> Storage:
    """A zero-filled storage on the jax device behind tpu:``index``, its array made when
    first read (Note [Zeros for new tensors])."""
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    dev = jax_device(_device_index(device))
    return Storage.filled(tuple(size), dtypes.to_jax_dtype(dtype), dev)


# Note [Zeros for new tensors]
# Every tpu factory (empty, zeros, full, arange, randn, x.to("tpu")) starts here. An
# on-device fill is an XLA executable per (shape, dtype): ~30-50 ms to compile for each
# new shape, which is most of the time to first result of a model's first call and of
# a test suite; host zeros put on the device compile nothing but cost a transfer (about
# 100 us for a small tensor) on every call. Most new tensors are written whole before
# anything reads them (the draw of ``torch.randn``, the copy of ``.to("tpu")``, the fill
# of ``torch.ones``), so a new storage holds no array until it is read (Note [Storages
# filled on first read] in torchjax/tensor/_storage.py): then small ones (up to
# HOST_FILL_BYTES) take the transfer and larger ones one cached fill executable per
# (shape, dtype, value) in the cache budget. ``x.to("tpu")`` and ``torch.ones`` hold one
# array, and neither compiles nor transfers zeros.


def new_tensor(size, dtype, device):
    """A contiguous tpu tensor of zeros (its array made on first read when large)."""
    torch_dtype = dtype if dtype is not None else torch.get_default_dtype()
    size = tuple(size)
    storage, index = new_storage(size, dtype, device), _device_index(device)
    if storage.lazy is None:
        return wrap(storage.arr, index)  # its value at hand for the first op
    return make(storage, size, contiguous_strides(size), 0, torch_dtype, index)


def _check_layout(layout, op):
    if layout not in (None, torch.strided):
        raise RuntimeError(f"torchjax: aten::{op} supports only torch.strided, got {layout}")


def _check_size(size):
    # torch's check and text (numpy's would be "negative dimensions are not allowed").
    for n in size:
        if n < 0:
            raise RuntimeError(f"Trying to create tensor with negative dimension {n}: {list(size)}")


def empty_memory_format(
    size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None
):
    _check_layout(layout, "empty.memory_format")
    _check_size(size)
    if memory_format is not None and memory_format is not torch.contiguous_format:
        # channels_last(_3d) strides (Note [Memory formats on tpu]); torch's error for
        # preserve_format or a format that does not fit the rank.
        stride = format_strides(tuple(size), memory_format)
        return empty_strided(size, stride, dtype, layout, device, pin_memory)
    return new_tensor(size, dtype, device)


def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    # ``x.to("tpu")`` asks for x's strides (preserve_format), as a CUDA copy keeps them:
    # a storage spanning the strided elements, viewed at those strides
    # (Note [Aliasing through views]).
    _check_layout(layout, "empty_strided")
    _check_size(size)
    size, stride = tuple(size), tuple(stride)
    index = _device_index(device)
    if stride == contiguous_strides(size):
        return new_tensor(size, dtype, device)
    # An empty tensor keeps its strides too (channels_last of a size with a 0 has 0s).
    span = 0 if 0 in size else 1 + sum((n - 1) * st for n, st in zip(size, stride))
    storage = new_storage((span,), dtype, device)
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    return make(storage, size, stride, 0, dtype, index)


def efficientzerotensor(size, dtype=None, layout=None, device=None, pin_memory=None):
    # Autograd's formulas (e.g. sgn's) ask for a "ZeroTensor"; a plain zero tensor has
    # the same values, only without CPU's allocation-free trick.
    _check_layout(layout, "_efficientzerotensor")
    _check_size(size)
    return new_tensor(size, dtype, device)


def register_kernels() -> None:
    global _LIB
    _LIB = torch.library.Library("aten", "IMPL", "PrivateUse1")
    _LIB.impl("empty.memory_format", empty_memory_format)
    _LIB.impl("empty_strided", empty_strided)
    _LIB.impl("_efficientzerotensor", efficientzerotensor)
