"""torch.load onto "tpu": storages restored to a tpu location.

Note [Loading checkpoints onto tpu]
torch.load restores every storage of a file first (``map_location`` decides where: a
string, a torch.device, a dict of locations, or a callable), then rebuilds each tensor
over its storage: ``torch.empty(0, device=storage.device).set_(storage, offset, size,
stride)``. torch's own restore for a PrivateUse1 location allocates
``torch.UntypedStorage(n, device="tpu")``, and a Python backend has no allocator: that
dereferences a null allocator and kills the process.

So a storage restored to tpu is a *host-backed tpu storage* (Note [Host-backed tpu
storages] in torchjax/tensor/_host_storage.py): the CPU bytes torch just read, under a
tpu-labelled ``UntypedStorage`` that does not own them. The rebuild's ``set_`` then
reaches ``aten::set_.source_Storage_storage_offset`` on a JaxTensor
(torchjax/ops/copy.py), which copies the bytes into one jax array per storage
(``storage_for``, cached on the storage object, so tensors that shared a storage in the
file alias after loading, as on CPU, whatever dtype each reads it as) and views it. The
deserializer is registered with torch's public ``torch.serialization.register_package``,
ahead of torch's PrivateUse1 entry; it answers only tpu locations. ``storage.tpu()``
(the method torch generates per backend, here host-backed too) lets a callable
``map_location`` return a tpu storage.

``torch.UntypedStorage(n, device="tpu")`` and ``storage.to(device="tpu")`` give
host-backed storages too (``_storage_new``): no path reaches torch's allocation.
"""

from __future__ import annotations

import contextlib
import re
import threading

import torch

from torchjax import _patches
from torchjax._compat.torch import (
    awaits_legacy_bytes,
    install_load_scope,
    install_tensor_metadata_hook,
    new_untyped_storage,
    untyped_storage_of,
)
from torchjax.device._module import device_count, jax_device
from torchjax.tensor import dtypes
from torchjax.tensor._host_storage import host_backed, host_of, loaded, loaded_of
from torchjax.tensor._protocols import math_bits_loaded
from torchjax.tensor._reinterpret import interpret

DEVICE_TYPE = "tpu"
_LOCATION = re.compile(rf"{DEVICE_TYPE}(:[0-9]+)?$")
_REGISTERED = False


def _tpu_device(location) -> torch.device:
    device = torch.device(location)
    index = 0 if device.index is None else device.index
    if index >= device_count():
        raise RuntimeError(
            f"Attempting to deserialize object on TPU device {index} but "
            f"torch.tpu.device_count() is {device_count()}. Please use torch.load with "
            "map_location to map your storages to an existing device."
        )
    return torch.device(DEVICE_TYPE, index)


def _deserialize(obj, location):
    if not isinstance(location, str) or not _LOCATION.match(location):
        return None
    return host_backed(obj, _tpu_device(location))


def _tag(storage):
    return None  # tpu locations are tagged by torch's own PrivateUse1 tagger


def storage_tpu(self, device=None, non_blocking=False):
    """``storage.tpu(device)``: a tpu copy of a storage (host-backed, see the Note)."""
    if device is None or isinstance(device, int):
        device = torch.device(DEVICE_TYPE, device or 0)
    target = _tpu_device(device)
    if isinstance(self, torch.TypedStorage):
        return torch.TypedStorage(
            wrap_storage=host_backed(untyped_storage_of(self), target),
            dtype=self.dtype,
            _internal=True,
        )
    return host_backed(self, target)


