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
# forward's keys, and ``fork_rng``'s exit puts the stream where it was, as on CPU.
#
# Note [Compiled draws are eager's draws]
# A compiled program once drew ``fold_in(call key, i)`` from one key taken per call: values
# other than eager's, and a state after the call one step on, however many draws it made.
# ``torch.compile(backend="tpu")`` of ``torch.manual_seed(0); torch.randn(3)`` runs the
# seed eagerly (Dynamo breaks its graph there) and then the program: every call gave the
# same values, but not eager's, and left the counter at 1 after any number of draws. So the
# program takes tpu:0's base key data and counter as its input (uint32[3]), the trace's
# random op ``i`` takes ``fold_in(base, counter + i)`` as eager's op takes
# ``fold_in(base, counter)`` and bumps the counter (one key per op, its further draws
# folded into it as eager's compiled random ops fold them: ``one_key_per_op`` in
# torchjax/ops/_seeded.py), and each call moves the counter by the trace's draws. Values
# and state after a call are then eager's. A program that draws nothing reads no state.
#
# Note [Seeds set inside a trace]
# ``torch.manual_seed(0)`` inside a jitted function runs once, at trace time. Setting the
# device state then was wrong twice over: the trace's draws still came from the call's
# input, so every call drew new values where eager repeats the seeded ones, and later
# calls (cache hits) never seeded, so the state after them was not eager's. So inside a
# trace a seed (``manual_seed``, ``manual_seed_all``) or a state that is not the stream's
# own (``set_rng_state`` of a state saved outside) moves the stream, not the device:
# from there its draws are the eager draws of that state, ``fold_in(key(seed), counter)``
# (constants of the program: the seed is a Python value, read at trace time as every
# Python value is), and ``get_state`` gives that state, as eager's would. Setting the
# stream's own state again (``fork_rng``'s exit) goes back to the call's input. What the
# stream holds when the trace ends is the device state every call of the program leaves
# (``Ending``): the state the trace seeded, or the input's counter moved past the draws
# made. All devices share the one stream (the trace's draws all use it); a device other
# than tpu:0 seeded or set inside the trace is set to its last such state after a call.
# A seed drawn at random would be a constant that every call repeats: ``torch.seed()``
# moves CPU's generator too, so its trace is used once (Note [CPU generators a trace
# moves] in torchjax/compile/_host_rng.py), and ``torch.tpu.seed()`` refuses to run there.
_STREAM_TOKENS = itertools.count(0xA11CE5EED0000000)


class TracedStream:
    """The keys of one trace. Draw ``i`` uses ``fold_in(key, start + i)``: torchjax.jit
    passes the device's base key and counter as inputs of the program, so its draws are
    the keys eager draws would take from that state (Note [Compiled draws are eager's
    draws]); ``torchjax.functional`` passes the user's key and
    0. After a seed set in the trace, draws come from that seed (Note [Seeds set inside a
    trace])."""

    __slots__ = (
        "key", "start", "draws", "used", "token", "seeded", "others", "host_seeded", "_host_at",
    )  # fmt: skip

    def __init__(self, key, start=0):
        self.key = key
        self.start = start
        self.draws = 0  # the position in the input's stream
        self.used = False  # whether a draw used the input
        self.token = next(_STREAM_TOKENS)
        self.seeded: _State | None = None  # a state set inside the trace, drawn from now
        self.others: dict = {}  # device index -> the last state set there, other than 0
        # Whether CPU's generator was seeded in the trace (torch.manual_seed), and was
        # when each state ``position`` gave out was read: ``fork_rng`` and checkpoint
        # restore CPU's state with the device's (Note [CPU generators a trace moves]).
        self.host_seeded = False
        self._host_at: dict = {}

    def next(self):
        st = self.seeded
        if st is not None:
            # The key is made afresh, not cached on the state: made in a trace, it is a
            # tracer.
            base = jax.random.wrap_key_data(st.words(), impl="threefry2x32")
            return jax.random.fold_in(base, _take(st))
        n = self.draws
        self.draws += 1
        self.used = True
        return jax.random.fold_in(self.key, self.start + n)

    def position(self) -> tuple[int, int]:
        """(seed, counter) as ``get_state`` gives it inside the trace."""
        st = self.seeded
        pair = (self.token, self.draws) if st is None else (st.seed, st.counter)
        self._host_at[pair] = self.host_seeded
        return pair

    def set(self, seed: int, counter: int, index: int) -> None:
        """``set_state`` of (seed, counter) on device ``index`` inside the trace."""
        self.host_seeded = self._host_at.get((seed, counter), self.host_seeded)
        if seed == self.token:  # the stream's own position: back to the call's input
            self.seeded = None
            self.draws = counter
            self.others.pop(index, None)
            return
        st = _State(seed)
        st.counter = counter
        self.seeded = st
        if index != 0:
            self.others[index] = (seed, counter)

    def ending(self) -> Ending:
        """What a call of the traced program does to the device states."""
        st = self.seeded
        if st is not None:
            return Ending(self.used, 0, (st.seed, st.counter), dict(self.others))
        return Ending(self.used, self.draws, None, dict(self.others))


