"""Random ops as cached executables: the call's key is an argument, not a constant.

Note [Compiled random ops]
A random lowering asks for its key with ``random._key`` (torchjax/tensor/random.py's
``next_key``). Traced without help, that key would be drawn once, at trace time, and
every later call of the executable would repeat the same numbers. So an overload tagged
``nondeterministic_seeded`` gets two more executable arguments: its device's base key
(the seed's key data) and the counter value reserved for this call. Inside the trace the
call's key is ``fold_in(base, counter)``, exactly the key the op-by-op path draws, so a
one-draw op gives the same numbers on either path; a lowering that draws more than once
folds the draw number into that key for each later draw. One counter value is reserved
per call, so the state advances by one per op and ``torch.manual_seed`` replays it.

Not compiled (op by op, as before): a call passing a CPU ``generator=`` (it draws on CPU,
Note [CPU generators on tpu]), and a call inside an outer trace (``torchjax.jit`` or
``torchjax.functional``), whose own key stream the draw must use.
"""

from __future__ import annotations

import jax
import numpy as np
import torch

from torchjax.tensor import random as _rng
from torchjax.tensor._tensor import JaxTensor


class _CallStream(_rng.TracedStream):
    """The stream of one compiled random call: the first draw is the call's key itself."""

    __slots__ = ()

    def next(self):
        n = self.draws
        self.draws += 1
        return self.key if n == 0 else jax.random.fold_in(self.key, n)


def seeded(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def usable(args, kwargs) -> bool:
    """Whether this call of a random op may take the compiled path."""
    if _rng.traced_stream() is not None:
        return False
    if kwargs.get("generator") is not None:
        return False
    return not any(isinstance(a, torch.Generator) for a in args)


def key_args(args) -> list:
    """The base key data and this call's reserved counter, for the first tpu tensor's
    device (tpu:0 for a sharded tensor or none, as the op-by-op draw does)."""
    index = 0
    for a in args:
        if isinstance(a, JaxTensor):
            if not _sharded(a._storage):
                index = a._device_index
            break
    base, n = _rng.reserve(index)
    return [base, np.uint32(n)]


def _sharded(storage) -> bool:
    """Whether the storage's array spans several devices. One whose array is not made
    yet (Note [Storages filled on first read]) or still pending (Note [Fused eager]) is
    not read: its tensor's own device index is the stream's, as for a made array."""
    if storage.lazy is not None:
        return False
    arr = storage.arr
    return isinstance(arr, jax.Array) and len(arr.sharding.device_set) != 1


class stream:
    """``with stream(base, n):`` inside the trace: the lowering's draws use the call's
    key; the thread's previous stream (none) comes back after."""

    __slots__ = ("key", "old")

    def __init__(self, base, n):
        self.key = jax.random.fold_in(jax.random.wrap_key_data(base, impl="threefry2x32"), n)

    def __enter__(self):
        self.old = _rng.set_traced_stream(_CallStream(self.key))

    def __exit__(self, *exc):
        _rng.set_traced_stream(self.old)
