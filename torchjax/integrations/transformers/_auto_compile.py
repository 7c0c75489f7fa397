"""transformers' auto-compiled generation on "tpu" runs as torchjax's decode programs.

Note [transformers' auto-compile on tpu]
``generate`` with a static cache on an accelerator compiles the decode step by itself
(``GenerationMixin._valid_auto_compile_criteria``; on device "tpu" with the "tpu" Dynamo
backend, ``PreTrainedModel._default_compile_config``), but only the forward: its
per-token bookkeeping (slicing, ``cat`` of the growing ids and mask, processors, token
choice, stopping criteria, a host read) still runs op by op around it, dozens of eager
ops and XLA calls per token. ``compile_generate`` replaces all of it by device programs
(Note [Decode steps as one program] in _decode.py). So ``GenerationMixin.generate`` is
wrapped: a call on a tpu model that transformers would auto-compile (``plan``: a static
cache requested or passed, or none asked for (next Note); compilation not disabled,
``compile_config`` absent or naming the "tpu" or "inductor" backend, which both reach
torchjax's backend on tpu tensors; no quantizer that refuses compilation, no cpu/disk
offload) first applies ``compile_generate`` to the model (once; the model keeps it), then
runs. Later calls of that model that transformers would not compile
(``disable_compile=True``, another backend, a ``DynamicCache`` passed, the model moved
off tpu) run transformers' generate as written: the forward eager,
``get_compiled_call`` transformers' own.

Note [A static cache by default on tpu]
A ``generate`` call that asks for no cache gets transformers' ``DynamicCache``, which
grows by a token each step: on "tpu" every op of every step then has a new shape, a new
XLA program (a first 64-token greedy generate of a tiny Llama compiled 448 programs in
float32 and 1,120 in bfloat16, and took minutes). On tpu such a call gets
``cache_implementation="static"`` added, and so the decode programs, where the cache never
reaches the caller and the model is built for it: no ``return_dict_in_generate`` (its
output carries the cache), ``use_cache`` not False, a model class marked
``_can_compile_fullgraph`` (transformers' mark for models that run a static cache under
``torch.compile(fullgraph=True)``) that uses Cache objects, and no decoding mode that runs
generate as written (a streamer, assisted decoding, the Hub modes). The tokens are the
dynamic cache's: positions not written yet are masked. What changes: the cache is
allocated at ``max_length`` up front and kept for the next call of the same layout (Note
[Compiled generation with a static cache] in _generate.py).

Note [A static cache for eager generate on tpu]
``disable_compile=True`` runs transformers' loop with the forward eager, as written. With
the DynamicCache it would make, each step's ops see a cache one position longer, so each
step compiled new programs for the attention, the cache's ``cat`` and the mask (a first
64-token greedy generate of the tiny Llama: 440 XLA compiles, 23 s on CPU JAX). Where the
previous Note would give a static cache (no cache asked for, none returned, a model built
for it), the eager call gets ``cache_implementation="static"`` too: the forward's shapes
stay the same from step to step and its programs are reused (319 compiles, 13 s). What
still grows per step is transformers' own bookkeeping (the ids and mask ``cat``). The
tokens are the dynamic cache's. That cache is made ``kernel_length`` long, as
compile_generate's (Note [A static cache sized for the attention kernels] in
_generate.py): sized ``max_length - 1`` (47 for a 32-token prompt and 16 new tokens) it
is a key length neither attention kernel takes, and every layer of every decode step
ran SDPA's math path where the decode kernel serves it. ``GenerationMixin.
_prepare_static_cache`` is wrapped for it: it rounds only within such a call
(``_EAGER_SIZED``), with ``kernel_sized``, and runs as written otherwise.

Not taken: models whose class overrides ``generate`` (they call it with their own
preprocessing done; running it twice is not safe), calls with positional arguments past
``inputs`` and ``generation_config``, models whose ``forward`` is already replaced on the
instance (accelerate's hooks), and offloaded static caches.
``TORCHJAX_AUTO_COMPILE_GENERATE=0`` turns these rules off (read per call): transformers
then compiles a static-cache forward with ``torch.compile(backend="tpu")`` and runs its
own loop, and a call that asks for no cache decodes eagerly with a ``DynamicCache``.
"""

from __future__ import annotations

import contextvars
import functools
import os
import sys

from torchjax import _patches
from torchjax.integrations import _after_import
from torchjax.integrations.transformers import _generate

