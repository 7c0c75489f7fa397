"""Optimizers under ``torchjax.jit`` and ``torch.compile(backend="tpu")``: switched to
capturable mode, so their step counters are tensors on the device (traced inputs) rather
than Python numbers baked into the trace; ``torchjax.uninstall()`` switches them back
(Note [Process-wide changes]).

A capturable optimizer keeps all its state on the parameters' device, and its step
assumes so: a state made by a non-capturable step (the counter ``step`` and NAdam's
``mu_product`` on CPU) moves to the device with the switch, or the step would mix
devices (``mu_product *= mu``) and torch's own capturable check refuses it.

Note [Step counters of compiled optimizers are float64]
In capturable mode torch keeps ``step`` as a float32 tensor and computes the bias
corrections from it on the device: Adam's ``1 - beta2 ** step`` in float32, where
``beta2 = 0.999`` rounds to 0.99900001 and the subtraction cancels, so the first step's
``1 - beta2`` is off by 1.3e-5 (relative) and the update by half that. CPU's
non-capturable step computes the same numbers as Python floats (float64), and eager tpu
matches CPU to the last bits or so: a compiled AdamW drifted from CPU by ~2e-6 within a
few steps, float64 parameters included. So the step counter of a compiled optimizer on
tpu is float64: it counts exactly as before (integers), and the bias corrections made
from it are float64 0-d tensors, which do not change a parameter's dtype (a 0-d tensor
does not promote a dimensioned one of the same kind). Fresh state is widened as the
optimizer's ``_init_group`` makes it (wrapped once per optimizer, so the first traced
step already counts in float64; a fresh counter's zero fill becomes a float64 fill, so
a first call's state is still all fills: Note [Optimizer state made in a first call]);
existing state (a non-capturable step's, or one ``load_state_dict`` cast to float32)
when ``torchjax.jit`` or Dynamo meets the optimizer. Fused groups keep torch's float32,
which their kernels take. What stays of capturable mode is its formula: the update
divides by ``(sqrt(v) / bc2 + eps) / -step`` rather than multiplying by a Python
``-step``, so float32 results differ from CPU's in the last bits, and a bfloat16
parameter's divisors are rounded to bfloat16 as on CUDA.
``torchjax.uninstall()`` puts torch's dtype back.
"""

from __future__ import annotations

import weakref

import torch

from torchjax import _patches
from torchjax._compat.torch import (
    has_init_group,
    optimizer_scalar_dtype,
    unwrap_init_group,
    wrap_init_group,
)
from torchjax.tensor._fills import unread_fill
from torchjax.tensor._tensor import JaxTensor

# Optimizers switched by make_capturable -> the param groups it switched and the state
# entries it moved to the device (weakly held), put back by torchjax.uninstall().
_CAPTURABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Optimizers whose _init_group make_capturable wrapped (Note [Step counters of compiled
# optimizers are float64]).
_WIDENED: weakref.WeakSet = weakref.WeakSet()


def make_capturable(opt) -> bool:
    """Switch ``opt`` to capturable mode (its state on the device), its step counters
    float64 (Note [Step counters of compiled optimizers are float64]). True if changed."""
    changed = []
    for group in opt.param_groups:
        if "capturable" in group and not group["capturable"]:
            group["capturable"] = True
            changed.append(group)
    if changed:
        groups, moved = _CAPTURABLE.setdefault(opt, ([], []))
        groups.extend(changed)
        for group in changed:
            for p in group["params"]:
                state = opt.state.get(p, {})
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and not isinstance(value, JaxTensor):
                        state[key] = value.to(p.device)
                        moved.append((p, key))
    widened = bool(_widen_steps(opt, opt.param_groups))
    wrapped = opt not in _WIDENED and has_init_group(opt)
    if wrapped:
        wrap_init_group(opt, _widen_fresh)
        _WIDENED.add(opt)
    if changed or widened or wrapped:
        _patches.record(
            "optimizer capturable=True under jit",
            why="the step counter must be a traced input, not a constant of the trace, "
            "and count in float64 for CPU's bias corrections",
            package="torch",
            written_for="2.13",
            undo=_undo_capturable,
        )
    return bool(changed) or widened


def _widen_steps(opt, groups) -> dict:
    """The float32 ``step`` counters on tpu of ``groups``' parameters made float64
    (capturable, non-fused groups only): {id(old counter): new counter}."""
    widened = {}
    for group in groups:
        if group.get("fused") or not group.get("capturable"):
            continue
        for p in group["params"]:
            state = opt.state.get(p)
            step = state.get("step") if state else None
            if isinstance(step, JaxTensor) and step.dtype == torch.float32:
                state["step"] = widened[id(step)] = _as_float64(step)
    return widened


def _as_float64(step):
    """``step`` made float64. A counter that still holds only its fill (a fresh one's
    zero) becomes a float64 fill, not a conversion: a first compiled call then finds its
    optimizer's state made of fills (Note [Optimizer state made in a first call] in
    torchjax/compile/_made_state.py)."""
    fill = unread_fill(step)
    if fill is None:
        return step.to(torch.float64)
    return torch.full(step.shape, fill, dtype=torch.float64, device=step.device)


def _widen_fresh(opt, group, fresh, lists) -> None:
    """After the optimizer's ``_init_group``: the step counters it made float64, in the
    state and in the lists it filled (``state_steps``), which the step updates."""
    widened = _widen_steps(opt, [{**group, "params": fresh}]) if fresh else None
    if widened:
        for filled in lists:
            filled[:] = [widened.get(id(x), x) for x in filled]


def _undo_capturable() -> None:
    """Groups switched by make_capturable back to capturable=False, with their step
    counters (in torch's dtype) and the state it moved (NAdam's mu_product) back on CPU,
    where a non-capturable torch optimizer keeps them; wrapped ``_init_group``s
    removed, and the step counters of groups left capturable in torch's dtype again."""
    scalar = optimizer_scalar_dtype()
    for opt in list(_WIDENED):
        unwrap_init_group(opt)
        for state in opt.state.values():
            step = state.get("step")
            if isinstance(step, JaxTensor) and step.dtype == torch.float64 != scalar:
                state["step"] = step.to(scalar)
    _WIDENED.clear()
    for opt, (groups, moved) in list(_CAPTURABLE.items()):
        moved = {(id(p), key) for p, key in moved}
        for group in groups:
            group["capturable"] = False
            for p in group["params"]:
                state = opt.state.get(p, {})
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and (key == "step" or (id(p), key) in moved):
                        state[key] = value.to("cpu")
    _CAPTURABLE.clear()
