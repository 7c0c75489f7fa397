"""A generation cache's Python state, and which caches keep their shapes step to step.

Helpers of compiled generation: the guard and replay of Note [Nothing frozen in the
decode step] (torchjax/integrations/transformers/_generate.py), shared by the compiled
forward and the decode-step program (Note [Decode steps as one program] in
torchjax/integrations/transformers/_decode.py).
"""

from __future__ import annotations

import functools

import torch

from torchjax.compile._jit import jit

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
def reset(cache) -> None:
    """``cache.reset()``, as one program where that changes only tensors (see the Note)."""
    from transformers.cache_utils import CacheLayerMixin, EncoderDecoderCache

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
    _reset_program()(cache)


@functools.cache
def _reset_program():
    def reset_cache(cache):
        cache.reset()

    # Traced once per cache object (keyed by identity, held weakly): a process that
    # makes many models traces it as often, by design, so no RetraceWarning.
    return jit(reset_cache, warn_after=1 << 30)