PATCHED_FOR = "5.24"
_TARGET_MODULE = "transformers.generation.utils"
_NAME = "transformers GenerationMixin.generate"
_ENV = "TORCHJAX_AUTO_COMPILE_GENERATE"
_BACKENDS = ("tpu", "inductor")
# Set while an eager generate that got the automatic static cache runs (Note [A static
# cache for eager generate on tpu]): its cache is made kernel_length long.
_EAGER_SIZED = contextvars.ContextVar("torchjax_eager_kernel_sized_cache", default=False)


def plan(model, kwargs) -> dict | None:
    """The keyword arguments to add to this ``generate(**kwargs)`` call so that it runs
    compile_generate's programs (``{}``: none), or None where transformers would not
    compile it on "tpu" and it runs as written (see the Note)."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache
    from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

    if os.environ.get(_ENV, "1") == "0" or model.device.type != "tpu":
        return None

    def setting(name):
        return _generate.generation_setting(model, kwargs, name)

    if setting("disable_compile") or setting("use_cache") is False:
        return None
    compile_config = setting("compile_config")
    if compile_config is not None and compile_config.backend not in _BACKENDS:
        return None
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        return None
    devices = set(getattr(model, "hf_device_map", {}).values())
    if "disk" in devices or ("cpu" in devices and len(devices) > 1):
        return None
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None:
        decoder = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        static = getattr(cache, "is_compileable", False) and type(decoder) is not DynamicCache
        return {} if static else None
    implementation = setting("cache_implementation")
    if implementation is not None:
        static = implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS
        return {} if static and "offloaded" not in implementation else None
    # No cache asked for: transformers would make a DynamicCache. A static one instead,
    # where it never reaches the caller (Note [A static cache by default on tpu]).
    return _generate.static_default(model, kwargs) or None


def eager_static(model, kwargs) -> dict:
    """``{"cache_implementation": "static"}`` for an eager ``generate(...,
    disable_compile=True)`` on tpu that asks for no cache, where the cache would not
    reach the caller; else ``{}`` (Note [A static cache for eager generate on tpu])."""
    if os.environ.get(_ENV, "1") == "0" or model.device.type != "tpu":
        return {}
    if not _generate.generation_setting(model, kwargs, "disable_compile"):
        return {}
    return _generate.static_default(model, kwargs)


def _wrap_generate(original):
    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if len(args) <= 2 and type(self).generate is generate and "forward" not in vars(self):
            settings = _generate.call_settings(args, kwargs)
            if plan(self, settings) is not None:
                # Each new set of generation settings traces the decode step twice; a user
                # who never asked for compilation gets the RetraceWarning later than one
                # who did.
                _generate.compile_generate_as(self, rule=plan, warn_after=32)
                return self.generate(*args, **kwargs)
            extra = eager_static(self, settings)
            if extra:
                args, kwargs = _generate._with_settings(args, kwargs, extra)
                token = _EAGER_SIZED.set(True)
                try:
                    return original(self, *args, **kwargs)
                finally:
                    _EAGER_SIZED.reset(token)
        return original(self, *args, **kwargs)

    return generate


def _wrap_prepare_static_cache(original):
    @functools.wraps(original)
    def _prepare_static_cache(self, cache_implementation, batch_size, *args, **kwargs):
        if not _EAGER_SIZED.get():
            return original(self, cache_implementation, batch_size, *args, **kwargs)
        # Note [A static cache for eager generate on tpu]
        prepare = functools.partial(original, self)
        return _generate.kernel_sized(
            self, prepare, cache_implementation, batch_size, *args, **kwargs
        )[0]

    return _prepare_static_cache


def install() -> None:
    """Wrap ``GenerationMixin.generate`` (Note [transformers' auto-compile on tpu]) and
    ``_prepare_static_cache`` (Note [A static cache for eager generate on tpu])."""
    if _patches.is_recorded(_NAME):
        return
    cls = sys.modules[_TARGET_MODULE].GenerationMixin
    _patches.replace_attrs(
        cls,
        {
            "generate": _wrap_generate(cls.__dict__["generate"]),
            "_prepare_static_cache": _wrap_prepare_static_cache(
                cls.__dict__["_prepare_static_cache"]
            ),
        },
        name=_NAME,
        why="generate that transformers would auto-compile on tpu runs torchjax's decode "
        "programs (compile_generate), not its per-token loop around a compiled forward; "
        "an eager generate's automatic static cache is sized for the attention kernels",
        package="transformers",
        written_for=PATCHED_FOR,
    )


def install_when_imported() -> None:
    """``install()`` now if ``transformers.generation.utils`` is loaded, else right after."""
    _after_import.when_imported(
        _TARGET_MODULE,
        install,
        why="route transformers' auto-compiled generate on tpu right after its module runs",
    )
