"""Which kept static cache a ``_prepare_static_cache`` call would end with, known before
transformers builds a new one (Note [A kept cache found without building one]).

Note [A kept cache found without building one]
compile_generate's ``_prepare_static_cache`` (``_reuse_static_cache`` in _generate.py)
returns a kept cache when the one transformers builds has its layout (Note [Compiled
generation with a static cache]): a warm ``generate`` built a ``StaticCache`` (its layers
read from the text config, ~0.35 ms of host time at 16 layers on CPU) only to drop it.
The layout, and so the kept cache's key, is a function of what transformers' own
``_prepare_static_cache`` (5.24) reads: the cache implementation (offloading), the batch
size, the length it builds (``max(max_cache_len, model._previous_max_cache_length)``,
after our kernel rounding where it applies), the model's config (the text config's layer
types, windows, chunk sizes, KV sharing, states: all in the config's ``__dict__``,
sub-configs included), and, for a chunked prefill, the early initialization's heads,
dtype, device and tensor-parallel size. So a call keys the layout-key it got before by
those inputs (a plan) and by a deep copy of the config's ``__dict__``, compared by
value: an equal plan and an equal config give the same layout, and the kept cache is
taken without building one; ``model._previous_max_cache_length`` is set as the build
would have set it. Not for encoder-decoder models (the cross-attention cache's length
is the encoder output's), a model class with its own ``_prepare_static_cache``, or an
eager generate's sizing (``_EAGER_SIZED``): those always build.
"""

from __future__ import annotations

import collections
import copy

from torchjax.pallas._decode_sdpa import kernel_length

KEEP_PLANS = 16  # plans remembered per model


def _transformers_prepare():
    from transformers.generation.utils import GenerationMixin

    found = GenerationMixin.__dict__["_prepare_static_cache"]
    return getattr(found, "__wrapped__", found)


def plannable(model, prepare) -> bool:
    """Whether ``prepare`` (the bound ``_prepare_static_cache`` that compile_generate
    wraps) is transformers' own (maybe wrapped by _auto_compile's sizing patch)."""
    func = getattr(prepare, "__func__", None)
    return func is not None and getattr(func, "__wrapped__", func) is _transformers_prepare()


class Plans:
    """Per model: plan -> (deep copy of the config's ``__dict__``, the reuse key the
    built cache had), for the ``KEEP_PLANS`` plans used last."""

    def __init__(self):
        self._plans = collections.OrderedDict()

    @staticmethod
    def lengths(model, asked: int, kernel: bool) -> tuple:
        """(the length transformers builds, the length our ``_unslide`` uses, the
        ``_previous_max_cache_length`` the call leaves), as ``kernel_sized`` or the plain
        ``prepare`` would have them."""
        previous = getattr(model, "_previous_max_cache_length", -1)
        if kernel:
            sized = kernel_length(max(asked, previous))
            return max(sized, previous), sized, max(asked, previous)
        built = max(asked, previous)
        return built, built, built

    @staticmethod
    def plan(model, cache_implementation, batch_size, built, chunk) -> tuple | None:
        """The inputs besides the config that decide the built cache's layout and key, or
        None where a call must build (Note [A kept cache found without building one])."""
        from torchjax.integrations.transformers._auto_compile import _EAGER_SIZED

        if _EAGER_SIZED.get() or model.config.is_encoder_decoder:
            return None
        return (
            cache_implementation,
            batch_size,
            built,
            chunk,
            model.dtype,
            model.device,
            type(model.config),
            getattr(model, "_tp_size", None),
        )

    def key(self, model, plan):
        """The reuse key a build under ``plan`` gave, if the config is unchanged since."""
        found = self._plans.get(plan)
        if found is None:
            return None
        try:
            same = vars(model.config) == found[0]
        except (ValueError, RuntimeError, TypeError):  # a value without a plain == (an array)
            same = False
        if not same:
            return None
        self._plans.move_to_end(plan)
        return found[1]

    def record(self, model, plan, key) -> None:
        try:
            config = copy.deepcopy(vars(model.config))
        except TypeError:  # a value that cannot be copied: such a config always builds
            return
        self._plans[plan] = (config, key)
        self._plans.move_to_end(plan)
        while len(self._plans) > KEEP_PLANS:
            self._plans.popitem(last=False)
