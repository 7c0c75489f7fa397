"""Private PyTorch API of ``torch.amp.GradScaler``'s step (part of torchjax/_compat,
split from torch.py by subject)."""

from __future__ import annotations

import functools

import torch

_NAME = "torch.amp.GradScaler._maybe_opt_step"


def install_scaler_step(step) -> None:
    """Route ``GradScaler._maybe_opt_step`` through ``step(original, scaler, optimizer,
    optimizer_state, *args, **kwargs)``.

    torch 2.13's ``GradScaler.step`` unscales the gradients (``unscale_``), then calls
    ``self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)``, which reads
    ``optimizer_state["found_inf_per_device"]`` (device -> 0-d float tensor, nonzero
    where a gradient was not finite) into Python and steps the optimizer when all are
    zero; it returns the step's result or None. The method is replaced on the class
    (Note [Process-wide changes], undone by ``torchjax.uninstall()``), so
    ``torch.cuda.amp.GradScaler`` and subclasses that keep it get it too."""
    from torchjax import _patches

    if _patches.is_recorded(_NAME):
        return
    cls = torch.amp.GradScaler
    original = cls.__dict__["_maybe_opt_step"]

    @functools.wraps(original)
    def maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return step(original, self, optimizer, optimizer_state, *args, **kwargs)

    _patches.replace_attr(
        cls,
        "_maybe_opt_step",
        maybe_opt_step,
        name=_NAME,
        why="a GradScaler step skips the optimizer on the device when traced, instead "
        "of reading whether the gradients are finite into Python",
        package="torch",
        written_for="2.13",
    )


def found_inf_per_device(optimizer_state) -> list:
    """The found-inf tensors ``GradScaler.unscale_`` recorded for one optimizer
    (``optimizer_state`` as ``_maybe_opt_step`` gets it; torch 2.13)."""
    return list(optimizer_state["found_inf_per_device"].values())
