"""Compiled generation: ``model.generate`` with a static KV cache as torchjax.jit programs.

Note [Compiled generation with a static cache]
``generate(..., cache_implementation="static")`` preallocates the KV cache (transformers'
``StaticCache``: one ``(batch, kv_heads, max_cache_len, head_dim)`` tensor per layer for
keys and for values, plus a 0-d ``cumulative_length``) and passes the decode step a
fixed-size 4-d attention mask, so every decode step has the same shapes. That is what
makes it compilable: transformers itself then swaps the decode-step forward for
``torch.compile(model.__call__)`` (``PreTrainedModel.get_compiled_call``, chosen by
``GenerationMixin._valid_auto_compile_criteria``, which already counts device type
"tpu" as compile-capable hardware).

``compile_generate`` hooks the same places with ``torchjax.jit``, and keeps the cache's
identity stable, which torchjax.jit needs and torch.compile does not:

- ``model.forward`` becomes a function that runs the original forward under one
  ``torchjax.jit`` when the call carries a compileable cache that is not a
  ``DynamicCache`` (static, sliding-window static, encoder-decoder with a static
  self-attention cache), and eagerly otherwise (DynamicCache shapes grow every step:
  compiling them would trace once per token). The cache object is an argument, so its
  tensors are state of the jitted function (Note [State of a jitted function]): inputs of
  the program, written back after each step (``index_copy_`` into the keys/values,
  ``cumulative_length.add_``), their buffers donated so XLA updates them in place.
- ``model.get_compiled_call`` returns ``model.__call__``: transformers' own
  ``torch.compile`` (inductor by default) is never invoked; the forward is already
  compiled.
- ``model._prepare_static_cache`` returns an earlier call's cache, reset in place, when
  the new one would have the same layout (type, batch size, each layer's
  ``max_cache_len``). transformers builds a new ``StaticCache`` per ``generate`` call;
  torch.compile guards on shapes, but torchjax.jit binds state by storage identity, so
  a new cache object would mean new traces on every call. As a consequence, a cache
  returned by one ``generate`` call (``return_dict_in_generate=True``) is overwritten by
  the next compiled call with the same layout.
- Beam search reorders the cache between steps (``layer.keys =
  layer.keys.index_select(0, beam_idx)``): new tensors, new storages, which would be
  new state and a new trace per step. Before each compiled call the wrapper copies such
  a replacement into the tensor the layer held when first seen and puts that tensor
  back (``_pin_cache``), so the state keeps its identity; torch.compile avoids the
  problem by taking the cache tensors as graph inputs.

Traces: the prefill (prompt-length input) is one trace and the decode step another. The
first prefill allocates the cache inside the trace (state created by the program), so
its executable is not kept; the next ``generate`` with the same layout traces the prefill
once more (now reading the allocated cache), and from then on both executables are
cache hits. A new prompt length traces the prefill again; a new batch size, number of
beams or a longer cache (transformers sizes it to the largest ``max_length`` seen so far;
``generation_config.max_cache_len`` sizes it once) is a new layout: two more traces.
"""

from __future__ import annotations

import functools
import weakref

import torch

from torchjax.compile._jit import Jitted, jit

_CACHE_KWARGS = ("cache", "past_key_values")


def compile_generate(model: torch.nn.Module, *, warn_after: int = 8) -> Jitted:
    """Make ``model.generate(..., cache_implementation="static")`` run compiled.

    Args:
        model: a transformers ``PreTrainedModel`` with a generation head (causal LM or
            encoder-decoder), on device "tpu". Modified in place: its ``forward``,
            ``get_compiled_call`` and ``_prepare_static_cache`` are replaced by instance
            attributes (deleting the three attributes undoes it).
        warn_after: passed to ``torchjax.jit`` (a ``RetraceWarning`` past this many
            traces).

    Returns:
        The ``torchjax.Jitted`` running the forward: its ``trace_count`` and
        ``cache_hits`` say how often generation traced (see Note [Compiled generation
        with a static cache]). Also kept as ``model.forward.jitted``.

    Raises:
        TypeError: ``model`` has no ``generate`` (not a generation model).
        RuntimeError: ``model.forward`` is already replaced on the instance (e.g. a
            second ``compile_generate``).

    Calls without a static cache (``DynamicCache``, ``use_cache=False``, a plain forward)
    run eagerly, unchanged. Sampling under the compiled step draws from torchjax's RNG
    (seeded by ``torch.manual_seed``), so sampled tokens are reproducible but differ
    from CPU's.
    """
    if not hasattr(model, "generate"):
        raise TypeError(
            f"compile_generate: expected a transformers model with .generate, got "
            f"{type(model).__name__}"
        )
    if "forward" in vars(model):
        raise RuntimeError(
            f"compile_generate: {type(model).__name__}.forward is already replaced on this "
            "instance (compile_generate called twice? an accelerate dispatch hook?); expected "
            "the class's forward. To compile again, delete model.forward, "
            "model.get_compiled_call and model._prepare_static_cache first"
        )
    eager_forward = model.forward  # the class's forward, bound to model
    jitted = jit(eager_forward, warn_after=warn_after)

    pinned = weakref.WeakKeyDictionary()  # cache layer -> {attribute: tensor}

    @functools.wraps(eager_forward)
    def forward(*args, **kwargs):
        cache = _static_cache(kwargs)
        if cache is None:
            return eager_forward(*args, **kwargs)
        _pin_cache(cache, pinned)
        return jitted(*args, **kwargs)

    forward.jitted = jitted
    forward.eager = eager_forward
    model.forward = forward
    model.get_compiled_call = _get_compiled_call.__get__(model)
    model._prepare_static_cache = _reuse_static_cache(model._prepare_static_cache)
    return jitted


def _get_compiled_call(self, compile_config=None):
    """Replaces ``PreTrainedModel.get_compiled_call``: the forward is compiled already."""
    return self.__call__


def _reuse_static_cache(prepare):
    """Wraps ``GenerationMixin._prepare_static_cache`` (bound): same layout, same cache."""
    # One cache per layout: the executables traced for a layout hold its cache anyway
    # (torchjax.jit keys cache objects by identity), so alternating sizes never retrace.
    caches = {}

    @functools.wraps(prepare)
    def prepare_static_cache(cache_implementation, batch_size, *args, **kwargs):
        cache = prepare(cache_implementation, batch_size, *args, **kwargs)
        layout = (cache_implementation, batch_size, _layout(cache))
        old = caches.get(layout)
        if old is not None:
            old.reset()
            return old
        caches[layout] = cache
        return cache

    return prepare_static_cache


def _layout(cache) -> tuple:
    from transformers.cache_utils import EncoderDecoderCache

    if isinstance(cache, EncoderDecoderCache):
        return (_layout(cache.self_attention_cache), _layout(cache.cross_attention_cache))
    return (type(cache).__name__,) + tuple(
        (type(layer).__name__, getattr(layer, "max_cache_len", None)) for layer in cache.layers
    )


def _static_cache(kwargs):
    """The call's cache if its tensors keep their shapes across steps (see the module
    Note), else None."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
    if cache is None or not getattr(cache, "is_compileable", False):
        return None
    decoder = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    return None if type(decoder) is DynamicCache else cache


def _pin_cache(cache, pinned) -> None:
    """Give each cache layer back the key/value tensors it held when first seen, with
    the current values copied in (see the module Note: beam search)."""
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
