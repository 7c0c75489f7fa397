"""tpu-labelled torch storages whose bytes live on the host, for pickling and loading.

Note [Host-backed tpu storages]
A tpu tensor keeps its data in a jax array; its TensorImpl storage is an empty
placeholder. torch's serialization speaks in storages, so where a storage must stand for
tpu data (``torch.save`` / ``pickle`` / ``copy.copy`` of a tpu tensor, ``torch.load``
onto "tpu", ``storage.tpu()``) it is a *host-backed tpu storage*: CPU bytes under a
tpu-labelled ``UntypedStorage`` that does not own them (the CPU storage is kept alive as
its ``_HOST`` attribute). ``aten::set_`` of a JaxTensor onto one reads those bytes into
a jax array once per storage (``_LOADED``, per dtype), so tensors that shared a storage
share one again.

Pickling a tpu tensor (Note [Saving tpu tensors] in torchjax/tensor/_protocols.py) makes
a *snapshot* of the tensor's root ``Storage`` and records that root in ``_LOADED``:
``copy.copy`` rebuilds over the same storage object and so aliases the original, as on
CPU; a file keeps only the bytes, so a load gets new arrays. A snapshot holds the root's
jax array of that moment (immutable: later writes to the root make new arrays), not its
bytes: torch.save pickles every tensor first and writes the storages after, each with
``storage.cpu()``, so bytes copied at pickling sat on the host for the whole model at
once (a tpu model's ``torch.save`` peaked at more than twice its size). The snapshot's
``cpu()`` copies its array to the host when torch writes it, one storage at a time, and
the copy is dropped once written. Its address is a fake one of its own (``reserve`` in
torchjax/tensor/_addresses.py); torch's C++ readers of its bytes (the legacy writer,
through ``host_view``) get them copied to the host once, kept with the snapshot.

Once a JaxTensor is bound to a host-backed storage, the data lives in that tensor's jax
array (torch's storage copies, ``storage.cpu()`` and ``clone()``, reach it through
``aten::set_`` as every tpu tensor). torch's C++ also reads and writes such a storage
through a plain (non-JaxTensor) tpu tensor over it (the legacy writer's ``_write_file``,
the legacy reader's ``_set_from_file``): ``host_view`` turns one into the CPU view of
the bytes, brought up to date from a bound tensor before a read (a legacy load fills
its bound tensors again afterwards: Note [Legacy checkpoints]). A snapshot's bytes are
its data: its ``cpu()`` copies them (torch.save calls it per storage).
"""

from __future__ import annotations

import weakref

import torch

from torchjax._compat.torch import storage_from_pointer, untyped_storage_of
from torchjax.tensor._addresses import reserve, storage_view

DEVICE_TYPE = "tpu"
# Attributes set on a host-backed tpu UntypedStorage: the CPU storage owning its bytes,
# and the torchjax Storage made from them ({torch dtype: Storage}).
_HOST = "_torchjax_host"
_LOADED = "_torchjax_loaded"
# root Storage -> (id of its array, its version, weakref to the host-backed snapshot):
# the tensors of one torch.save that share a root pickle one storage.
_SNAPSHOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# address of a live host-backed storage's bytes -> that storage (see host_view)
_ADDRESSES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_IS_SNAPSHOT = "_torchjax_snapshot"


