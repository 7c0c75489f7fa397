"""Running PyTorch code with other arrays in its tensors' storages, then restoring them.

Both torchjax.jit (tracing a module with its parameters as jit inputs) and
torchjax.functional (applying a module to a params pytree under jax transforms) bind jax
arrays, often tracers, into the Storage objects of existing tensors for the duration of
one call. Version bumps on bind and on restore make every tensor drop a value it cached
from the other side (see Note [Aliasing through views]); versions only ever grow.
"""

from __future__ import annotations

import contextlib
import threading

# One binding at a time per process: a module's storages are shared by every thread.
trace_lock = threading.RLock()


@contextlib.contextmanager
def bound(storages, arrays):
    """Within the block, ``storages[i].arr`` is ``arrays[i]``; restored afterwards."""
    saved = [s.arr for s in storages]
    for s, a in zip(storages, arrays):
        s.arr = a
        s.version += 1
    try:
        yield
    finally:
        for s, a in zip(storages, saved):
            s.arr = a
            s.version += 1