class Ending:
    """The device RNG states a call of a compiled program leaves (Note [Seeds set inside
    a trace]). ``uses_input``: the program draws from its input; ``advance``: tpu:0's
    counter moves this far (the input's position at the end of the trace); ``seeded``:
    tpu:0's (seed, counter) after the call instead; ``others``: (seed, counter) of other
    devices set in it."""

    __slots__ = ("uses_input", "advance", "seeded", "others")

    def __init__(self, uses_input, advance, seeded, others):
        self.uses_input = uses_input
        self.advance = advance
        self.seeded = seeded
        self.others = others

    @property
    def needed(self) -> bool:
        """Whether a call reads or changes any device state."""
        return self.uses_input or self.advance > 0 or self.seeded is not None or bool(self.others)


_UNUSED_INPUT = np.zeros(3, np.uint32)


def call_input(ending: Ending, calls: int = 1) -> np.ndarray:
    """The RNG input of a compiled program (uint32[3]: tpu:0's base key data and counter),
    the device states moved as ``calls`` calls in a row move them (``ending``)."""
    if not ending.needed:
        return _UNUSED_INPUT
    st = _state(0)
    words = st.words()
    if ending.seeded is None:
        with _lock:
            n = st.counter
            st.counter += ending.advance * calls
    else:  # the input's draws come before the seed, which replaces the state
        n = st.counter
        _set(0, *ending.seeded)
    for index, (seed, counter) in ending.others.items():
        _set(index, seed, counter)
    return np.array([words[0], words[1], n & 0xFFFFFFFF], np.uint32)


def state_input(seed: int, counter: int) -> np.ndarray:
    """``call_input``'s layout for the state (seed, counter)."""
    words = _State(seed).words()
    return np.array([words[0], words[1], counter & 0xFFFFFFFF], np.uint32)


def input_stream(rng) -> TracedStream:
    """The stream of a trace whose RNG input (``call_input``'s layout) is ``rng``."""
    base = jax.random.wrap_key_data(rng[:2], impl="threefry2x32")
    return TracedStream(base, rng[2])


def _set(index: int, seed: int, counter: int) -> None:
    st = _State(seed)
    st.counter = counter
    _STATES[index] = st


# The stream of the trace running in this thread (context), if any.
_traced: contextvars.ContextVar[TracedStream | None] = contextvars.ContextVar(
    "torchjax_traced_stream", default=None
)


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


def manual_seed(seed: int, index: int = 0, host: bool = False) -> None:
    """Seed device ``index``; ``host``: ``torch.manual_seed`` seeds CPU's generator in the
    same call (read inside a trace only)."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF  # torch accepts negatives; it wraps the same way
    traced = _traced.get()
    if isinstance(traced, TracedStream):  # Note [Seeds set inside a trace]
        traced.set(seed, 0, index)
        traced.host_seeded = traced.host_seeded or host
        return
    _STATES[index] = _State(seed)


def initial_seed(index: int = 0) -> int:
    traced = _traced.get()
    if isinstance(traced, TracedStream) and traced.seeded is not None:
        return traced.seeded.seed
    return _state(index).seed


def get_state(index: int = 0) -> torch.Tensor:
    """The state as a CPU uint8 tensor (16 bytes: seed, counter), as torch RNG states are;
    inside a trace, the trace's stream position (Note [RNG states inside a trace])."""
    traced = _traced.get()
    if isinstance(traced, TracedStream):  # not a stream that refuses draws
        pair = list(traced.position())
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
    if isinstance(traced, TracedStream):  # Note [Seeds set inside a trace]
        traced.set(int(seed), int(counter), index)
        return
    _set(index, int(seed), int(counter))
