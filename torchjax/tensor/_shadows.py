"""Host values of small tpu tensors made from host data, read without a device round trip.

Note [Host values of tensors made from host data]
Python code around a model makes small tpu tensors from Python numbers and reads them
back: transformers' ``generate`` turns the EOS and pad ids into tensors on the model's
device (``torch.tensor(eos, device=...)``) and then reads them with ``.tolist()`` and
``int()`` to set up its loop; torchjax's compiled generate reads them again to key its
programs. Each read waits for the device to finish everything queued before it and
copies over the bus: on the chip some 0.3-1 ms each, several per ``generate``.

A copy from a CPU tensor that writes a whole tpu storage of at most ``SHADOW_BYTES``
(``torch.tensor(data, device="tpu")``, ``x.to("tpu")``) keeps the CPU values beside
the storage: its *shadow*, tied to the array it wrote. A later read of any view of that
storage (``.tolist()``, ``.item()``, ``.cpu()``) takes its values from the shadow while
the storage still holds that array. Any write gives the storage a new array, so the
shadow no longer applies (and is dropped); views of another dtype and conj/neg views
read the device. The values are exact: the array was made from these very bytes. A read
from a shadow is still a synchronisation point for deferred device checks (they raise
first, as at any read), and it is not a device-to-host transfer, so
``torchjax.stats()["host_reads"]`` does not count it.

Note [Host values put on the device when first read]
The result of an op run on the host (Note [Integer ops on host values] in
torchjax/ops/host_ops.py) was put on the device at once, as ``x.to("tpu")`` puts it:
some 100 us of host time each on this CPU, most of such an op's cost, for values that
mostly only the host reads next (transformers' ``isin(eos, pad).any()`` and
``(mask == 1).all()``, the position ids' intermediates), and so were the special token
ids ``generate`` makes with ``torch.tensor(id, device=...)``, which only such ops read.
Such a result, and a copy from CPU into a whole new tensor (``torch.tensor(data,
device="tpu")``, ``x.to("tpu")``), when small (up to ``SHADOW_BYTES``), dense and made
outside a mesh, is now a storage whose array is made on first read (Note [Storages
filled on first read] in torchjax/tensor/_storage.py): its lazy value is
``HostValues``, the CPU values, which are its shadow meanwhile; the first device read
puts them on the device as the copy would have (``host_onto``, placed as outside any
mesh), and the shadow then stays tied to that array. A write replaces them as any write
replaces an array. ``torch.tpu.memory_allocated()`` counts the bytes from the start
(``nbytes_on``), as for other storages not made yet.
"""

from __future__ import annotations

import weakref

import jax
import torch

from torchjax._compat.jax import x64_enter, x64_exit
from torchjax.tensor._fills import host_onto
from torchjax.tensor._storage import Storage, contiguous_strides, count_unmade
from torchjax.tensor.dtypes import cpu_tensor_to_numpy, to_jax_dtype

SHADOW_BYTES = 1024
# Storage -> (weak reference to the jax array the values were written as, flat CPU
# tensor): a stale entry keeps no device memory alive.
_SHADOWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _held(storage):
    """``storage``'s array; its ``HostValues`` while they are not put on the device; None
    for another storage whose array is not made (a lazy storage)."""
    lazy = storage.lazy
    if lazy is None:
        return storage.arr
    return lazy if lazy.__class__ is HostValues else None


class HostValues:
    """The lazy value of a storage whose values only the host holds yet (Note [Host values
    put on the device when first read]): ``values``, a contiguous CPU tensor of the
    storage's shape, put on jax ``device`` when the array is first asked for."""

    __slots__ = ("values", "device", "dtype", "storage", "__weakref__")

    def __init__(self, values: torch.Tensor, device):
        self.values, self.device = values, device
        self.dtype = to_jax_dtype(values.dtype)
        self.storage = None  # weak reference to the storage holding it

    def resolve(self) -> jax.Array:
        token = x64_enter()  # an int64 value stays 64-bit
        try:
            # Concrete even when first read inside a trace: the storage outlives it.
            with jax.ensure_compile_time_eval():
                arr = host_onto(cpu_tensor_to_numpy(self.values), self.device, outside_mesh=True)
        finally:
            x64_exit(token)
        storage = self.storage()
        if storage is not None and storage in _SHADOWS:  # the shadow of the array now
            _SHADOWS[storage] = (weakref.ref(arr), self.values.reshape(-1))
        return arr

    def nbytes_on(self, device) -> int:
        """Bytes the array will take on jax ``device`` (``unfilled_bytes``)."""
        return self.values.numel() * self.values.element_size() if device == self.device else 0


