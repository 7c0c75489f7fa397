"""Optimizer state made by a compiled function's first call.

Note [Optimizer state made in a first call]
torch's optimizers make their state in their first ``step()``: Adam's moments and step
count, as zeros, which the same step then updates. A compiled train step's first call
therefore made state: its program returned that state, and the next call, whose state
now holds it as inputs, traced and compiled again (a 1.1B Llama's first two steps on a
v5e: 75.8 s and 74.2 s, against pure JAX's 50.3 s for its first). When every storage a
first trace made and kept is the state of one of the optimizers in ``_FILLS_ONLY``,
and each began in that trace as a fill (a constant: zeros, a full), the call
puts those storages back to their fills, the values the step made them with, and traces
again with them as state: the program every later call runs, now from the first call
on. The first trace is never compiled. The values are the same: those optimizers'
``_init_group`` only fills state that the step then updates the same way in every step
(read in torch 2.13), so a step given the fresh state computes what the step that made
it did. Anything else keeps the path before (the first call compiles the program that
makes the state): SGD, whose first step sets its momentum buffer to the gradient where
later steps blend (the fused path makes that buffer with ``empty_like``, a fill, so the
fill test alone would not catch it), the other torch optimizers (not read), a subclass
or an optimizer of the user's (which may treat a first step differently), gradients a
step keeps, or a tensor the function stores elsewhere. The second trace runs the
function's Python again, so the path is also left when the first trace changed what the
optimizers read: a gradient set to None or replaced (``zero_grad()`` inside a step whose
gradients come from outside: the second trace would find none and skip the update) or a
hyperparameter. ``Jitted.trace`` (trace without
running) keeps it too: it must not leave an optimizer with state no step made.
"""

from __future__ import annotations

import torch

from torchjax.tensor._fills import refill
from torchjax.tensor._tensor import JaxTensor

# Exact classes whose first step only fills state that every step updates alike.
_FILLS_ONLY = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
)


def first_state(created, made: dict, optimizers) -> list | None:
    """(storage, fill) of each storage in ``created`` when all of them are state of the
    ``optimizers`` (each of a class in ``_FILLS_ONLY``) and began as fills in the trace
    (``made``: what ``fills_traced`` yielded); else None (Note [Optimizer state made in
    a first call])."""
    if not created or not optimizers or any(type(o) not in _FILLS_ONLY for o in optimizers):
        return None
    state = set()
    for opt in optimizers:
        for entry in opt.state.values():
            for value in entry.values():
                if isinstance(value, JaxTensor):
                    state.add(id(value._storage))
    out = []
    for storage in created:
        born = made.get(id(storage))
        if born is None or id(storage) not in state:
            return None
        out.append((storage, born[2]))
    return out


def put_back(first: list) -> None:
    """Give each storage of ``first_state`` its fill again: the state a step makes."""
    for storage, lazy in first:
        refill(storage, lazy)


def before_trace(optimizers) -> list:
    """What the optimizers read that a trace may change: each parameter's gradient and
    each group's hyperparameters, as objects."""
    seen = []
    for opt in optimizers:
        for group in opt.param_groups:
            hyper = [(k, v) for k, v in group.items() if k != "params"]
            seen.append((group, hyper, [(p, p.grad) for p in group["params"]]))
    return seen


def unchanged(seen: list) -> bool:
    """Whether a trace left every gradient and hyperparameter of ``before_trace`` as the
    same object (Note [Optimizer state made in a first call])."""
    for group, hyper, grads in seen:
        if group.keys() != {"params", *(k for k, _ in hyper)}:
            return False
        if any(group[k] is not v for k, v in hyper) or any(p.grad is not g for p, g in grads):
            return False
    return True
