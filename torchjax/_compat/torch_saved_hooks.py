"""Private PyTorch API of autograd's saved-tensor hooks: this thread's stack of default
hooks and the process-wide switch that turns them off (part of torchjax/_compat, split
from torch.py by subject)."""

from __future__ import annotations

import functools

import torch

_DISABLE = "_saved_tensors_hooks_disable"
_ENABLE = "_saved_tensors_hooks_enable"


def top_saved_tensors_default_hooks():
    """The innermost ``(pack_hook, unpack_hook)`` pair on this thread's stack of
    saved-tensor default hooks, as pushed (the same objects each time), or None when the
    stack is empty. Dynamo's "tracing" flag, which hides the stack from autograd while
    Dynamo traces, is ignored: this is the stack itself (torch._C, private)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def pop_saved_tensors_default_hooks() -> None:
    """What ``torch.autograd.graph.saved_tensors_hooks.__exit__`` does: the innermost
    pair leaves this thread's stack (torch._C, private)."""
    torch._C._autograd._pop_saved_tensors_default_hooks()


def install_saved_tensors_hooks_switch(before_disable, after_enable) -> None:
    """Call ``before_disable(fail_if_non_empty)`` before torch turns saved-tensor hooks
    off and ``after_enable()`` after it turns them on again; ``before_disable`` returns
    whether it changed the stack, and ``after_enable`` is then called at once if turning
    them off raises.

    torch 2.13 has one switch for both: ``torch._C._autograd._saved_tensors_hooks_disable
    (message, fail_if_non_empty=True)``, which raises when ``fail_if_non_empty`` and this
    thread's stack is not empty, and ``_saved_tensors_hooks_enable()``.
    ``torch.autograd.graph.disable_saved_tensors_hooks`` (the context that ``torch.func``'s
    grad, vjp, jacrev and hessian enter) and Dynamo (which records the same calls as
    nodes of its graphs) look both up on ``torch._C._autograd`` when they call them, so
    both names are replaced there (Note [Process-wide changes], undone by
    ``torchjax.uninstall()``)."""
    from torchjax import _patches

    if _patches.is_recorded("torch._C._autograd._saved_tensors_hooks_disable and _enable"):
        return
    autograd = torch._C._autograd
    disable, enable = getattr(autograd, _DISABLE), getattr(autograd, _ENABLE)

    @functools.wraps(disable)
    def _saved_tensors_hooks_disable(message, fail_if_non_empty=True):
        changed = before_disable(fail_if_non_empty)
        try:
            disable(message, fail_if_non_empty)
        except RuntimeError:
            if changed:
                after_enable()
            raise

    @functools.wraps(enable)
    def _saved_tensors_hooks_enable():
        enable()
        after_enable()

    _patches.replace_attrs(
        autograd,
        {_DISABLE: _saved_tensors_hooks_disable, _ENABLE: _saved_tensors_hooks_enable},
        name="torch._C._autograd._saved_tensors_hooks_disable and _enable",
        why="torch.func transforms inside a compiled program see no hooks of its trace",
        package="torch",
        written_for="2.13",
    )
