"""A generation cache's Python state, and which caches keep their shapes step to step.

Helpers of compiled generation: the guard and replay of Note [Nothing frozen in the
decode step] (torchjax/integrations/transformers/_generate.py), shared by the compiled
forward and the decode-step program (Note [Decode steps as one program] in
torchjax/integrations/transformers/_decode.py).
"""

from __future__ import annotations

import contextvars
import functools
import weakref

import jax
import jax.numpy as jnp
import torch

from torchjax._compat.jax import x64_enter, x64_exit
from torchjax.compile import _donate
from torchjax.compile._jit import jit
from torchjax.tensor import _shadows
from torchjax.tensor._storage import _ARR, Storage
from torchjax.tensor._tensor import JaxTensor

_CACHE_KWARGS = ("cache", "past_key_values")


def _static_cache(kwargs):
    """The call's cache if its tensors keep their shapes across steps (Note [Compiled
    generation with a static cache]), else None."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
    if cache is None or not getattr(cache, "is_compileable", False):
        return None
    decoder = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    return None if type(decoder) is DynamicCache else cache


def cache_room(decoder) -> int | None:
    """Tokens the (decoder's) static layers hold before a write would fall off their end,
    or None when no layer has a fixed length (a sliding layer rolls: it is never full)."""
    sizes = [
        layer.max_cache_len
        for layer in getattr(decoder, "layers", ())
        if isinstance(getattr(layer, "max_cache_len", None), int)
        and not getattr(layer, "is_sliding", False)
    ]
    return min(sizes) if sizes else None


_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, type)


# Note [The prefill of an empty cache]
# A static layer keeps its length as a tensor (``cumulative_length``), state of the
# compiled forward, so inside the prefill's trace the cache's length is a traced value.
# From it transformers derives the query offset, the cache positions and the mask, and
# with a traced offset it cannot take its own prefill path for an empty cache
# (masking_utils' ``_ignore_causal_mask_sdpa``: offset 0 and no padding -> no mask,
# ``is_causal``, keys cut to the prompt; what eager torch runs on CPU). So generate's
# prefill program held, where the forward alone holds none of it: a (B, 1, L, S) mask
# built from the traced positions over the whole cache, the keys and values repeated
# to the query heads (``repeat_kv``: with a mask transformers does not ask SDPA for GQA),
# attention over all S cache positions with that mask (the masked flash kernel, its mask
# converted and its block map computed per layer), and every cache write a scatter at
# traced positions (Note [Index writes at a run of positions] in
# torchjax/ops/index_runs.py). On CPU with a 16-layer Llama (hidden 256, 4/1 heads,
# vocab 32768, a 128-token prompt, a 256-position cache) it compiled 1.5-1.7x longer
# than the forward alone (CPU seconds; the kernels on, in interpret mode, or off); on a
# TPU v5e the 1.1B Llama's prefill program compiled about 3x longer than its forward.
#
# ``check_room`` reads the cache's length from the device before every call that writes
# more than one token. When it is 0, and every layer of the (decoder's) cache keeps its
# length as a 0-d tensor, the call's guard says so (``empty_prefill``) and the trace
# first writes 0, a host value, into each initialized layer's length
# (``known_empty``): the value the tensor holds, now known while tracing, so
# transformers' own empty-cache path runs: the prefill program holds the forward alone
# plus a slice write per layer's keys and values at position 0 (a run of positions
# known when traced). On CPU (the model above) it now compiles 1.0-1.2x as long as the
# forward alone, its optimized HLO the forward's plus the writes (7,245 ops against
# 6,714; 8,664 before); the ops of the known length fold while tracing (Note [Values
# made from constants inside a trace] in torchjax/ops/executables.py), three more
# small programs in a process's first prefill. The guard is part of the program's key,
# so a prefill into a cache that already holds tokens (a chunked prefill's later
# chunks, a generate continuing from a passed cache) traces and runs as before, with
# traced positions (a chunked prefill's first chunk traced apart from the rest before
# too: transformers passes it other arguments, so this adds no trace there). Layers of
# one cache move together (every step writes each of them), so the length read from
# the first layer is every layer's, as ``check_room`` already assumes. A layer not yet
# initialized keeps its length on the host until its first write moves it to the
# device, known then too: it is left as it is.
def empty_prefill(room) -> bool:
    """Whether a step (``room``: ``check_room``'s result, or None) writes more than one token
    into a cache that holds none and whose layers keep their lengths as 0-d tensors
    (Note [The prefill of an empty cache])."""
    if room is None:
        return False
    decoder, start, end = room
    layers = getattr(decoder, "layers", ())
    return (
        start == 0
        and end > 1
        and len(layers) > 0
        and all(
            isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
            and layer.cumulative_length.dim() == 0
            for layer in layers
        )
    )


def known_empty(cache) -> None:
    """Inside the prefill's trace: write 0 from the host into the length of every
    initialized layer of ``cache`` (its decoder's), which ``empty_prefill`` found empty
    (Note [The prefill of an empty cache])."""
    from transformers.cache_utils import EncoderDecoderCache

    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            length = layer.cumulative_length
            length.copy_(torch.zeros((), dtype=length.dtype))


def _cache_objects(cache) -> list:
    """The cache, its sub-caches and their layers, in a fixed order."""
    from transformers.cache_utils import EncoderDecoderCache

    objects = [cache]
    if isinstance(cache, EncoderDecoderCache):
        objects += _cache_objects(cache.self_attention_cache)
        objects += _cache_objects(cache.cross_attention_cache)
    else:
        objects += list(getattr(cache, "layers", ()))
    return objects


def _frozen(value):
    """A hashable stand-in for a non-tensor attribute value (tensors: only their presence,
    their contents are state of the program)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return type(value)  # another object (a layer list entry, a helper): its type


def _python_state(cache, values: bool = False) -> tuple:
    """Every non-tensor attribute of the cache and its layers: hashable (the guard) or, with
    ``values``, what ``_replay`` writes back (plain values, and the plain entries of dicts
    such as a linear-attention layer's ``has_previous_state``)."""
    state = []
    for i, obj in enumerate(_cache_objects(cache)):
        for name, value in vars(obj).items():
            if name == "layers" or isinstance(value, torch.Tensor):
                continue
            if not values:
                state.append((i, name, _frozen(value)))
            elif isinstance(value, _PLAIN):
                state.append((i, name, value))
            elif isinstance(value, dict):
                plain = {k: v for k, v in value.items() if isinstance(v, _PLAIN)}
                state.append((i, name, plain))
    return tuple(state)


def _replay(cache, after) -> None:
    """Set the cache's Python state to what the traced call left: on a cache hit the
    model's Python code does not run, so its ``+=`` and flag updates would be lost."""
    objects = _cache_objects(cache)
    for i, name, value in after:
        if isinstance(value, dict):
            getattr(objects[i], name).update(value)
        else:
            setattr(objects[i], name, value)


# Note [A static cache reset as one program]
# ``generate`` reuses a static cache across calls (Note [Compiled generation with a
# static cache]) and resets it first: ``cache.reset()`` zeroes each layer's keys,
# values and length, three eager ops per layer. On the chip an eager op costs about
# 0.3 ms of host time (bench/generate_host.py), so a 16-layer model's reset was 48 ops
# and some 15 ms of every ``generate`` (a 128-token decode is ~380 ms of device time).
# When every layer resets with transformers' base ``reset`` (static layers: sliding
# ones were made full-length) and keeps its length as a tensor, the reset writes
# tensors only, with no Python state to move: it runs as one ``torchjax.jit`` program
# (a program per cache object, which generate keeps). Any other layer resets as written.
#
# Note [A reset cache's length known on the host]
# What the program leaves is known without reading it: transformers' base ``reset``
# zeroes each layer's ``cumulative_length``. ``generate`` reads that length right after
# (the prefill's ``past_length``, the SDPA mask's ``q_offset == 0``, compiled
# generation's room check): three host reads, each waiting for the device, and the ops
# on it (``rsub``, ``neg``, ``eq``) device programs. So when the cache and all its layers
# reset with transformers' base methods, the zeros are kept as the lengths' host values
# (Note [Host values of tensors made from host data] in torchjax/tensor/_shadows.py):
# those reads and ops run on the host (Note [Integer ops on host values]). The values
# are exact: the program just wrote these zeros; the prefill's write replaces them.
def reset(cache) -> None:
    """``cache.reset()``, as one program where that changes only tensors (see the Notes);
    nothing where the zeros of an earlier reset are still what it holds (Note [A kept
    cache zeroed behind the decode loop])."""
    from transformers.cache_utils import Cache, CacheLayerMixin, EncoderDecoderCache

    if _still_zeroed(cache):
        return
    _ZEROED.pop(cache, None)
    objects = _cache_objects(cache)
    layers = [o for o in objects if o is not cache and not isinstance(o, EncoderDecoderCache)]
    plain = (
        not isinstance(cache, EncoderDecoderCache)
        and layers
        and all(
            type(layer).reset is CacheLayerMixin.reset
            and getattr(layer, "is_initialized", False)
            and isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
            for layer in layers
        )
    )
    if not plain:
        cache.reset()
        return
    base = type(cache).reset is Cache.reset
    zeros = _zeroed_in_place(layers) if base else None
    if zeros is None:
        _reset_program()(cache)
    if base:  # Note [A reset cache's length known on the host]
        for layer in layers:
            length = layer.cumulative_length
            if isinstance(length, JaxTensor) and length.numel() == 1:
                _shadows.remember(length._storage, torch.zeros((), dtype=length.dtype))
    if zeros is not None:
        _ZEROED[cache] = (type(cache), _weak_layers(layers), zeros)


# Note [A static cache reset as its storages zeroed]
# transformers' base resets (``Cache.reset`` calls each layer's; ``CacheLayerMixin.reset``
# zeroes its ``keys``, ``values`` and tensor ``cumulative_length``) write zeros over
# three tensors a layer. Where each is a plain JaxTensor over the whole of its own
# storage (offset 0, contiguous, every element), that is each storage's array replaced
# by zeros of its shape and dtype: one jax program over the arrays, donated as the
# reset program donates them (Note [Donation never takes the user's copy]), the zeros
# written back as its write-back does (``Storage.replace``). It skips what the reset
# program's call does per call and that this program does not need: the state walk
# of the cache, its key, the program's outputs laid out as tensors (~0.3 ms of the
# ~0.6 ms a 16-layer reset took on CPU). A tensor that is not such (a view, a storage
# shared by two of them, one on several devices,
# requiring grad, an inference tensor outside inference mode, which ``zero_`` refuses)
# resets through the program, as before.
def _zeroed_in_place(layers) -> tuple | None:
    """Zero the layers' keys, values and lengths as whole storages (Note [A static cache
    reset as its storages zeroed]); returns weak references to each tensor, its storage
    and its zeros, or None, having changed no value, where that is not what ``zero_`` of
    each would do. A storage whose array is made on first read gets it made here, as the
    reset program's call reads it."""
    tensors = [t for layer in layers for t in (layer.keys, layer.values, layer.cumulative_length)]
    inference = torch.is_inference_mode_enabled()
    storages, seen = [], set()
    for t in tensors:
        s = t._storage
        if (
            type(t) is not JaxTensor
            or type(s) is not Storage
            or id(s) in seen
            or t.requires_grad
            or (t.is_inference() and not inference)
            or t.storage_offset() != 0
            or t.numel() != s.numel
            or not t.is_contiguous()
            or len(s.arr.sharding.device_set) != 1
        ):
            return None
        seen.add(id(s))
        storages.append(s)
    arrays, _ = _donate.unshared([s.arr for s in storages], range(len(storages)), tensors)
    token = x64_enter()
    try:
        zeros = _zeros(arrays)
    finally:
        x64_exit(token)
    del arrays
    for s, z in zip(storages, zeros):
        s.replace(z)
    # Weak references: a strong one to the zeros would count as a holder of the buffer
    # and have the next call copy it before donating it (Note [Donation never takes the
    # user's copy]); to the tensors, it would keep one the cache dropped.
    return tuple(
        (weakref.ref(t), weakref.ref(s), weakref.ref(_ARR.__get__(s)))
        for t, s in zip(tensors, storages)
    )


# Note [A kept cache zeroed behind the decode loop]
# A static cache that compiled generation keeps for reuse (Note [Compiled generation with
# a static cache] in _generate.py) was reset at the start of the next ``generate``: host
# work in its prelude, before the prefill, with the device idle (some 0.4-0.8 ms on a
# 16-layer model on CPU, and a program call of 48 donated buffers). A kept cache that
# ``generate`` made or reused for a call whose decoding ran in the decode programs
# (Note [Decode steps as one program] in _decode.py) is reached by nothing else once
# the call returns (its result is the tokens, not the cache), so its reset is dispatched
# right after the decode loop, while the device runs the loop: ``zero_ahead``. The
# reset at the next ``generate`` then finds the zeros still there and does nothing:
# every layer is the layer of that reset (its type, its keys, values and length the
# same tensors over the same storages), and each storage holds the very array of zeros
# the reset wrote (jax arrays are immutable: any write gives a storage a new one), so
# ``cache.reset()`` would change no value; the lengths' zeros known on the host (Note
# [A reset cache's length known on the host]) are tied to those arrays too. Only a
# reset by zeroed storages (Note [A static cache reset as its storages zeroed]) is
# remembered. The cache's values between the two calls are zeros instead of the last
# call's keys and values, which nothing reads: a cache that reaches the caller (passed
# in, or returned with ``return_dict_in_generate``) is never zeroed ahead.
_ZEROED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> its zeroing
# The kept caches ``generate`` made or reused for the current call (a list, set by the
# compiled generate for the call; None outside one).
PREPARED = contextvars.ContextVar("torchjax_prepared_caches", default=None)


def _weak_layers(layers) -> tuple:
    return tuple((weakref.ref(layer), type(layer)) for layer in layers)


def _still_zeroed(cache) -> bool:
    """Whether ``cache`` holds exactly what its last reset by zeroed storages left (Note [A
    kept cache zeroed behind the decode loop])."""
    done = _ZEROED.get(cache)
    if done is None:
        return False
    kind, layers, zeros = done
    if type(cache) is not kind or len(cache.layers) != len(layers):
        return False
    tensors = []
    for layer, (was, cls) in zip(cache.layers, layers):
        if layer is not was() or type(layer) is not cls:
            return False
        tensors += (getattr(layer, name, None) for name in ("keys", "values", "cumulative_length"))
    for t, (was, storage, held) in zip(tensors, zeros):
        if t is not was():
            return False
        s = t._storage
        if s is not storage() or s.lazy is not None or _ARR.__get__(s) is not held():
            return False
    return True


def zero_ahead(cache) -> None:
    """Reset ``cache``, a kept cache made or reused for this ``generate`` call, after its
    decoding was dispatched (Note [A kept cache zeroed behind the decode loop])."""
    prepared = PREPARED.get()
    if prepared is not None and any(c is cache for c in prepared):
        reset(cache)


@functools.partial(jax.jit, donate_argnums=0)
def _zeros(arrays):
    return [jnp.zeros_like(a) for a in arrays]


@functools.cache
def _reset_program():
    def reset_cache(cache):
        cache.reset()

    # Traced once per cache object (keyed by identity, held weakly): a process that
    # makes many models traces it as often, by design, so no RetraceWarning.
    return jit(reset_cache, warn_after=1 << 30)
