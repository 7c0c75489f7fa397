"""A static cache keeps its tensors across compiled calls (Note [Compiled generation with a
static cache] in torchjax/integrations/transformers/_generate.py): torchjax.jit binds
state by storage identity, so a layer that replaces its tensors, or a model that
replaces a sub-cache, would make every call new state and a new trace."""

from __future__ import annotations

import torch

from torchjax.integrations.transformers._cache_state import _cache_objects


def made_in_inference_mode(cache) -> bool:
    """Whether the cache's allocated tensors are inference tensors."""
    for obj in _cache_objects(cache):
        keys = getattr(obj, "keys", None)
        if isinstance(keys, torch.Tensor):
            return keys.is_inference()
    return False


def layout(cache) -> tuple:
    from transformers.cache_utils import EncoderDecoderCache

    if isinstance(cache, EncoderDecoderCache):
        return (layout(cache.self_attention_cache), layout(cache.cross_attention_cache))
    return (type(cache).__name__,) + tuple(
        (type(layer).__name__, getattr(layer, "max_cache_len", None)) for layer in cache.layers
    )


def reuse_cross_cache(cache, crosses) -> None:
    """Put back the cross-attention sub-cache first seen in this encoder-decoder cache,
    reset, in place of a fresh one of the same layout (nothing written in it yet)."""
    from transformers.cache_utils import EncoderDecoderCache

    if not isinstance(cache, EncoderDecoderCache):
        return
    new = cache.cross_attention_cache
    old = crosses.setdefault(cache, new)
    if old is new or any(getattr(layer, "is_initialized", True) for layer in new.layers):
        return
    inference = torch.is_inference_mode_enabled()
    if layout(old) != layout(new) or (made_in_inference_mode(old) and not inference):
        crosses[cache] = new
        return
    old.reset()
    cache.cross_attention_cache = old


def pin_cache(cache, pinned) -> None:
    """Give each cache layer back the key/value tensors it held when first seen, with
    the current values copied in (Note [Compiled generation with a static cache]: beam search)."""
    from transformers.cache_utils import EncoderDecoderCache

    caches = (
        (cache.self_attention_cache, cache.cross_attention_cache)
        if isinstance(cache, EncoderDecoderCache)
        else (cache,)
    )
    for c in caches:
        for layer in getattr(c, "layers", ()):
            if not getattr(layer, "is_initialized", False):
                continue
            held = pinned.setdefault(layer, {})
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if not isinstance(t, torch.Tensor):
                    continue
                old = held.setdefault(name, t)
                if old is not t and old.shape == t.shape and old.dtype == t.dtype:
                    old.copy_(t)
                    setattr(layer, name, old)
                elif old is not t:
                    held[name] = t
