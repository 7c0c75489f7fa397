"""The addresses and torch storages of tpu tensors: how a root ``Storage`` looks to code
that identifies memory by pointer.

Note [Addresses of tpu tensors]
A wrapper subclass has no TensorImpl storage, so torch reports ``data_ptr()`` 0 plus the
view's byte offset: every tpu tensor of offset 0 had the same address. Libraries find
shared and tied tensors by address (accelerate's offload hooks keep tied weights by
``data_ptr()``; a T5 layer-norm weight was replaced by the tied embedding), so each
root storage gets a distinct, never reused, non-overlapping range of fake addresses,
assigned when first asked: views of one storage (and its dtype interpretations) share
it, at their byte offsets, as on CPU. A root that grows past its range (``resize_``)
gets a new one, as a CPU storage that grows is reallocated. The address is never
dereferenceable: the data is a jax array (``.cpu()``, DLPack or ``.jax()`` reach the
bytes).

Note [torch storages of tpu tensors]
``t.untyped_storage()`` / ``t.storage()`` of a wrapper subclass give the TensorImpl's
placeholder: no data pointer ("Attempted to access the data pointer on an invalid
python storage"), sized to the view alone. Code that asks for a tensor's storage wants
its identity and extent: PyTorch's tests (``tensor.storage().data_ptr()`` of a view and
of its base), safetensors' ``storage_ptr``/``storage_size`` and transformers'
``id_tensor_storage`` (shared and tied weights), ``x.set_(x.storage(), offset, size,
stride)``. So ``JaxTensor.untyped_storage()`` answers with one tpu ``UntypedStorage``
per root ``Storage``, kept by the root (the same object, so the same ``_cdata`` that
``StorageWeakRef`` compares, for every view of the root, as on CPU): it owns no memory,
its ``data_ptr()`` is the root's address and its ``nbytes()`` the root's size in bytes.
Any other spelling of ``storage()`` asks the same method.

torch's own operations on a tpu storage (``cpu()``, ``bytes()``, indexing, ``fill_``,
``copy_``, ``clone``, ``torch.save`` of the storage) never read its pointer: they view it
with a tpu tensor (``aten::set_`` of a storage), which ``resolve`` maps back to the root,
so they read and write the root's data through the view mechanism: ``set_`` of such a
storage (or of a slice of it) is a view of the root (an interpretation of it for
another dtype). Limits: the pointer is not memory (ctypes or C++ code that dereferences
a tpu storage's pointer reads garbage or crashes, as with ``data_ptr()``); C++ code that
reads the TensorImpl storage itself (not through the Python method) still sees the
placeholder; ``storage.resize_()`` is refused by torch (no tpu allocator). A storage
does not keep its root alive (the root keeps the storage: the other way too would be a
reference cycle, holding device memory until a full garbage collection): a storage
kept after every tensor of its root died has no data, and ``set_`` of it or reading it
raises, where a CPU storage keeps its memory.
"""

from __future__ import annotations

import bisect
import threading
import weakref

import numpy as np
import torch

from torchjax._compat.torch import storage_from_pointer
from torchjax.tensor import dtypes
from torchjax.tensor._reinterpret import Interpretation, interpret
from torchjax.tensor._storage import StandIn

# root Storage -> (address, bytes of address range); address -> root (every address a
# live root ever had, so a storage made before the root grew still resolves).
_RANGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ROOTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_FIRST = 1 << 44
_NEXT = [_FIRST]
_LOCK = threading.Lock()
# 16 bytes an element bounds every dtype's view of a storage.
_MAX_ITEMSIZE = 16


def root_of(storage):
    """The root Storage under a Storage, an Interpretation (a dtype view of one) or a
    StandIn (another array for one while an op runs)."""
    cls = storage.__class__
    return storage.root if cls is Interpretation or cls is StandIn else storage


def address(storage) -> int:
    """The fake address of ``storage``'s root (Note [Addresses of tpu tensors])."""
    root = root_of(storage)
    with _LOCK:
        known = _RANGES.get(root)
        need = root.numel * _MAX_ITEMSIZE
        if known is not None and known[1] >= need:
            return known[0]
        addr = _NEXT[0]
        span = (need + 127) // 64 * 64  # 64-byte aligned, never empty
        _NEXT[0] += span
        _RANGES[root] = (addr, span)
        _ROOTS[addr] = root
    return addr


