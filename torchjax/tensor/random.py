"""Per-device RNG state for tpu tensors: a seed and a counter, one jax key per draw.

Each random op draws ``fold_in(key(seed), counter)`` and bumps the counter, so
``torch.manual_seed(s)`` (which calls ``torch.tpu.manual_seed_all``) makes tpu randomness
reproducible and no two draws share a key. The state is plain Python ints shared by
all threads (as torch's generator is), nothing is baked into a traced graph
(torchjax.jit threads the key in). Which stream a draw uses while a trace runs is
per thread (a ContextVar): a trace in one thread never hands its tracers to another
thread's eager ``torch.rand``.
"""

from __future__ import annotations

import contextvars
import itertools
import threading

import jax
import numpy as np
import torch

DEFAULT_SEED = 67280421310721  # torch's default CPU seed, so fresh processes agree

_lock = threading.Lock()


class _State:
    __slots__ = ("seed", "counter", "_base", "_words")

    def __init__(self, seed: int):
        self.seed = seed
        self.counter = 0
        self._base = None
        self._words = None

    def words(self):
        """The base key's data (uint32[2]), the argument compiled random ops take."""
        if self._words is None:
            self._words = np.array(
                [(self.seed >> 32) & 0xFFFFFFFF, self.seed & 0xFFFFFFFF], np.uint32
            )
        return self._words

    def base_key(self):
        if self._base is None:
            self._base = jax.random.wrap_key_data(self.words(), impl="threefry2x32")
        return self._base


_STATES: dict[int, _State] = {}


def _state(index: int) -> _State:
    st = _STATES.get(index)
    if st is None:
        st = _STATES.setdefault(index, _State(DEFAULT_SEED))
    return st


# Note [RNG states inside a trace]
# torch.utils.checkpoint replays a region's randomness by saving the device RNG state
# before the forward (``get_rng_state``) and restoring it before the recomputation, inside
# ``fork_rng`` (which restores the state of its entry when it ends). Inside a trace every
# draw comes from the trace's stream, not the device state, so the state read and written
# there was the eager one and the recomputation drew new keys: a dropout inside a
# checkpointed region of a ``torchjax.jit`` train step got a backward mask other than its
# forward's, with no error (eager was right). So while a stream is active, ``get_state``
# returns the stream's position (the 16-byte layout, its token in the seed field) and
# ``set_state`` of such a state moves the stream back there: the recomputation draws the
# forward's keys, and ``fork_rng``'s exit puts the stream where it was, as on CPU. A state
# that is not the running stream's is the eager state, set as always.
_STREAM_TOKENS = itertools.count(0xA11CE5EED0000000)


class TracedStream:
    """The keys of one traced call (torchjax.jit): draw ``i`` of the call uses
    ``fold_in(key, i)`` where ``key`` is an input of the compiled function, derived per
    call from the device's (seed, counter). So a jitted function draws new values on each
    call and replays the same sequence after ``torch.manual_seed``."""

    __slots__ = ("key", "draws", "token")

    def __init__(self, key):
        self.key = key
        self.draws = 0
        self.token = next(_STREAM_TOKENS)

    def next(self):
        n = self.draws
        self.draws += 1
        return jax.random.fold_in(self.key, n)


# The stream of the trace running in this thread (context), if any.
_traced: contextvars.ContextVar[TracedStream | None] = contextvars.ContextVar(
    "torchjax_traced_stream", default=None
)


def call_key(index: int = 0):
    """The key for one call of a compiled function: the next eager draw's key."""
    return next_key(index)


def set_traced_stream(stream: TracedStream | None) -> TracedStream | None:
    """Route this thread's draws to ``stream`` while a torchjax.jit trace runs; returns
    the old one."""
    old = _traced.get()
    _traced.set(stream)
    return old


def traced_stream() -> TracedStream | None:
    """The stream of the trace running in this thread, if any."""
    return _traced.get()


def reserve(index: int = 0):
    """(base key data, counter) for one draw on device ``index``, the counter bumped:
    ``fold_in(key(base), counter)`` is the key ``next_key`` would have returned."""
    st = _state(index)
    return st.words(), _take(st)


def next_key(index: int = 0):
    """A fresh jax PRNG key for one random op on device ``index``."""
    traced = _traced.get()
    if traced is not None:
        return traced.next()
    st = _state(index)
    return jax.random.fold_in(st.base_key(), _take(st))


def _take(st: _State) -> int:
    """The state's next counter value, bumped (threads share the state)."""
    with _lock:
        n = st.counter
        st.counter += 1
    return n


def manual_seed(seed: int, index: int = 0) -> None:
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF  # torch accepts negatives; it wraps the same way
    _STATES[index] = _State(seed)


def initial_seed(index: int = 0) -> int:
    return _state(index).seed


def get_state(index: int = 0) -> torch.Tensor:
    """The state as a CPU uint8 tensor (16 bytes: seed, counter), as torch RNG states are;
    inside a trace, the trace's stream position (Note [RNG states inside a trace])."""
    traced = _traced.get()
    if isinstance(traced, TracedStream):  # not a stream that refuses draws
        pair = [traced.token, traced.draws]
    else:
        st = _state(index)
        pair = [st.seed, st.counter]
    return torch.from_numpy(np.array(pair, dtype=np.uint64).view(np.uint8).copy())


def set_state(state: torch.Tensor, index: int = 0) -> None:
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.numel() != 16:
        raise RuntimeError(
            "torch.tpu.set_rng_state expects the uint8 tensor of 16 bytes returned by "
            f"torch.tpu.get_rng_state(), got {type(state).__name__}"
            + (f"[{state.dtype}, {tuple(state.shape)}]" if isinstance(state, torch.Tensor) else "")
        )
    seed, counter = state.cpu().numpy().view(np.uint64).tolist()
    traced = _traced.get()
    if isinstance(traced, TracedStream) and seed == traced.token:
        traced.draws = int(counter)
        return
    st = _State(int(seed))
    st.counter = int(counter)
    _STATES[index] = st
