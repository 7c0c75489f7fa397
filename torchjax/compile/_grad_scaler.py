"""``torch.amp.GradScaler`` inside a compiled program.

Note [GradScaler steps in compiled programs]
``scaler.step(optimizer)`` unscales the gradients on the device, recording in a 0-d
tensor whether any was not finite, then reads that tensor into Python
(``GradScaler._maybe_opt_step``: ``if not sum(v.item() ...)``) and calls
``optimizer.step()`` only when every gradient was finite. Traced, the read raised
``DataDependentError``: no train step with a GradScaler compiled under ``torchjax.jit``.
(``scaler.update()`` needs nothing: ``_amp_update_scale_`` backs off or grows the scale
on the device, torchjax/ops/amp.py.)

So ``_maybe_opt_step`` is replaced (through torchjax/_compat/torch_amp.py, recorded in
Note [Process-wide changes]): where the found-inf values are concrete (eager, and
torch.compile's graph breaks) torch's own runs; where they are traced, the optimizer
steps unconditionally and then every storage of its parameters and state the step wrote
takes ``where(found_inf, value before, value after)``, so a skipped step leaves them as
they were, as torch's fused optimizers skip on the device (``found_inf`` of
``_fused_adam_``); a state tensor the step replaces instead of writing (an optimizer of
the user's) takes the old one's value there. The result equals eager's, step for step:
the same parameters, the same scale, the same skipped steps, with no host read.

A skipped step cannot undo state the step *made* (a new entry of the optimizer's
state): eager leaves an optimizer without state after a skipped first step (SGD then
starts its momentum buffer from the next gradient, not from a blend), while a traced
step would keep what it made from a non-finite gradient. So a traced step that makes
optimizer state is noted (``made_watched``); torchjax.jit runs that call as eager
Python instead of its program (the step is skipped or taken exactly, with one host
read), and the next call traces with the state in place, from then on compiled (Note
[Optimizer state made in a first call] in _made_state.py retraces an Adam-like first
step before that applies, when the scaler's own scale is not made in the same call).
Under a trace that is not torchjax.jit's (``jax.jit`` over ``torchjax.functional``)
such a step is refused: run one step eagerly first.

What the masked step cannot see: a tensor outside the optimizer's parameters and state
that its ``step()`` writes (a step hook's own buffer) is written even when the step is
skipped; and Python the step runs (hooks, counters) runs at trace time, as for any
compiled step.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
import torch

from torchjax._compat.torch_amp import found_inf_per_device, install_scaler_step
from torchjax.compile._aliases import root
from torchjax.tensor._tensor import JaxTensor

_WATCH = threading.local()

_MADE = (
    "GradScaler.step({}) under a trace made the optimizer's state (its first step), "
    "which a step skipped for non-finite gradients cannot undo on the device. Run one "
    "step of the optimizer eagerly (or under torchjax.jit, which does that itself) before "
    "tracing it (Note [GradScaler steps in compiled programs])."
)


def install() -> None:
    install_scaler_step(maybe_opt_step)


@contextlib.contextmanager
def made_watched():
    """Within the block (a torchjax.jit trace), note the optimizers a traced scaler step
    made state for, in the list yielded, instead of refusing them."""
    previous = getattr(_WATCH, "made", None)
    made = _WATCH.made = []
    try:
        yield made
    finally:
        _WATCH.made = previous


def maybe_opt_step(original, scaler, optimizer, optimizer_state, *args, **kwargs):
    """``GradScaler._maybe_opt_step``: torch's where the found-inf values are concrete,
    the masked step where they are traced."""
    found = found_inf_per_device(optimizer_state)
    if not any(_traced(t) for t in found):
        return original(scaler, optimizer, optimizer_state, *args, **kwargs)
    skip = functools.reduce(torch.add, found) != 0
    return _masked_step(optimizer, skip, args, kwargs)


def _traced(t) -> bool:
    return isinstance(t, JaxTensor) and isinstance(t._value(), jax.core.Tracer)


def _masked_step(optimizer, skip, args, kwargs):
    """``optimizer.step(*args, **kwargs)`` whose writes to its parameters and state are
    undone on the device where ``skip`` (a 0-d bool tensor) is true."""
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [v for entry in optimizer.state.values() for v in entry.values()]
    storages = {}
    for t in tensors:
        if isinstance(t, JaxTensor):
            s = root(t)
            storages.setdefault(id(s), s)
    before = [(s, s.version, s.arr) for s in storages.values()]
    state = _state(optimizer)
    retval = optimizer.step(*args, **kwargs)
    skipped = skip._value()
    for s, version, old in before:
        if s.version != version:
            s.replace(jnp.where(skipped, old, s.arr))
    made = False
    for key, t in _state(optimizer).items():
        old = state.get(key)
        if t is old or not isinstance(t, torch.Tensor):
            continue
        if isinstance(old, JaxTensor) and isinstance(t, JaxTensor) and _alike(t, old):
            # A state tensor the step replaced (not written in place): the new one takes
            # the old one's value (put back above) where the step is skipped.
            with torch.no_grad():
                t.copy_(torch.where(skip, old, t))
        else:
            made = True
    if made:
        watch = getattr(_WATCH, "made", None)
        if watch is None:
            raise RuntimeError(_MADE.format(type(optimizer).__name__))
        watch.append(optimizer)
    return retval


def _state(optimizer) -> dict:
    """The optimizer's state values by (parameter id, key)."""
    return {(id(p), k): v for p, entry in optimizer.state.items() for k, v in entry.items()}


def _alike(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype
