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
  the next compiled call with the same layout (and zeroed after that call's decoding:
  Note [A kept cache zeroed behind the decode loop] in _cache_state.py). The caches of
  the last ``KEEP_LAYOUTS`` (4) layouts are kept; an older one is dropped, and a call
  with its layout again traces anew.
- Beam search reorders the cache between steps (``layer.keys =
  layer.keys.index_select(0, beam_idx)``): new tensors, new storages, which would be
  new state and a new trace per step. Before each compiled call the wrapper copies such
  a replacement into the tensor the layer held when first seen and puts that tensor
  back (``pin_cache``), so the state keeps its identity; torch.compile avoids the
  problem by taking the cache tensors as graph inputs.
- An encoder-decoder model may replace its cache's cross-attention sub-cache at the start
  of each ``generate`` (T5Gemma's ``_prepare_cache_for_generation`` makes a new
  full-attention ``StaticCache``): new layers, new tensors, new traces every call. The
  first compiled call with such a fresh sub-cache puts back the one seen before, reset,
  when their layouts match (``reuse_cross_cache``).

Traces: the prefill (prompt-length input) is one trace and the decode step another. The
first prefill allocates the cache inside the trace (state created by the program), so
its executable is not kept; the next ``generate`` with the same layout traces the prefill
once more (now reading the allocated cache), and from then on both executables are
cache hits. A new prompt length traces the prefill again; a new batch size, number of
beams or a longer cache (transformers sizes it to the largest ``max_length`` seen so far;
``generation_config.max_cache_len`` sizes it once) is a new layout: two more traces.

Note [Nothing frozen in the decode step]
On a cache hit the model's Python code does not run, so any Python value of the cache
that it reads would stay at its trace-time value, and any that it updates (``+=``, flags)
would stop moving. Rule: every non-tensor value the traced step reads is a traced input or
a guard. The guard is the cache's Python state (every non-tensor attribute of the cache,
its sub-caches and layers: ints, bools, dicts of them) plus the arguments' shapes and
plain values, passed as a static argument, so a changed value retraces. The state the
traced call left is recorded per guard and written back after every call (``_replay``).
Audit against transformers 5.24's cache_utils:
- StaticLayer: ``cumulative_length`` is a tensor (state); ``is_initialized``,
  ``max_cache_len`` and the sizes set at lazy init change only at the first prefill.
- StaticSlidingWindowLayer (sliding window and chunked attention): ``cumulative_length_int``
  is a Python int read by ``update``, ``get_mask_sizes`` (``kv_offset``, used for mask
  values and pad sizes) and ``get_seq_length`` (position ids); it moves every token.
  Frozen, it gave wrong tokens for chunked attention. Caches that ``generate`` builds
  here have these layers replaced by full-length StaticLayers (``_unslide``): the mask,
  built from the config's window or chunk size and the traced position, does the
  windowing, so nothing moves per token and the decode step traces once. Cost: those
  layers hold ``max_cache_len`` positions rather than the window. A StaticCache that the
  caller passes keeps its sliding layers: correct, but one trace per token (warned).
- Linear-attention layers (Qwen3.5 conv / recurrent state): states are tensors;
  ``has_previous_state`` and the ``is_*_initialized`` dicts flip at the prefill (guard,
  replayed); ``conv_kernel_size`` is fixed.
- EncoderDecoderCache: ``is_updated`` (per-layer cross-attention flags), guard and replay.
- DynamicCache and its layers are never compiled (their shapes grow every step).
- Dynamic / longrope RoPE: they compare ``max(position_ids) + 1`` with Python ints held on
  the rotary module, not the cache; not guarded here (not audited under compile_generate).
