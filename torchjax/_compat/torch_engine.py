"""Private PyTorch API of the autograd engine's entry from Python (part of
torchjax/_compat, split from torch.py by subject)."""

from __future__ import annotations

import functools

import torch

_ENTRY = "_engine_run_backward"


def install_backward_entry(wrapper) -> None:
    """Run every ``backward()`` and ``torch.autograd.grad`` through ``wrapper(original,
    *args, **kwargs)``, ``original`` being torch's function.

    torch 2.13 enters the C++ engine from ``torch.autograd.graph._engine_run_backward``,
    which ``torch.autograd`` imports under the same name and calls from ``backward`` and
    ``grad``; both names are replaced (Note [Process-wide changes], undone by
    ``torchjax.uninstall()``)."""
    from torchjax import _patches

    if _patches.is_recorded("torch.autograd.graph._engine_run_backward"):
        return
    original = getattr(torch.autograd.graph, _ENTRY)

    @functools.wraps(original)
    def run_backward(*args, **kwargs):
        return wrapper(original, *args, **kwargs)

    why = "tpu nodes run on the thread that calls backward (no tpu engine thread)"
    for owner, name in (
        (torch.autograd.graph, "torch.autograd.graph._engine_run_backward"),
        (torch.autograd, "torch.autograd._engine_run_backward"),
    ):
        _patches.replace_attr(
            owner, _ENTRY, run_backward, name=name, why=why, package="torch", written_for="2.13"
        )
