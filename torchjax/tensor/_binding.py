"""Running PyTorch code with other arrays in its tensors' storages, then restoring them.

Both torchjax.jit (tracing a module with its parameters as jit inputs) and
torchjax.functional (applying a module to a params pytree under jax transforms) bind jax
arrays, often tracers, into the Storage objects of existing tensors for the duration of
one call.

Note [Bindings are per thread]
A module's storages are shared by every thread, and an eager forward of the module in
another thread while one thread traces it must read the real arrays, not the trace's
tracers. So a binding never writes the shared slots: for the duration of the block the
bound storages change class to ``_BoundStorage``, whose ``arr`` and ``version`` are
properties consulting a per-thread overlay. In the binding thread ``arr`` is the bound
array (reads and writes of the traced code go to the overlay); in every other thread it
is the storage's own array, and their writes land there as usual. While bound,
``version`` is a fresh number at every read in every thread (a negative one: real
versions only grow from 0), so no tensor's read cache, shared by all threads, is ever
trusted: each read goes through ``arr``, to the thread's own value. When the block ends
the class is restored; values cached during it carry negative versions and are dropped.
Storages never bound keep their plain slots: eager dispatch pays nothing for this.
``trace_lock`` still serialises bindings (one trace at a time also keeps optimizer
param_groups, which a trace edits, consistent).
"""

from __future__ import annotations

import contextlib
import itertools
import threading

from torchjax.tensor._storage import Storage

# One binding at a time per process (see Note [Bindings are per thread]).
trace_lock = threading.RLock()

_ARR = Storage.__dict__["arr"]  # the slot descriptors of the plain class
_VERSION = Storage.__dict__["version"]
_fresh = itertools.count(-(1 << 62), -1)  # versions never equal to a real one
_local = threading.local()
_MISSING = object()


def _overlay() -> dict | None:
    return getattr(_local, "overlay", None)


class _BoundStorage(Storage):
    """A Storage while bound: ``arr`` is per thread (Note [Bindings are per thread])."""

    __slots__ = ()

    @property
    def arr(self):
        overlay = _overlay()
        if overlay is not None:
            a = overlay.get(id(self), _MISSING)
            if a is not _MISSING:
                return a
        return _ARR.__get__(self)

    @arr.setter
    def arr(self, value):
        overlay = _overlay()
        if overlay is not None and id(self) in overlay:
            overlay[id(self)] = value
        else:
            _ARR.__set__(self, value)

    @property
    def version(self):
        return next(_fresh)

    @version.setter
    def version(self, value):
        # ``version += 1`` by a write: counted on the storage's own array only when the
        # write went there (another thread's eager write).
        overlay = _overlay()
        if overlay is None or id(self) not in overlay:
            _VERSION.__set__(self, _VERSION.__get__(self) + 1)


# Per storage id: how many bindings (nested: torchjax.functional inside torchjax.jit)
# hold it in the bound class; changed under trace_lock only.
_depth: dict[int, int] = {}


@contextlib.contextmanager
def bound(storages, arrays):
    """Within the block and in this thread, ``storages[i].arr`` is ``arrays[i]``; other
    threads keep seeing the storages' own arrays. Restored afterwards."""
    with trace_lock:
        overlay = _overlay()
        if overlay is None:
            overlay = _local.overlay = {}
        saved = []
        for s, a in zip(storages, arrays):
            key = id(s)
            saved.append((s, overlay.get(key, _MISSING)))
            if _depth.get(key, 0) == 0:
                s.__class__ = _BoundStorage
            _depth[key] = _depth.get(key, 0) + 1
            overlay[key] = a
        try:
            yield
        finally:
            for s, old in reversed(saved):
                key = id(s)
                if old is _MISSING:
                    del overlay[key]
                else:
                    overlay[key] = old
                _depth[key] -= 1
                if _depth[key] == 0:
                    del _depth[key]
                    s.__class__ = Storage
