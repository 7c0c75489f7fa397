"""Optimizers under ``torchjax.jit`` and ``torch.compile(backend="tpu")``: switched to
capturable mode, so their step counters are tensors on the device (traced inputs) rather
than Python numbers baked into the trace; ``torchjax.uninstall()`` switches them back
(Note [Process-wide changes]).

A capturable optimizer keeps all its state on the parameters' device, and its step
assumes so: a state made by a non-capturable step (the counter ``step`` and NAdam's
``mu_product`` on CPU) moves to the device with the switch, or the step would mix
devices (``mu_product *= mu``) and torch's own capturable check refuses it.
"""

from __future__ import annotations

import weakref

import torch

from torchjax import _patches
from torchjax.tensor._tensor import JaxTensor

# Optimizers switched by make_capturable -> the param groups it switched and the state
# entries it moved to the device (weakly held), put back by torchjax.uninstall().
_CAPTURABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def make_capturable(opt) -> bool:
    """Switch ``opt`` to capturable mode (its state on the device). True if changed."""
    changed = []
    for group in opt.param_groups:
        if "capturable" in group and not group["capturable"]:
            group["capturable"] = True
            changed.append(group)
    if not changed:
        return False
    groups, moved = _CAPTURABLE.setdefault(opt, ([], []))
    groups.extend(changed)
    for group in changed:
        for p in group["params"]:
            state = opt.state.get(p, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, JaxTensor):
                    state[key] = value.to(p.device)
                    moved.append((p, key))
    _patches.record(
        "optimizer capturable=True under jit",
        why="the step counter must be a traced input, not a constant of the trace",
        package="torch",
        written_for="2.13",
        undo=_undo_capturable,
    )
    return True


def _undo_capturable() -> None:
    """Groups switched by make_capturable back to capturable=False, with their step
    counters and the state it moved (NAdam's mu_product) back on CPU, where a
    non-capturable torch optimizer keeps them."""
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
