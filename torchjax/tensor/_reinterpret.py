"""Views that read a storage as another dtype, conjugated or negated.

Note [Views across dtypes]
``x.real``, ``x.imag``, ``view_as_real``, ``view_as_complex`` and ``view(dtype)`` alias
``x``'s memory in torch with another element type, and ``conj()`` / ``_neg_view`` alias it
with a lazy transform (torch's conj and neg bits). A ``Storage`` holds one jax array of
one dtype, so such a view points at an ``Interpretation`` of the root storage instead:

- Its flat buffer is the root's bytes read as ``dtype`` (``lax.bitcast_convert_type``;
  complex <-> its real pairs by ``real``/``imag``/``lax.complex``), then negated (neg)
  and conjugated (conj). Size, stride and offset of the view are in units of ``dtype``,
  exactly what torch reports (``x.imag`` has stride 2 and offset 1 in floats).
- A write goes through the same strided plan on that flat buffer, undoes the transform
  (both are involutions), converts back to the root's dtype and replaces the root array:
  every other view of the root, of any dtype, re-reads (versions are the root's).
- It quacks like a Storage (``arr``, ``numel``, ``version``, ``covers``, ``read``,
  ``write``), so compiled lowerings and the registry's meta runs need no special case.
  One Interpretation exists per (root, dtype, conj, neg): ``id(t._storage)`` stays a
  stable identity for tensors that see the memory the same way.

The tensor carries torch's conj/neg bits matching its interpretation, so torch's own
logic (``conj().imag`` calling ``_neg_view``, the conjugate fallback cloning before an
op) behaves as on CPU; every op reads the logical value through the interpretation.
A storage whose bytes are not a whole number of the view's elements (a 3-element int16
storage read as int32) exposes the whole elements only; the tail bytes are kept on write.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax.tensor import _storage


def _real_dtype(dt):
    return np.dtype(np.float32) if dt == np.complex64 else np.dtype(np.float64)


def _to_bytes(flat):
    """A flat array as its uint8 bytes (little-endian element order)."""
    dt = flat.dtype
    if dt == np.bool_:
        return flat.astype(np.uint8)
    if jnp.issubdtype(dt, jnp.complexfloating):
        flat = jnp.stack([jnp.real(flat), jnp.imag(flat)], axis=-1).reshape(-1)
    if flat.dtype.itemsize == 1:
        return lax.bitcast_convert_type(flat, np.uint8)
    return lax.bitcast_convert_type(flat, np.uint8).reshape(-1)


def _from_bytes(data, dt):
    """uint8 bytes (a multiple of ``dt``'s itemsize) as a flat ``dt`` array."""
    dt = np.dtype(dt)
    if dt == np.bool_:
        return data != 0
    if jnp.issubdtype(dt, jnp.complexfloating):
        pairs = _from_bytes(data, _real_dtype(dt)).reshape(-1, 2)
        return lax.complex(pairs[:, 0], pairs[:, 1])
    if dt.itemsize == 1:
        return lax.bitcast_convert_type(data, dt)
    return lax.bitcast_convert_type(data.reshape(-1, dt.itemsize), dt)


def _convert(flat, dt, numel):
    """``flat`` (1-d) read as ``numel`` elements of ``dt``; fast paths skip the bytes."""
    src = flat.dtype
    if src == dt:
        return flat
    if jnp.issubdtype(src, jnp.complexfloating) and dt == _real_dtype(src):
        return jnp.stack([jnp.real(flat), jnp.imag(flat)], axis=-1).reshape(-1)
    if jnp.issubdtype(dt, jnp.complexfloating) and src == _real_dtype(dt):
        pairs = flat.reshape(-1, 2)
        return lax.complex(pairs[:, 0], pairs[:, 1])
    if np.bool_ not in (src, dt) and src.itemsize == dt.itemsize and src.kind != "c":
        if dt.kind != "c":
            return lax.bitcast_convert_type(flat, dt)
    data = _to_bytes(flat)
    return _from_bytes(lax.slice(data, (0,), (numel * dt.itemsize,)), dt)


def _transform(flat, conj, neg):
    if neg:
        flat = -flat if flat.dtype != np.bool_ else flat
    if conj:
        flat = jnp.conj(flat)
    return flat


class Interpretation:
    """The root ``Storage`` seen as ``dtype`` elements, optionally conj/neg (see Note)."""

    __slots__ = ("root", "dtype", "conj", "neg", "numel", "shape", "_src", "_flat", "__weakref__")
    # Never pending or filled on first read itself (its root may be): read as Storage's.
    lazy = None

    def __init__(self, root, dtype, conj, neg):
        self.root, self.dtype, self.conj, self.neg = root, np.dtype(dtype), conj, neg
        nbytes = root.numel * np.dtype(root.arr.dtype).itemsize
        self.numel = nbytes // self.dtype.itemsize
        self.shape = (self.numel,)
        self._src = self._flat = None

    @property
    def version(self) -> int:
        return self.root.version

    @property
    def arr(self):
        """The flat buffer in view units (cached for the root's current array)."""
        src = self.root.arr
        if self._src is not src:
            flat = _convert(src.reshape(-1), self.dtype, self.numel)
            self._flat, self._src = _transform(flat, self.conj, self.neg), src
        return self._flat

    def grow(self, numel: int) -> None:
        """Grow the root so that this view of it holds ``numel`` elements (``resize_``
        past its end); zeros after the old bytes, as ``Storage.grow``."""
        root_size = np.dtype(self.root.arr.dtype).itemsize
        self.root.grow(-(-numel * self.dtype.itemsize // root_size))
        self.numel = self.root.numel * root_size // self.dtype.itemsize
        self.shape = (self.numel,)
        self._src = self._flat = None

    def covers(self, size, stride, offset) -> bool:
        return offset == 0 and size == self.shape

    def read(self, size, stride, offset):
        if self.covers(size, stride, offset) and stride == (1,):
            return self.arr
        return _storage._plan(self.numel, size, stride, offset).read_array(self.arr)

    def write(self, size, stride, offset, value) -> None:
        if value.dtype != self.dtype:
            raise AssertionError(f"storage write dtype {value.dtype} != {self.dtype}")
        if self.covers(size, stride, offset) and stride == (1,):
            flat = value.reshape(-1)
        else:
            plan = _storage._plan(self.numel, size, stride, offset)
            flat = plan.write_array(self.arr, value)
        self.replace(flat)

    def replace(self, flat) -> None:
        """Store ``flat`` (the whole buffer in view units) into the root."""
        root = self.root
        old = root.arr
        back = _transform(flat.reshape(-1), self.conj, self.neg)
        rdt = np.dtype(old.dtype)
        if self.dtype == np.bool_ and rdt != np.bool_:
            # A jax bool holds 0/1 only: keep each byte whose truth value is unchanged
            # (a byte 2 read as True stays 2), as the bytes never written are on CPU.
            nbytes = back.shape[0]
            old_bytes = lax.slice(_to_bytes(old.reshape(-1)), (0,), (nbytes,))
            back = jnp.where(back == (old_bytes != 0), old_bytes, back.astype(np.uint8))
            new = self._bytes_to_root(back, old, rdt)
        elif jnp.issubdtype(rdt, jnp.complexfloating) and self.dtype == _real_dtype(rdt):
            pairs = back.reshape(-1, 2)
            new = lax.complex(pairs[:, 0], pairs[:, 1])
        elif self.dtype.itemsize * self.numel == old.size * rdt.itemsize:
            new = _convert(back, rdt, old.size)
        else:
            new = self._bytes_to_root(_to_bytes(back), old, rdt)
        root.replace(new.reshape(old.shape))

    @staticmethod
    def _bytes_to_root(head, old, rdt):
        """Root elements from ``head`` bytes; a partial last element keeps its tail."""
        total = old.size * rdt.itemsize
        if head.shape[0] < total:
            tail = lax.slice(_to_bytes(old.reshape(-1)), (head.shape[0],), (total,))
            head = jnp.concatenate([head, tail])
        return _from_bytes(head, rdt)


def interpret(storage, dtype, conj: bool = False, neg: bool = False):
    """``storage`` (a Storage or an Interpretation) seen as ``dtype``/conj/neg.

    ``conj``/``neg`` are the wanted view's bits. Returns the root itself when nothing
    changes, else the one cached Interpretation of the root for that combination."""
    root = storage.root if isinstance(storage, Interpretation) else storage
    dtype = np.dtype(dtype)
    if dtype == np.dtype(root.arr.dtype) and not conj and not neg:
        return root
    key = (dtype, conj, neg)
    views = root.interpretations
    if views is None:
        views = root.interpretations = {}
    view = views.get(key)
    if view is None:
        view = views[key] = Interpretation(root, dtype, conj, neg)
    return view


def stored_as(t, dtype):
    """``t``'s stored elements seen as ``dtype``, through torch's own views
    (``view_as_real``, differentiable, or ``view(dtype)``; torch's errors where its
    layout rules refuse), without ``t``'s conj / neg bits."""
    if t.is_conj():
        t = t._conj()
    if t.is_neg():
        t = t._neg_view()
    if t.dtype == dtype:
        return t
    if t.is_complex() and dtype == t.real.dtype:
        return torch.view_as_real(t)
    return t.view(dtype)
