"""Optimizers under ``torchjax.jit``: switched to capturable mode, so their step counters
are tensors on the device (traced inputs) rather than Python numbers baked into the
trace; ``torchjax.uninstall()`` switches them back (Note [Process-wide changes]).
"""

from __future__ import annotations

import weakref

import torch

from torchjax import _patches
from torchjax.tensor._tensor import JaxTensor

# Optimizers switched by make_capturable -> the param groups it switched (weakly held),
# put back by torchjax.uninstall() (Note [Process-wide changes]).
_CAPTURABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def make_capturable(opt) -> bool:
    """Switch ``opt`` to capturable mode (step counters on the device). True if changed."""
    changed = []
    for group in opt.param_groups:
        if "capturable" in group and not group["capturable"]:
            group["capturable"] = True
            changed.append(group)
    if changed:
        for p, st in opt.state.items():
            step = st.get("step")
            if isinstance(step, torch.Tensor) and not isinstance(step, JaxTensor):
                st["step"] = step.to(p.device)
        _CAPTURABLE.setdefault(opt, []).extend(changed)
        _patches.record(
            "optimizer capturable=True under jit",
            why="the step counter must be a traced input, not a constant of the trace",
            package="torch",
            written_for="2.13",
            undo=_undo_capturable,
        )
    return bool(changed)


def _undo_capturable() -> None:
    """Groups switched by make_capturable back to capturable=False, with their step
    counters on CPU, where a non-capturable torch optimizer keeps them."""
    for opt, groups in list(_CAPTURABLE.items()):
        for group in groups:
            group["capturable"] = False
            for p in group["params"]:
                step = opt.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    opt.state[p]["step"] = step.to("cpu")
    _CAPTURABLE.clear()