def host_backed(storage: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
    """A tpu-labelled UntypedStorage over ``storage``'s (CPU) bytes (see the Note)."""
    if storage.device.type == DEVICE_TYPE:
        return storage
    if storage.device.type != "cpu":
        storage = storage.cpu()
    out = storage_from_pointer(storage.data_ptr(), device, storage.nbytes())
    setattr(out, _HOST, storage)
    if storage.nbytes():
        _ADDRESSES[storage.data_ptr()] = out
    return out


def host_of(storage) -> torch.UntypedStorage | None:
    """The CPU storage behind a host-backed tpu storage, else None."""
    return getattr(untyped_storage_of(storage), _HOST, None)


def loaded(storage) -> dict:
    """The {torch dtype: torchjax Storage} made from a host-backed ``storage``."""
    table = getattr(storage, _LOADED, None)
    if table is None:
        table = {}
        setattr(storage, _LOADED, table)
    return table


def is_host_backed(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` (any Python object for it) is a live host-backed tpu storage
    or snapshot, known by its address."""
    address = storage.data_ptr() if storage.device.type == DEVICE_TYPE else 0
    return bool(address) and address in _ADDRESSES


def loaded_of(storage) -> dict:
    """``loaded(storage)`` if it was ever made, else an empty dict (nothing set)."""
    return getattr(storage, _LOADED, None) or {}


def host_view(t: torch.Tensor, *, reading: bool) -> torch.Tensor:
    """``t`` itself, or for a plain (non-JaxTensor) tpu tensor over a host-backed storage
    the CPU tensor viewing its bytes at the same size, stride and offset (over a tpu
    tensor's own storage, the tpu tensor viewing its root there). ``reading``:
    the bytes are first brought up to date from a tensor bound to the storage."""
    from torchjax.tensor._tensor import JaxTensor

    if t.device.type != DEVICE_TYPE or isinstance(t, JaxTensor):
        return t
    untyped = t.untyped_storage()
    if untyped.nbytes() == 0:  # nothing to read or write (an empty tensor's storage)
        return torch.empty(0, dtype=t.dtype).set_(torch.UntypedStorage(0), 0, t.size(), t.stride())
    address = untyped.data_ptr()
    # torch's C++ wraps the storage in a new Python object (no attributes): the
    # host-backed storage (or snapshot) is known by its address.
    storage = _ADDRESSES.get(address) if address else None
    if storage is None:
        view = storage_view(t, untyped, t.storage_offset(), t.size(), t.stride())
        if view is not None:  # a tpu tensor's own storage (Note [torch storages of tpu tensors])
            from torchjax.tensor._tensor import make

            return make(*view, t.dtype, t.device.index or 0)
        raise RuntimeError(
            f"torchjax: torch copied a {t.device} storage with no data behind it; tpu "
            "data lives in jax arrays, not in torch storages: copy tensors instead "
            "(tensor.cpu(), torch.save of tensors)"
        )
    host = getattr(storage, _HOST, None)
    if host is None:  # a snapshot's bytes, asked for by torch's C++: copied once, kept
        host = storage.cpu()
        setattr(storage, _HOST, host)
    if reading:
        _sync_to_host(storage, host)
    return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())


def _sync_to_host(storage, host) -> None:
    """Write the data of the tensor bound to ``storage`` (if any, and not a snapshot's
    root) into its host bytes."""
    table = getattr(storage, _LOADED, None)
    if not table or getattr(storage, _IS_SNAPSHOT, False):
        return
    root = next(iter(table.values()))
    values = root_on_host(getattr(root, "root", root))
    nbytes = min(host.nbytes(), values.untyped_storage().nbytes())
    dst = torch.empty(0, dtype=torch.uint8).set_(host, 0, (nbytes,), (1,))
    src = torch.empty(0, dtype=torch.uint8).set_(values.untyped_storage(), 0, (nbytes,), (1,))
    dst.copy_(src)


def root_on_host(root, device_index: int = 0) -> torch.Tensor:
    """A root Storage's whole buffer as a flat CPU tensor (through ``aten::_to_copy``,
    which gathers a multi-host array)."""
    from torchjax.tensor import dtypes
    from torchjax.tensor._tensor import make

    dtype = dtypes.to_torch_dtype(root.arr.dtype)
    with torch.no_grad():
        return make(root, (root.numel,), (1,), 0, dtype, device_index).cpu()


def snapshot(root, device: torch.device, device_index: int) -> torch.UntypedStorage:
    """A tpu storage standing for ``root``'s data now, with ``root`` recorded as what it
    loads back to; its bytes reach the host when ``cpu()`` is called (see the Note).
    Reused while ``root`` is unchanged and the last snapshot is still alive (one
    torch.save)."""
    arr = root.arr
    cached = _SNAPSHOTS.get(root)
    if cached is not None and cached[0] == id(arr) and cached[1] == root.version:
        storage = cached[2]()
        if storage is not None:
            return storage
    from torchjax.tensor import dtypes

    size = root.numel * arr.dtype.itemsize
    address = reserve(size)
    storage = storage_from_pointer(address, device, size)
    loaded(storage)[dtypes.to_torch_dtype(arr.dtype)] = root
    # torch.save calls storage.cpu() on each storage it writes; torch's own would view
    # this storage with a tpu tensor, which has no data behind it. A copy of the array
    # (a closure over it only, so no reference cycle through ``storage``).
    storage.cpu = lambda: _array_on_host(arr, device_index)
    setattr(storage, _IS_SNAPSHOT, True)
    _ADDRESSES[address] = storage
    _SNAPSHOTS[root] = (id(arr), root.version, weakref.ref(storage))
    return storage


def _array_on_host(arr, device_index: int) -> torch.UntypedStorage:
    """A new CPU storage holding ``arr``'s bytes (through ``aten::_to_copy``, which
    gathers a multi-host array)."""
    from torchjax.tensor._tensor import wrap

    with torch.no_grad():
        return wrap(arr, device_index).cpu().untyped_storage()
