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

Note [Random draws in size buckets]
A sampler's program is slow to compile (XLA expands threefry: 0.1-0.4 s on XLA:CPU,
where a slice takes 15-30 ms), and eager code draws at many sizes: a loop over lengths,
``torch.testing.make_tensor``, a sequence that grows. Each size was a program of its own.
The samplers in ``BUCKETED`` draw every element from the key and its flat index alone
(jax's threefry is "partitionable", its default: element i's bits do not depend on the
shape), so the first n elements of a draw of B >= n elements are exactly the draw of n
elements laid out in row-major order. A draw of up to ``BUCKET_LIMIT`` elements is
therefore compiled at the next power of two and cut to its shape by a small cached
program: one sampler program per (op, bucket, dtype, arguments), one cut per shape, and
the same values as a draw at the exact shape (tests/ops/test_random.py compares every
sampler with bucketing off). Larger draws keep their shape: their compile is amortised
and a draw twice the size would cost device time. Not bucketed: fused eager's recorded
segments (their shapes are the segment's), a ``jax_threefry_partitionable=False``
setting (then a draw depends on its shape) and samplers whose draw reads another
tensor (``bernoulli.Tensor``'s ``p``).

Not compiled (op by op, as before): a call passing a CPU ``generator=`` (it draws on CPU,
Note [CPU generators on tpu]), and a call inside an outer trace (``torchjax.jit`` or
``torchjax.functional``), whose own key stream the draw must use: one key of it per op,
its further draws folded into that key as here (``one_key_per_op``).

Note [Random ops compiled or not]
Whether an eager call compiles depends on what ran before it in the process: a key with
a new float argument compiles only while its form has compiled fewer than
``MAX_FLOAT_VARIANTS`` times (torchjax/ops/executables.py; ``native_dropout``'s ``p``), a
key whose trace once needed values runs op by op from then on. Op by op, a lowering's
draws each took the device's next key, so a call drawing twice (``native_dropout``)
gave other numbers than its compiled twin and moved the state by two: after other
dropout rates had been used, ``F.dropout(x, 0.3)`` no longer kept the elements
``F.dropout(x, 0.3, inplace=True)`` keeps under the same seed. Worse, the call had
reserved its counter value before it found it would not compile, so the state moved by
one more. So an eager call of a random op that runs op by op draws as the compiled call
draws (``as_compiled``), from the one counter value it reserved: the same numbers and
the same state after it, whichever path the call takes.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import torch

from torchjax import _budget
from torchjax.tensor import random as _rng
from torchjax.tensor._tensor import JaxTensor

aten = torch.ops.aten


def _overloads(name: str) -> tuple:
    """``name`` ("op" or "op.overload"): the overload, and for a functional op its
    in-place twin (``uniform`` and ``uniform_``), as eager calls reach them."""
    op, _, overload = name.partition(".")
    ops = [op] if op.endswith("_") else [op, op + "_"]
    return tuple(
        getattr(getattr(aten, o), overload or "default")
        for o in ops
        if hasattr(aten, o) and hasattr(getattr(aten, o), overload or "default")
    )


# Samplers whose n-th element depends on the key and n alone (Note [Random draws in size
# buckets]); each lowering takes ``self``'s shape only.
BUCKETED = frozenset(
    f
    for name in (
        "uniform",
        "normal_functional",
        "normal_",
        "bernoulli.p",
        "bernoulli_.float",
        "random",
        "random.from",
        "random.to",
        "exponential",
        "geometric",
        "cauchy",
        "log_normal",
    )
    for f in _overloads(name)
)
BUCKET_LIMIT = 1 << 16


def bucket(func, size) -> int | None:
    """The element count to draw ``func``'s sample of ``size`` at, or None: its own."""
    if func not in BUCKETED or not jax.config.jax_threefry_partitionable:
        return None
    n = math.prod(size)
    if n == 0 or n > BUCKET_LIMIT:
        return None
    b = 1 << (n - 1).bit_length()
    return None if b == n and len(size) == 1 else b


_CUTS: dict = {}


def cut(arr: jax.Array, size) -> jax.Array:
    """The first ``prod(size)`` elements of the flat draw ``arr``, shaped ``size``: one
    cached program per (draw, size), an entry of the process-wide budget."""
    n, size = math.prod(size), tuple(size)
    key = (arr.shape, arr.dtype, size)
    return _budget.cached(_CUTS, key, lambda: jax.jit(lambda a: a[:n].reshape(size)))(arr)


class _CallStream(_rng.TracedStream):
    """The stream of one compiled random call: the first draw is the call's key itself."""

    __slots__ = ()

    def next(self):
        n = self.draws
        self.draws += 1
        return self.key if n == 0 else jax.random.fold_in(self.key, n)


def one_key_per_op(run, args, kwargs):
    """``run(args, kwargs)``: a random op called op by op. Inside a torchjax.jit trace it
    takes one key of the trace's stream, its draws made from that key as a compiled call
    makes them (``_CallStream``), so the trace draws the keys eager draws (Note [Compiled
    draws are eager's draws] in torchjax/tensor/random.py)."""
    outer = _rng.traced_stream()
    if (
        not isinstance(outer, _rng.TracedStream)
        or isinstance(outer, _CallStream)
        or kwargs.get("generator") is not None
        or any(isinstance(a, torch.Generator) for a in args)
    ):
        return run(args, kwargs)
    old = _rng.set_traced_stream(_CallStream(outer.next()))
    try:
        return run(args, kwargs)
    finally:
        _rng.set_traced_stream(old)


def as_compiled(run, args, kwargs, reserved=None):
    """``run(args, kwargs)``, an eager random op run op by op, drawing the keys its
    compiled call would: the call's key first (``reserved``, the ``key_args`` the call
    took already, else reserved now), further draws folded into it (Note [Random ops
    compiled or not])."""
    base, n = key_args(args) if reserved is None else reserved
    with stream(base, n):
        return run(args, kwargs)


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
