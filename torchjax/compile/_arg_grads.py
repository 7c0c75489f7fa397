"""The gradients a compiled function's in-trace ``backward()`` gives its tensor
arguments."""

from __future__ import annotations

import torch

from torchjax.compile._aliases import root


# Note [Gradients of arguments]
# ``loss.backward()`` inside the function fills, in eager, the ``.grad`` of every leaf
# argument that requires grad. The trace sees each argument as a fresh tensor over a
# tracer, so the backward filled that stand-in's ``.grad`` and the caller's argument kept
# None: a silent loss of the gradient. An argument's existing ``.grad`` is state of the
# call of a function (a root of its walk, as parameters' ``.grad`` are; a module's
# forward calls no backward) and is the stand-in's ``.grad`` while tracing, so
# accumulation writes it (written back as any state); a ``.grad`` the backward creates
# is given to the argument after the trace and made a created output of the program
# (filled after each call, as a parameter's new ``.grad`` is). A ``.grad`` accumulated
# out of place (a new tensor) is copied into the existing one.
def argument_grads(tensors, leaves) -> list:
    """Give each leaf argument requiring grad the ``.grad`` its stand-in got while
    tracing (Note [Gradients of arguments]); the storages of those newly created."""
    created = []
    for t, w in zip(tensors, leaves):
        if not (t.requires_grad and t.is_leaf) or w.grad is None or w.grad is t.grad:
            continue
        if t.grad is None:
            t.grad = w.grad
            created.append(root(w.grad))
        else:
            with torch.no_grad():
                t.grad.copy_(w.grad)
    return created