Writing past a static layer's ``max_cache_len`` raises IndexError before the step
(``check_room`` in _step_checks.py, as CPU's ``index_copy_``); XLA would drop the
write. Stopping criteria and streamers run in Python between compiled steps, each token,
as in eager generate.
"""

from __future__ import annotations

import collections
import contextvars
import copy
import functools
import inspect
import threading
import types
import weakref

import torch

from torchjax.compile._jit import Jitted, jit
from torchjax.compile._keys import Keyed
from torchjax.integrations.transformers import _decode
from torchjax.integrations.transformers._as_written import (
    _AS_WRITTEN,
    as_written,
    refuse_auto_compile,
)
from torchjax.integrations.transformers._cache_identity import (
    layout,
    made_in_inference_mode,
    pin_cache,
    reuse_cross_cache,
)
from torchjax.integrations.transformers._cache_plans import Plans, plannable
from torchjax.integrations.transformers._cache_state import (
    _CACHE_KWARGS,
    PREPARED,
    _frozen,
    _python_state,
    _replay,
    _static_cache,
    empty_prefill,
    known_empty,
    reset,
)
from torchjax.integrations.transformers._step_checks import check_room, position_rows, record_room
from torchjax.pallas._decode_sdpa import kernel_length
from torchjax.tensor._errors import TraceError


def compile_generate(model: torch.nn.Module, *, warn_after: int = 8, loop: bool = True) -> Jitted:
    """Make ``model.generate(..., cache_implementation="static")`` run compiled.

    Args:
        model: a transformers ``PreTrainedModel`` with a generation head (causal LM or
            encoder-decoder), on device "tpu". Modified in place: its ``forward``,
            ``generate``, ``get_compiled_call`` and ``_prepare_static_cache`` are
            replaced by instance attributes (deleting the four attributes undoes it).
        warn_after: passed to ``torchjax.jit`` (a ``RetraceWarning`` past this many
            traces).
        loop: run the decode steps after the first as one program (a
            ``lax.while_loop`` that stops when every sequence has finished); False runs
            one program call per token (Note [Decode steps as one program]).

    Returns:
        The ``torchjax.Jitted`` running the forward: its ``trace_count`` and
        ``cache_hits`` say how often generation traced (see Note [Compiled generation
        with a static cache]). Also kept as ``model.forward.jitted``.

    Raises:
        TypeError: ``model`` has no ``generate`` (not a generation model).
        RuntimeError: ``model.forward`` is already replaced on the instance (e.g. a
            second ``compile_generate``).

    Calls without a static cache (``DynamicCache``, ``use_cache=False``, a plain forward)
    run eagerly, unchanged. Greedy and sampled decoding of a decoder-only model with a
    static cache run each new token as one program, with the logits processors, the
    token choice and the stopping flags inside it (Note [Decode steps as one program]
    in torchjax/integrations/transformers/_decode.py, which lists what falls back to
    transformers' own loop). Sampling under the compiled step draws from torchjax's RNG
    (seeded by ``torch.manual_seed``), so sampled tokens are reproducible but differ
    from CPU's.
    """
    return compile_generate_as(model, warn_after=warn_after, loop=loop)


def compile_generate_as(model, *, warn_after: int = 8, loop: bool = True, rule=None) -> Jitted:
    """``compile_generate``; with ``rule`` (a function of the model and a generate call's
    keyword arguments returning the keyword arguments to add, or None), a call for which
    it returns None runs transformers' generate as written (Note [transformers'
    auto-compile on tpu] in _auto_compile.py). A model that was compiled under a rule is
    compiled for good by a plain ``compile_generate``."""
    if not hasattr(model, "generate"):
        raise TypeError(
            f"compile_generate: expected a transformers model with .generate, got "
            f"{type(model).__name__}"
        )
    current = vars(model).get("forward")
    if current is not None and getattr(current, "rule", None) is not None and rule is None:
        current.rule, current.loop = None, loop
        return current.jitted
    if current is not None:
        raise RuntimeError(
            f"compile_generate: {type(model).__name__}.forward is already replaced on this "
            "instance (compile_generate called twice? an accelerate dispatch hook?); expected "
            "the class's forward. To compile again, delete model.forward, model.generate, "
            "model.get_compiled_call and model._prepare_static_cache first"
        )
    eager_forward = model.forward  # the class's forward, bound to model
    # A bound method of the model (so parameters and buffers are state, as for the plain
    # forward) taking the cache's Python state as a static argument (Note [Nothing
    # frozen in the decode step]).
    jitted = jit(types.MethodType(_traced_forward, model), warn_after=warn_after)

    pinned = weakref.WeakKeyDictionary()  # cache layer -> {attribute: tensor}
    crosses = weakref.WeakKeyDictionary()  # encoder-decoder cache -> its first cross cache
    # cache -> (tokens it holds, counted on the host; its _write_mark then)
    lengths = weakref.WeakKeyDictionary()

    @functools.wraps(eager_forward)
    def forward(*args, **kwargs):
        cache = _static_cache(kwargs)
        if cache is None or _AS_WRITTEN.get():
            return eager_forward(*args, **kwargs)
        room = check_room(model, cache, args, kwargs, lengths)
        reuse_cross_cache(cache, crosses)
        pin_cache(cache, pinned)
        # One static argument, keyed once (Note [Static values keyed once]);
        # its last entry: Note [The prefill of an empty cache] in _cache_state.py.
        guard = Keyed((_python_state(cache), _signature(args, kwargs), empty_prefill(room)))
        out = jitted(*args, _torchjax_guard=guard, **kwargs)
        _replay(cache, forward.after[guard])
        record_room(lengths, room)
        return out

    forward.jitted = jitted
    forward.eager = eager_forward
    # transformers' generate asks for the forward's signature several times a call; the
    # class's forward's, as ``inspect.signature`` finds it through ``__wrapped__``, once.
    forward.__signature__ = inspect.signature(eager_forward)
    forward.after = {}  # guard -> the cache's Python state the traced call left
    # Greedy and sampled decoding: one program per token (Note [Decode steps as one
    # program] in torchjax/integrations/transformers/_decode.py).
    forward.decode_step = jit(types.MethodType(_decode.decode_step, model), warn_after=warn_after)
    # The bookkeeping after the prefill and the first token's choice (Note [The step
    # after the prefill] in _decode.py).
    forward.first_token = jit(_decode.first_token, warn_after=warn_after)
    forward.states = {}  # the decoding states kept, by layout (_decode.decode_state)
    forward.loop = loop
    forward.rule = rule
    forward.lock = threading.RLock()  # held by a compiled generate call (shared caches)
    forward.positions = position_rows(model)  # a learned position table's rows, or None
    forward.last_fallback = None  # why the last generate ran transformers' loop, if it did
    forward.untraceable = None  # why an auto-compiled model's trace failed, if it did
    model.forward = forward
    model.generate = _device_generate(model.generate)
    model.get_compiled_call = _get_compiled_call.__get__(model)
    model._prepare_static_cache = _reuse_static_cache(model, model._prepare_static_cache)
    model.get_compiled_call()  # kept where transformers keeps its compiled call
    model.__getstate__ = types.MethodType(_state_of_a_copy, model)
    return jitted


# Note [Copies of a compiled model]
# compile_generate (and the auto-compile of generate on tpu) installs instance attributes
# that close over the model: its forward, generate and their programs. A copy
# (``copy.deepcopy``: an EMA or reference model) would share those closures, and so run
# and train the original's weights with its own left untouched; ``torch.save(model)``
# cannot pickle them. So the model's state for copying and pickling (``__getstate__``, as
# ``copy`` and ``pickle`` ask an object for it) leaves them out: a copy or a loaded model
# has its class's methods, as a model never compiled, and compiles again at its own first
# generate (automatically on tpu; ``compile_generate(copy)`` for a copy compiled that way).
INSTALLED = (
    "forward",
    "generate",
    "get_compiled_call",
    "_prepare_static_cache",
    "_compiled_call",
    "_last_compile_config",
    "_torchjax_compiled_call",
    "__getstate__",
)


def _state_of_a_copy(self) -> dict:
    """The model's ``__dict__`` without what compile_generate installed (Note [Copies of a
    compiled model])."""
    return {k: v for k, v in vars(self).items() if k not in INSTALLED}


KEEP_LAYOUTS = 4  # static caches kept for reuse per model

# generate's arguments that a callable ``custom_generate`` would not pass on (transformers
# hands them only to its own decoding methods): with any of them, generate runs as written.
_MODE_ARGUMENTS = frozenset(
    {
        "custom_generate",
        "streamer",
        "synced_gpus",
        "assistant_model",
        "tokenizer",
        "assistant_tokenizer",
    }
)


# Settings that select a decoding mode whose method needs more than a custom_generate
# callable receives (assisted decoding's candidate generator) or that lives in a Hub
# repository (contrastive search, DoLa, group and constrained beam search); with any of
# them set, generate runs as written. Defaults: None, num_beam_groups 1.
_MODE_SETTINGS = (
    "prompt_lookup_num_tokens",
    "assistant_early_exit",
    "penalty_alpha",
    "dola_layers",
    "constraints",
    "force_words_ids",
    "num_beam_groups",
)


def runs_as_written(model, kwargs) -> bool:
    """Whether a generate call names its own ``custom_generate``, passes an argument that
    only transformers' own decoding methods receive, or selects a mode from
    ``_MODE_SETTINGS``: then generate runs as written (with the forward compiled)."""
    if _MODE_ARGUMENTS & kwargs.keys():
        return True
    configs = (kwargs, vars(kwargs.get("generation_config") or model.generation_config))
    return any(c.get(k) not in (None, 1) for c in configs for k in _MODE_SETTINGS)


def call_settings(args, kwargs) -> dict:
    """A generate call's keyword arguments with its ``generation_config``, which may come
    second, positionally."""
    return dict(kwargs, generation_config=args[1]) if len(args) > 1 else kwargs


def generation_setting(model, kwargs, name):
    """A generation setting as a generate call sees it: its keyword argument, else its
    ``generation_config``'s (``call_settings``), else the model's."""
    if name in kwargs:
        return kwargs[name]
    config = kwargs.get("generation_config") or model.generation_config
    return getattr(config, name, None)


def static_default(model, kwargs) -> dict:
    """``{"cache_implementation": "static"}`` for a generate call (its keyword arguments,
    ``generation_config`` included) that asks for no cache and whose cache would not
    reach the caller, on a model built for a static cache; else ``{}`` (Note [A static
    cache by default on tpu] in _auto_compile.py)."""

    def setting(name):
        return generation_setting(model, kwargs, name)

    if (
        kwargs.get("cache", kwargs.get("past_key_values")) is not None
        or setting("cache_implementation") is not None
        or setting("use_cache") is False
        or setting("return_dict_in_generate")
        or not getattr(type(model), "_can_compile_fullgraph", False)
        or not model._supports_default_dynamic_cache()
        or runs_as_written(model, kwargs)
    ):
        return {}
    return {"cache_implementation": "static"}


def _with_settings(args, kwargs, extra) -> tuple:
    """The call's arguments with ``extra`` generation settings added: into a copy of the
    call's ``generation_config`` when it passes one (transformers warns about settings
    passed beside a config), else as keyword arguments."""
    if not extra:
        return args, kwargs
    if len(args) > 1 and args[1] is not None:
        config = copy.deepcopy(args[1])
        config.update(**extra)
        return (args[0], config, *args[2:]), kwargs
    if kwargs.get("generation_config") is not None:
        config = copy.deepcopy(kwargs["generation_config"])
        config.update(**extra)
        return args, {**kwargs, "generation_config": config}
    return args, {**kwargs, **extra}


def _device_generate(generate):
    """``model.generate`` (bound) with ``custom_generate=_decode.device_sample`` added,
    unless ``runs_as_written``, and a static cache where ``static_default`` says. Under a
    rule (``compile_generate_as``), the settings it returns are added instead, and a call
    it refuses (None), or any call on a model moved off "tpu", runs transformers' generate
    as written. Compiled calls of one model take turns: they share its static caches."""
    model = generate.__self__

    @functools.wraps(generate)
    def device_generate(*args, **kwargs):
        wrapper = model.forward
        off_tpu = model.device.type != "tpu"
        seen = call_settings(args, kwargs)
        if off_tpu or len(args) > 2:
            extra = None
        elif wrapper.rule is None:
            extra = static_default(model, seen)
        else:
            extra = wrapper.rule(model, seen)
        failed_before = wrapper.rule is not None and wrapper.untraceable
        if extra is not None and failed_before:
            extra = None  # Note [Auto-compiled generate that cannot be traced]
        if extra is None:
            wrapper.last_fallback = (
                "the model is off tpu"
                if off_tpu
                else ("its trace failed" if failed_before else "not auto-compiled")
            )
            return as_written(generate, args, kwargs, eager=bool(wrapper.untraceable))
        called = args, kwargs
        args, kwargs = _with_settings(args, kwargs, extra)
        if not runs_as_written(model, call_settings(args, kwargs)):
            kwargs["custom_generate"] = _decode.device_sample
        # Note [A static cache sized for the attention kernels]
        returned = generation_setting(model, call_settings(args, kwargs), "return_dict_in_generate")
        token = _KERNEL_SIZED.set(not returned)
        prepared = PREPARED.set([])  # Note [A kept cache zeroed behind the decode loop]
        try:
            with wrapper.lock:
                if wrapper.rule is None:  # compile_generate asked for by the user
                    return generate(*args, **kwargs)
                try:
                    return generate(*args, **kwargs)
                except TraceError as error:
                    failed = error
        finally:
            PREPARED.reset(prepared)
            _KERNEL_SIZED.reset(token)
        refuse_auto_compile(model, wrapper, failed)
        return as_written(generate, *called, eager=True)

    return device_generate


def _traced_forward(self, *args, _torchjax_guard, **kwargs):
    """What ``torchjax.jit`` traces: the class's forward, then a record of the Python state
    it left in the cache (replayed after every call of this executable)."""
    wrapper = vars(self)["forward"]
    if _torchjax_guard.value[-1]:  # Note [The prefill of an empty cache] in _cache_state.py
        known_empty(_static_cache(kwargs))
    out = wrapper.eager(*args, **kwargs)
    wrapper.after[_torchjax_guard] = _python_state(_static_cache(kwargs), values=True)
    return out


def _get_compiled_call(self, compile_config=None):
    """Replaces ``PreTrainedModel.get_compiled_call``: the forward is compiled already. It
    is kept where transformers keeps its compiled call (``_compiled_call``, which callers
    check to see that generate compiled), and dropped again before transformers' own
    method runs for a call made as written, so that it compiles its own."""
    if _AS_WRITTEN.get():
        if vars(self).pop("_torchjax_compiled_call", False):
            vars(self).pop("_compiled_call", None)
            vars(self).pop("_last_compile_config", None)
        return type(self).get_compiled_call(self, compile_config)
    self._compiled_call = self.__call__
    self._last_compile_config = compile_config
    self._torchjax_compiled_call = True
    return self.__call__


def _reuse_static_cache(model, prepare):
    """Wraps ``GenerativePreTrainedModel._prepare_static_cache`` (bound): same layout,
    same cache; sliding-window and chunked layers made full-length (Note [Nothing frozen
    in the decode step])."""
    # One cache per layout, for the KEEP_LAYOUTS layouts used last: torchjax.jit keys
    # cache objects by identity, so alternating between them never retraces; an older
    # layout's cache is dropped (its executables hold it weakly), so a caller that varies
    # batch sizes and lengths does not keep a cache per pair.
    caches = collections.OrderedDict()
    plans = Plans() if plannable(model, prepare) else None

    @functools.wraps(prepare)
    def prepare_static_cache(cache_implementation, batch_size, *args, **kwargs):
        if _AS_WRITTEN.get():
            return prepare(cache_implementation, batch_size, *args, **kwargs)
        cache = _kept_cache(cache_implementation, batch_size, *args, **kwargs)
        prepared = PREPARED.get()
        if prepared is not None:  # Note [A kept cache zeroed behind the decode loop]
            prepared.append(cache)
        return cache

    def _kept_cache(cache_implementation, batch_size, *args, **kwargs):
        inference = torch.is_inference_mode_enabled()
        plan = None
        if plans is not None:  # Note [A kept cache found without building one]
            asked = args[0] if args else kwargs["max_cache_len"]
            chunk = args[1] if len(args) > 1 else kwargs.get("prefill_chunk_size")
            built, _, previous = plans.lengths(model, asked, _KERNEL_SIZED.get())
            plan = plans.plan(model, cache_implementation, batch_size, built, chunk)
            key = plans.key(model, plan) if plan is not None else None
            old = caches.get(key) if key is not None else None
            if old is not None and not (made_in_inference_mode(old) and not inference):
                model._previous_max_cache_length = previous
                reset(old)  # Note [A static cache reset as one program]
                caches.move_to_end(key)
                return old
        if _KERNEL_SIZED.get():
            cache, length = kernel_sized(
                model, prepare, cache_implementation, batch_size, *args, **kwargs
            )
        else:
            cache = prepare(cache_implementation, batch_size, *args, **kwargs)
            length = model._previous_max_cache_length
        # A cache made under inference_mode holds inference tensors, which a call outside
        # it may not write: such a call takes the new cache instead (and traces anew).
        _unslide(cache, length)
        key = (cache_implementation, batch_size, model.dtype, model.device, layout(cache))
        if plan is not None:
            plans.record(model, plan, key)
        old = caches.pop(key, None)
        if old is not None and not (made_in_inference_mode(old) and not inference):
            reset(old)  # Note [A static cache reset as one program]
            cache = old
        else:
            _initialize_early(model, cache, batch_size)
        caches[key] = cache
        while len(caches) > KEEP_LAYOUTS:
            caches.popitem(last=False)
        return cache

    return prepare_static_cache


def kernel_sized(model, prepare, cache_implementation, batch_size, *args, **kwargs) -> tuple:
    """``prepare`` (transformers' ``_prepare_static_cache``, bound to ``model``) with the
    cache made ``kernel_length`` long (Note [A static cache sized for the attention
    kernels]); returns the cache and that length. transformers' record of the longest
    cache asked for keeps the length it asked for, not the rounded one."""
    asked = args[0] if args else kwargs["max_cache_len"]
    previous = getattr(model, "_previous_max_cache_length", -1)
    sized = kernel_length(max(asked, previous))
    args, kwargs = _with_length(args, kwargs, sized)
    cache = prepare(cache_implementation, batch_size, *args, **kwargs)
    model._previous_max_cache_length = max(asked, previous)
    return cache, sized


def _with_length(args, kwargs, length: int) -> tuple:
    """``_prepare_static_cache``'s arguments after the first two, ``max_cache_len`` set."""
    if args:
        return (length, *args[1:]), kwargs
    return args, {**kwargs, "max_cache_len": length}


# Note [A static cache sized for the attention kernels]
# generate sizes a static cache max_length - 1 (255 for a 128-token prompt and 128 new
# tokens). SDPA takes the flash kernel only for key lengths that are multiples of 16 and
# the decode kernel likewise (of 128 past 2048; Note [SDPA dispatch rule]), so over such
# a cache every layer of the prefill and of each decode step ran the math path (f32
# products at HIGHEST precision, the (B, H, L, S) scores materialised) on the chip too,
# where the forward alone, 128 keys, took the flash kernel: for a 1.1B Llama on a v5e
# the prefill program compiled in 18.8 s, the forward alone in 5.2 s. A cache that
# compile_generate makes for a call whose cache does not reach the caller
# (``return_dict_in_generate`` off) is therefore made ``kernel_length`` long, the
# shortest length at least transformers' that the kernels take. The extra positions
# are never written and never attended: the mask is built at the cache's length, and
# causal masking hides every position after the query, so the tokens are the same.
# transformers' ``_previous_max_cache_length`` keeps the length it asked for, so a
# later call made as written sizes its cache as it would have. ``kernel_sized`` does it,
# for these caches and for the static cache an eager generate gets by default (Note [A
# static cache for eager generate on tpu] in _auto_compile.py).
_KERNEL_SIZED = contextvars.ContextVar("torchjax_kernel_sized_cache", default=False)


def _initialize_early(model, cache, batch_size: int) -> None:
    """Make a fresh static cache's layers before the first prefill, as transformers does
    for a chunked prefill (Note [A static cache initialized before its first step])."""
    from transformers import cache_utils as cu

    if type(cache) is not cu.StaticCache or (getattr(model, "_tp_size", None) or 1) > 1:
        return
    if torch.is_autocast_enabled(model.device.type):  # key states in autocast's dtype
        return
    shape = getattr(model, "_get_static_cache_init_shape", lambda: None)()
    if shape is not None:
        num_heads, head_dim = shape
        cache.early_initialization(batch_size, num_heads, head_dim, model.dtype, model.device)


# Note [A static cache initialized before its first step]
# transformers' StaticCache makes its layers' tensors at the first ``update``, inside the
# first prefill; a cache reused by a later ``generate`` (reset, not made anew) arrives
# with them made. The cache's Python state is part of the compiled prefill's guard, so
# the second ``generate`` traced and compiled the prefill again (15.7 s on a v5e for a
# 1.1B model, whose third call took under a second). A fresh cache is initialized before
# its first step instead (``early_initialization``, with transformers' own
# ``_get_static_cache_init_shape``: per-layer heads and head sizes, None where it cannot
# say), so every call sees one structure. Not for tensor-parallel models (their layers
# take the sharding of the first key states, which an early tensor would not have),
# under autocast (key states in autocast's dtype, not the model's), nor for
# encoder-decoder caches, as in transformers.


def _unslide(cache, max_cache_len: int) -> None:
    """Replace the sliding-window / chunked layers of a fresh ``StaticCache`` by full-length
    static layers: the model's mask (built from the config's window or chunk size and the
    traced cache position) then does the windowing, and no Python int moves per token."""
    from transformers import cache_utils as cu

    if isinstance(cache, cu.EncoderDecoderCache):
        cache = cache.self_attention_cache
    if type(cache) is not cu.StaticCache:
        return
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_initialized", True):
            continue
        if type(layer) is cu.StaticSlidingWindowLayer:
            cache.layers[i] = cu.StaticLayer(max_cache_len=max_cache_len)
        elif type(layer) is cu.LinearAttentionAndStaticSlidingWindowAttentionLayer:
            cache.layers[i] = cu.LinearAttentionAndStaticFullAttentionLayer(
                max_cache_len=max_cache_len, number_of_states=layer.number_of_states
            )


def _signature(args, kwargs) -> tuple:
    """Shapes, dtypes and plain values of the call's arguments besides the cache: with the
    Python state, what decides the state a traced call leaves (e.g. ``+= seq_len``)."""
    from torchjax._compat.torch import pytree

    rest = {k: v for k, v in kwargs.items() if k not in _CACHE_KWARGS}
    return tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else _frozen(x)
        for x in pytree.tree_leaves((args, rest))
    )
