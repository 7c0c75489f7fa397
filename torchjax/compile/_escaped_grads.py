"""Gradients a compiled function's backward would leave on tensors outside its state.

Note [Gradients that escape a trace]
A leaf requiring grad that a ``torchjax.jit`` function reaches without its state walk
seeing it (through a ``functools.partial``, a closure of a closure, a list of lambdas:
Note [State of a jitted function] in torchjax/compile/_state.py) is a constant of the
program. A ``backward()`` inside the function still accumulates into it, and where its
``.grad`` was None the engine assigned it the trace's value: the gradient was lost and
the tensor kept a tracer, so every later read of ``.grad`` failed with a misleading
error. (A ``.grad`` that already held a tensor is written in place, which Note [Writes
that escape a trace] in torchjax/tensor/_storage.py already refuses.) So while a
function traces, every backward it calls notes the leaves it will accumulate into
(``inputs=``, or the graph's AccumulateGrad nodes) whose storage was made before the
trace and holds no tracer, with their ``.grad``; after the trace a changed ``.grad`` is
put back and the call refused with an error naming the tensor and what to do, as for an
escaping write. ``torch.autograd.grad`` accumulates nothing and is not watched. (The
``.grad``s of leaves the walk does see are put back when the trace fails: Note [State
after a trace whose program does not run] in torchjax/compile/_rollback.py.)
"""

from __future__ import annotations

import contextlib

import jax

from torchjax.device._engine_queues import BEFORE_BACKWARD
from torchjax.tensor._storage import made_before_watch
from torchjax.tensor._tensor import JaxTensor


def _constant(t) -> bool:
    if type(t) is not JaxTensor or not t.requires_grad or not t.is_leaf:
        return False
    storage = t._storage
    return made_before_watch(storage) and not isinstance(storage.arr, jax.core.Tracer)


def _leaves(roots) -> list:
    """The leaves a backward from ``roots`` accumulates into."""
    out, seen = [], set()
    nodes = []
    for r in roots:
        if isinstance(r, JaxTensor):
            if r.grad_fn is None:
                out.append(r)
            else:
                nodes.append(r.grad_fn)
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None:
            out.append(variable)
        nodes.extend(n for n, _ in node.next_functions)
    return out


@contextlib.contextmanager
def grads_watched():
    """Within the block (inside ``escapes_watched``), this thread's backward calls note
    the constant leaves they accumulate into; yields the list of (tensor, its ``.grad``
    before) to check with ``restore_grads``."""
    found = []

    def observe(args, kwargs):
        if not kwargs.get("accumulate_grad", True):
            return
        inputs = args[3] if len(args) > 3 else kwargs.get("inputs")
        leaves = list(inputs) if inputs else _leaves(args[0] if args else ())
        for t in leaves:
            if _constant(t) and not any(t is u for u, _ in found):
                found.append((t, t.grad))

    previous = getattr(BEFORE_BACKWARD, "fn", None)
    BEFORE_BACKWARD.fn = observe
    try:
        yield found
    finally:
        BEFORE_BACKWARD.fn = previous


def restore_grads(found) -> JaxTensor | None:
    """Put back every noted ``.grad`` the trace changed; the first such tensor."""
    first = None
    for t, grad in found:
        if t.grad is not grad:
            t.grad = grad
            first = first if first is not None else t
    return first
