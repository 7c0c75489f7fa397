"""Generate calls that run as transformers wrote them, and auto-compiled models whose
trace failed.

Note [Auto-compiled generate that cannot be traced]
generate on tpu compiles by itself (Note [transformers' auto-compile on tpu]); a model
whose code runs eagerly but cannot be traced (a user's experts function with
``torch.where(top_k_index == e)``: a value-dependent shape) then raised DataDependentError
from a plain ``generate`` that works on CUDA, without a word of the compilation the
user never asked for. When an auto-compiled call's trace raises a TraceError, the call
runs again as transformers wrote it, eagerly (``disable_compile=True`` unless the call
says otherwise: its forward would meet the same refusal in transformers' own compile),
with one UserWarning per model naming the reason and the switches; later calls of that
model go straight to the eager loop. A model compiled on purpose (``compile_generate``)
raises as before.
"""

from __future__ import annotations

import contextvars
import warnings

from torchjax.tensor._errors import TraceError

# Set while a generate call of a model compiled under a rule runs as transformers wrote it
# (the rule said no): the forward, get_compiled_call and the static cache are transformers'.
_AS_WRITTEN = contextvars.ContextVar("torchjax_generate_as_written", default=False)


def as_written(generate, args, kwargs, eager: bool):
    """transformers' generate as written (its forward, cache and loop); ``eager`` adds
    ``disable_compile=True`` where the call does not set it."""
    if eager and "disable_compile" not in kwargs:
        kwargs = dict(kwargs, disable_compile=True)
    token = _AS_WRITTEN.set(True)
    try:
        return generate(*args, **kwargs)
    finally:
        _AS_WRITTEN.reset(token)


def refuse_auto_compile(model, wrapper, error: TraceError) -> None:
    """Note [Auto-compiled generate that cannot be traced]: remember and say it once."""
    if wrapper.untraceable:
        return
    wrapper.untraceable = str(error).split(". ")[0]
    wrapper.last_fallback = "its trace failed"
    warnings.warn(
        f"generate compiles on tpu by itself, and tracing {type(model).__name__} failed: "
        f"{wrapper.untraceable}. This call and later ones of this model run transformers' "
        "eager loop instead (the same tokens, more slowly). Pass disable_compile=True, or "
        "set TORCHJAX_AUTO_COMPILE_GENERATE=0, to choose that yourself; write the code "
        "with fixed shapes to get compiled decoding (Note [Auto-compiled generate that "
        "cannot be traced]).",
        UserWarning,
        stacklevel=4,
    )
