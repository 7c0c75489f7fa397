"""``torch.func`` transforms inside compiled programs.

Note [torch.func transforms in compiled programs]
``torch.func.grad``, ``vjp``, ``jacrev`` and ``hessian`` run their function with
torch's saved-tensor hooks switched off (``disable_saved_tensors_hooks``), and switching
them off raises "torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor
hooks" when any hook is on this thread's stack. A torchjax.jit trace with grad mode on
keeps hooks of its own there for the whole function (Note [The compiled VJP is torch's
autograd] in torchjax/compile/_autograd.py), so every such transform failed inside a
compiled function, under ``torch.compile(backend="tpu")`` too, where Dynamo records the
switch as nodes of its graph. In eager the stack is empty there.

So while a trace runs, turning the hooks off with the trace's own hooks innermost takes
those hooks off the stack first, and turning them on again puts them back: the
transform sees the stack eager would show it, and torch's refusal stays for hooks the
user pushed (as in eager, ``torch.func.grad`` under a user's ``saved_tensors_hooks`` or
non-reentrant checkpointing raises). Tensors that autograd saves meanwhile for the
graph outside the transform (where the transformed function reads tensors requiring
grad, so a ``backward()`` of the result reaches them) are saved as eager saves them,
tracers of the forward trace with no handle: that graph cannot be replayed outside its
forward, and the program's VJP is ``jax.vjp`` of the forward (Note [Stopped gradients
in compiled programs] in torchjax/compile/_stop_gradient.py), as for any graph that
reaches a forward value. The transform's own inner graph is torch's, run while
tracing, as in eager.

Why not keep the trace's hooks on inside the transform (torch's switch takes
``fail_if_non_empty=False``): they would then pack the transform's own saved tensors,
functorch's level-wrapped tensors, which torch says its transforms do not support; off
the stack, the transform runs exactly as in eager. Why the switch and not
``disable_saved_tensors_hooks`` itself: Dynamo recognises that context manager by
identity, in a table made when Dynamo is imported (torch/_dynamo/variables/torch.py),
which may be before torchjax; a replacement it does not know would be traced into, a
skipped torchjax frame inside the transform, for CPU code too. The switch is what both
the context manager and Dynamo's graphs call. And why one change for both entry
points: ``torchjax.jit`` runs the user's Python, functorch's included, with no graph to
rewrite.

A Dynamo graph that raises between its two switch nodes never turns the hooks on again:
``saved_tensors_hooks_state_kept`` (torchjax/_compat/torch.py) turns the switch back as
the function ends, which puts the trace's hooks back too, and ``suspendable`` puts them
back if they are still off when they leave the stack, so torch pops its own pair.

The switch is a process-wide change (Note [Process-wide changes]); outside a trace, or
with another hook innermost, it only calls torch's function.
"""

from __future__ import annotations

import contextlib
import threading

from torchjax._compat.torch import push_saved_tensors_default_hooks
from torchjax._compat.torch_saved_hooks import (
    install_saved_tensors_hooks_switch,
    pop_saved_tensors_default_hooks,
    top_saved_tensors_default_hooks,
)

_local = threading.local()


class _Frame:
    """The hooks one trace pushed, and whether they are off the stack now."""

    __slots__ = ("hooks", "suspended")

    def __init__(self, hooks):
        self.hooks, self.suspended = hooks, False


def _innermost():
    frames = getattr(_local, "frames", None)
    return frames[-1] if frames else None


@contextlib.contextmanager
def suspendable(hooks):
    """Enter ``hooks`` (a ``saved_tensors_hooks`` context of a trace); while inside,
    torch's switch takes them off the stack and puts them back."""
    with hooks:
        frame = _Frame(top_saved_tensors_default_hooks())
        frames = getattr(_local, "frames", None)
        if frames is None:
            frames = _local.frames = []
        frames.append(frame)
        try:
            yield
        finally:
            frames.pop()
            if frame.suspended:  # the switch was never turned on again
                push_saved_tensors_default_hooks(*frame.hooks)


def _before_disable(fail_if_non_empty: bool) -> bool:
    frame = _innermost()
    if frame is None or frame.suspended or not fail_if_non_empty:
        return False
    top = top_saved_tensors_default_hooks()
    if top is None or top[0] is not frame.hooks[0]:
        return False  # another hook is innermost: torch refuses as in eager
    pop_saved_tensors_default_hooks()
    frame.suspended = True
    return True


def _after_enable() -> None:
    frame = _innermost()
    if frame is not None and frame.suspended:
        frame.suspended = False
        push_saved_tensors_default_hooks(*frame.hooks)


def install() -> None:
    install_saved_tensors_hooks_switch(_before_disable, _after_enable)
