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
"""

from __future__ import annotations

import weakref

import torch

SHADOW_BYTES = 1024
# Storage -> (weak reference to the jax array the values were written as, flat CPU
# tensor): a stale entry keeps no device memory alive.
_SHADOWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _held(storage):
    """``storage``'s array, or None when it has none made (a lazy storage)."""
    if storage.lazy is not None:
        return None
    return storage.arr


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