def reserve(size: int) -> int:
    """A fresh fake address range of ``size`` bytes that no root owns: the address of a
    storage standing for data held elsewhere (Note [Host-backed tpu storages] in
    torchjax/tensor/_host_storage.py), never resolved to a root."""
    with _LOCK:
        addr = _NEXT[0]
        _NEXT[0] += (size + 127) // 64 * 64
    return addr


def nbytes(root) -> int:
    """The root's size in bytes, without making an array not made yet."""
    lazy = root.lazy
    if lazy is None:
        dtype = root.arr.dtype
    else:  # [fill, dtype, device] (Note [Storages filled on first read]) or a pending value
        dtype = lazy[1] if lazy.__class__ is list else lazy.dtype
    return root.numel * np.dtype(dtype).itemsize


def untyped_storage(storage, device: torch.device) -> torch.UntypedStorage:
    """The tpu UntypedStorage standing for ``storage``'s root (Note [torch storages of
    tpu tensors])."""
    root = root_of(storage)
    addr, size = address(root), nbytes(root)
    with _LOCK:
        # An unset slot reads through Storage.__getattr__, which raises AttributeError.
        cached = getattr(root, "torch_storage", None)
        if cached is not None and cached.data_ptr() == addr and cached.nbytes() == size:
            return cached
        made = root.torch_storage = storage_from_pointer(addr, device, size)
    return made


def resolve(untyped: torch.UntypedStorage):
    """(root Storage, byte offset) for a tpu storage made by ``untyped_storage`` or a
    slice of one (``storage[i:j]``), else None."""
    ptr = untyped.data_ptr()
    with _LOCK:
        root = _ROOTS.get(ptr)
        if root is not None:
            return root, 0
        # A slice: the range its pointer falls in (addresses only grow, never reused).
        starts = sorted(_ROOTS.keys())
        i = bisect.bisect_right(starts, ptr) - 1
        if i < 0:
            return None
        start = starts[i]
        root = _ROOTS.get(start)
        if root is None or ptr + untyped.nbytes() > start + _RANGES[root][1]:
            return None
        return root, ptr - start


def storage_view(t, untyped: torch.UntypedStorage, offset: int, size, stride):
    """(Storage, size, stride, offset) that ``t.set_(untyped, offset, size, stride)``
    views when ``untyped`` is a tpu tensor's storage (or a slice of one), else None.

    As on CPU: ``size`` None is the whole storage as a 1-d tensor; a view past the end of
    a whole storage grows it (zeros where CPU leaves memory uninitialised); a storage
    read as another dtype is an interpretation of the root."""
    if untyped.device.type != t.device.type:
        return None
    found = resolve(untyped)
    if found is None:
        if _FIRST <= untyped.data_ptr() < _NEXT[0]:
            raise RuntimeError(
                f"aten::set_: this {untyped.device} storage belonged to tensors that have all "
                "been freed: a tpu storage does not keep its data alive (Note [torch storages "
                "of tpu tensors]); keep one of its tensors alive as long as the storage"
            )
        return None
    root, byte_offset = found
    if untyped.device != t.device:
        # torch's message (aten/src/ATen/native/TensorShape.cpp, set_storage_cpu_).
        raise RuntimeError(
            f'Attempted to set the storage of a tensor on device "{t.device}" to a storage '
            f'on different device "{untyped.device}".  This is no longer allowed; the '
            "devices must match."
        )
    itemsize = t.element_size()
    if byte_offset % itemsize:
        raise RuntimeError(
            f"aten::set_: the storage starts {byte_offset} bytes into a tpu storage, not a "
            f"whole number of {t.dtype} elements ({itemsize} bytes); slice the storage at "
            "a multiple of the element size"
        )
    storage = interpret(root, dtypes.to_jax_dtype(t.dtype))
    offset += byte_offset // itemsize
    if size is None:
        size, stride = (untyped.nbytes() // itemsize,), (1,)
    size, stride = tuple(size), tuple(stride)
    end = offset + 1 + sum((n - 1) * st for n, st in zip(size, stride)) if 0 not in size else 0
    if end > storage.numel:
        if byte_offset:
            raise RuntimeError(
                f"aten::set_: sizes {list(size)}, strides {list(stride)} and storage offset "
                f"{offset - byte_offset // itemsize} reach past the end of a slice of a "
                f"tpu storage of {untyped.nbytes()} bytes; a slice cannot grow"
            )
        storage.grow(end)
    return storage, size, stride, offset