def _deferrable(values: torch.Tensor) -> bool:
    """Whether ``values`` (a CPU tensor) may wait on the host for a first device read:
    small, dense in storage order, no math bits, within NumPy's 64 dimensions, made outside
    a mesh."""
    return (
        values.numel() * values.element_size() <= SHADOW_BYTES
        and values.dim() <= 64
        and values.storage_offset() == 0
        and values.stride() == contiguous_strides(tuple(values.shape))
        and not values.is_conj()
        and not values.is_neg()
        and jax.sharding.get_abstract_mesh().empty
    )


def _hold(storage, lazy: HostValues) -> None:
    lazy.storage = weakref.ref(storage)
    _SHADOWS[storage] = (weakref.ref(lazy), lazy.values.reshape(-1))


def host_storage(values: torch.Tensor, device) -> Storage | None:
    """A storage of ``values`` (a CPU tensor nothing else holds), its array put on jax
    ``device`` when first read, the values its shadow until then (Note [Host values put
    on the device when first read]); None where that does not apply (large, not
    contiguous, under a mesh): the caller copies as before."""
    if not _deferrable(values):
        return None
    lazy = HostValues(values.detach(), device)
    storage = Storage.made_later(tuple(values.shape), lazy, values.numel())
    count_unmade(storage)
    _hold(storage, lazy)
    return storage


def copy_later(storage, values: torch.Tensor) -> bool:
    """Copy ``values`` (a CPU tensor of ``storage``'s shape and dtype) into ``storage``, a
    storage whose array is not made yet and whose fill nothing read (a new tensor's), as
    host values put on its device when first read (see the Note); False where that does
    not apply: the caller copies now."""
    lazy = storage.lazy
    if (
        lazy.__class__ is not list
        or storage.__class__ is not Storage
        or tuple(values.shape) != storage.shape
        or not _deferrable(values)
    ):
        return False
    held = HostValues(values.detach().clone(), lazy[2])
    if held.dtype != lazy[1]:
        return False
    storage.lazy = held  # counted by unfilled_bytes as the fill was (``nbytes_on``)
    storage.version += 1
    _hold(storage, held)
    return True


def remember(storage, values: torch.Tensor) -> None:
    """Keep ``values`` (a CPU tensor of ``storage``'s elements, in storage order) as the
    shadow of the array ``storage`` holds now (see the Note)."""
    if values.numel() * values.element_size() > SHADOW_BYTES or values.numel() != storage.numel:
        return
    arr = _held(storage)
    if arr is not None:
        _SHADOWS[storage] = (weakref.ref(arr), values.detach().reshape(-1).clone())


class _Held:
    """Truthy while some storage has a shadow: the one check the dispatch hot path makes
    before looking for host values (Note [Integer ops on host values])."""

    def __bool__(self) -> bool:
        return bool(_SHADOWS)


HELD = _Held()


def held_by(storage) -> bool:
    """Whether ``storage`` has a shadow entry (possibly stale: ``view_of`` checks)."""
    return storage in _SHADOWS


def view_of(t) -> torch.Tensor | None:
    """A CPU view with ``t``'s values, size, strides and offset over its storage's shadow
    (not to be written), or None (see ``lookup``)."""
    storage = t._storage
    entry = _SHADOWS.get(storage)
    if entry is None:
        return None
    ref, flat = entry
    if _held(storage) is not ref():
        del _SHADOWS[storage]  # written since: the device holds the values
        return None
    if flat.dtype != t.dtype or t.is_conj() or t.is_neg():
        return None
    return flat.as_strided(t._size, t._stride, t._offset)


def lookup(t) -> torch.Tensor | None:
    """A CPU tensor with ``t``'s values from its storage's shadow, or None."""
    view = view_of(t)
    return None if view is None else view.clone(memory_format=torch.contiguous_format)
