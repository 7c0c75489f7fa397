"""transformers' auto-compiled generation on "tpu" runs as torchjax's decode programs.

Note [transformers' auto-compile on tpu]
``generate`` with a static cache on an accelerator compiles the decode step by itself
(``GenerationMixin._valid_auto_compile_criteria``; on device "tpu" with the "tpu" Dynamo
backend, ``PreTrainedModel._default_compile_config``), but only the forward: its
per-token bookkeeping (slicing, ``cat`` of the growing ids and mask, processors, token
choice, stopping criteria, a host read) still runs op by op around it, dozens of eager
ops and XLA calls per token. ``compile_generate`` replaces all of it by device programs
(Note [Decode steps as one program] in _decode.py). So ``GenerationMixin.generate`` is
wrapped: a call on a tpu model that transformers would auto-compile (``would_compile``:
a static cache requested or passed, compilation not disabled, ``compile_config`` absent
or naming the "tpu" or "inductor" backend, which both reach torchjax's backend on tpu
tensors; no quantizer that refuses compilation, no cpu/disk offload) first applies
``compile_generate`` to the model (once; the model keeps it), then runs. Later calls of
that model that transformers would not compile (``disable_compile=True``, another
backend, a ``DynamicCache``, the model moved off tpu) run transformers' generate as
written: the forward eager, ``get_compiled_call`` transformers' own.

Not taken: models whose class overrides ``generate`` (they call it with their own
preprocessing done; running it twice is not safe), calls with positional arguments past
``inputs``, models whose ``forward`` is already replaced on the instance (accelerate's
hooks), and offloaded static caches. ``TORCHJAX_AUTO_COMPILE_GENERATE=0`` turns the whole
rule off (read per call): transformers then compiles the forward with
``torch.compile(backend="tpu")`` and runs its own loop, as before.
"""

from __future__ import annotations

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


def would_compile(model, kwargs) -> bool:
    """Whether transformers would auto-compile this ``generate(**kwargs)`` call's decode
    step on "tpu" and torchjax takes it (see the Note)."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache
    from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

    if os.environ.get(_ENV, "1") == "0" or model.device.type != "tpu":
        return False
    config = kwargs.get("generation_config") or model.generation_config

    def setting(name):
        return kwargs[name] if name in kwargs else getattr(config, name, None)

    if setting("disable_compile"):
        return False
    compile_config = setting("compile_config")
    if compile_config is not None and compile_config.backend not in _BACKENDS:
        return False
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None:
        decoder = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        if not getattr(cache, "is_compileable", False) or type(decoder) is DynamicCache:
            return False
    else:
        implementation = setting("cache_implementation")
        if implementation not in ALL_STATIC_CACHE_IMPLEMENTATIONS or "offloaded" in implementation:
            return False
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        return False
    devices = set(getattr(model, "hf_device_map", {}).values())
    return "disk" not in devices and not ("cpu" in devices and len(devices) > 1)


def _wrap_generate(original):
    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if (
            len(args) <= 1
            and type(self).generate is generate
            and "forward" not in vars(self)
            and would_compile(self, kwargs)
        ):
            _generate.compile_generate_as(self, rule=would_compile)
            return self.generate(*args, **kwargs)
        return original(self, *args, **kwargs)

    return generate


def install() -> None:
    """Wrap ``GenerationMixin.generate`` (Note [transformers' auto-compile on tpu])."""
    if _patches.is_recorded(_NAME):
        return
    cls = sys.modules[_TARGET_MODULE].GenerationMixin
    _patches.replace_attrs(
        cls,
        {"generate": _wrap_generate(cls.__dict__["generate"])},
        name=_NAME,
        why="generate that transformers would auto-compile on tpu runs torchjax's decode "
        "programs (compile_generate), not its per-token loop around a compiled forward",
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