def _is_tpu(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # torch reads an int device as the current accelerator
        return True
    return torch.device(device).type == DEVICE_TYPE


def _storage_new(cls, *args, device=None, **kwargs):
    """``torch.UntypedStorage(n | sequence, device="tpu")``: torch would allocate through
    the backend's allocator, which a Python backend does not have (the process
    crashes); the storage is made on CPU and given host-backed tpu bytes instead, as
    ``storage.tpu()`` does. Every other device is torch's constructor unchanged."""
    if not _is_tpu(device):
        return new_untyped_storage(cls, *args, device=device, **kwargs)
    if isinstance(device, int):
        device = torch.device(DEVICE_TYPE, device)
    index = torch.device(device).index or 0
    jax_device(index)  # an invalid ordinal raises torch's kind of error, naming the range
    cpu = new_untyped_storage(cls, *args, **kwargs)
    return host_backed(cpu, torch.device(DEVICE_TYPE, index))


def storage_for(storage, dtype: torch.dtype, device: torch.device, make_storage):
    """The torchjax Storage behind a host-backed tpu ``storage`` viewed as ``dtype``:
    ``make_storage(cpu_flat_tensor)`` builds it the first time, later calls (other
    tensors over the same storage in one file) get the same one."""
    storage = untyped_storage_of(storage)
    if storage.device != device:
        # torch's message (aten/src/ATen/native/TensorShape.cpp, set_storage_cpu_).
        raise RuntimeError(
            f'Attempted to set the storage of a tensor on device "{device}" to a storage on '
            f'different device "{storage.device}".  This is no longer allowed; the devices '
            "must match."
        )
    table = loaded_of(storage)
    st = table.get(dtype)
    if st is not None:
        return st
    if table:  # the same bytes seen as another dtype alias them (a dtype view)
        root = next(iter(table.values()))
        st = table[dtype] = interpret(root, dtypes.to_jax_dtype(dtype))
        return st
    # Neither loaded nor a snapshot (whose root is in the table): the bytes are needed.
    host = host_of(storage)
    if host is None:
        raise RuntimeError(
            f"torchjax: aten::set_ got a {storage.device} storage with no data behind it "
            "(tpu tensors keep their data in jax arrays, not in torch storages); use "
            "tensor.set_(other_tensor), or build the tensor on CPU and move it with .to('tpu')"
        )
    table = loaded(storage)
    itemsize = torch.empty((), dtype=dtype).element_size()
    flat = torch.empty(0, dtype=dtype).set_(host, 0, (host.nbytes() // itemsize,))
    st = table[dtype] = make_storage(flat)
    if awaits_legacy_bytes(host):
        # The legacy format's bytes arrive after the objects are rebuilt.
        defer_until_loaded(lambda: st.replace(make_storage(flat).arr))
    return st


# Note [Legacy checkpoints]
# torch.load of a legacy (non-zipfile) file unpickles every object first and reads the
# storages' bytes after (torch 2.13, serialization._legacy_load, which marks each
# storage ``_torch_load_uninitialized``). A tpu tensor reads its bytes when it is
# rebuilt, so during such a load it is filled again once the load returns. The
# thread's torch.load keeps a list of those fills; outside a load nothing defers.
_LOADS = threading.local()


def loading() -> bool:
    """Whether a torch.load runs in this thread."""
    return bool(getattr(_LOADS, "stack", None))


def defer_until_loaded(fill) -> bool:
    """Run ``fill()`` when the torch.load running in this thread returns; False (and
    nothing recorded) when no load is running."""
    stack = getattr(_LOADS, "stack", None)
    if not stack:
        return False
    stack[-1].append(fill)
    return True


@contextlib.contextmanager
def _load_scope():
    stack = _LOADS.__dict__.setdefault("stack", [])
    stack.append([])
    ok = False
    try:
        yield
        ok = True
    finally:
        fills = stack.pop()
        if ok:
            for fill in fills:
                fill()


def register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    # Priority 19: before torch's PrivateUse1 entry (23); torch's own entries use 10 and
    # 20-26, and two entries of one priority make the registry's sort raise. Not undone
    # by torchjax.uninstall() (Note [Process-wide changes]): without it torch.load onto
    # "tpu" reaches torch's PrivateUse1 path, which crashes the process on a backend
    # with no allocator; it acts on tpu locations only.
    torch.serialization.register_package(19, _tag, _deserialize)
    install_load_scope(_load_scope)
    install_tensor_metadata_hook(math_bits_loaded)
    # What generate_methods_for_privateuse1_backend(for_storage=True) would add, minus
    # its allocation (which has no allocator to use).
    _patches.replace_attr(
        torch.UntypedStorage,
        "__new__",
        _storage_new,
        name="torch.UntypedStorage.__new__",
        why="torch.UntypedStorage(n, device='tpu') would crash in torch's allocation",
        package="torch",
        written_for="2.13",
    )
    for cls in (torch.UntypedStorage, torch.TypedStorage):
        _patches.replace_attr(
            cls,
            "tpu",
            storage_tpu,
            name=f"torch.{cls.__name__}.tpu",
            why="storage.tpu(), what torch generates for a device with an allocator",
            package="torch",
            written_for="2.13",
        )
