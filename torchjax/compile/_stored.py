"""Tensors a torchjax.jit trace stores in module attributes.

Note [Tensors a trace stores in module attributes]
A forward that keeps what it computed on its module (``self.cache = x * 2``,
``self.history.append(y)``, ``self.stats = {"h": h}``) stored a tensor of the trace: after
the call the attribute held a JAX tracer, and its next use failed far from the cause.
Note [Tensors kept as plain module attributes] (torchjax/compile/_state.py) looks for
such attributes before a trace only. So after the trace the plain attributes of the
modules the state walk reached are searched (through lists, tuples, dicts, sets and
plain objects) for what the trace made, and those found are remembered too: the tensors
they hold now are state the trace created, outputs of the program whose values the call puts
into them (as into a buffer registered in forward), so after the call the attribute
holds the values eager leaves there, as torch.compile replays such a mutation with its
graph's outputs. A call that creates state traces again on the next call: a tensor
reassigned on every call, or a list that grows, is new state each time (the
``RetraceWarning`` says so). The stored tensor is not the one the call returns (a
program's outputs are new tensors), though both hold the same values; an argument
stored as it is (``self.last = x``) holds the argument's values, not the caller's
tensor.

Two things cannot leave the program and are refused when the trace ends, naming the
attribute (the references the trace changed are put back: Note [State after a trace
whose program does not run] in torchjax/compile/_rollback.py):
- a tensor with autograd history (computed from parameters with grad mode on): after the
  call it holds values only, so a loss built from it outside the call would miss its
  gradient without a word. Store its ``.detach()`` for the values, or return it from the
  function for a gradient to flow through it;
- a jax array of the trace (``torchjax.to_jax`` of a traced tensor), which is a tracer:
  store the tensor instead.
"""

from __future__ import annotations

import functools
import types
import weakref

import jax
import torch

from torchjax.compile._state import _LEAF_TYPES, REGISTRIES
from torchjax.tensor._tensor import JaxTensor

_HISTORY = (
    "torchjax.jit({}): the function stored a tensor with autograd history in {} "
    "({}); a compiled call gives it back as values only, so a backward through that "
    "attribute after the call would not reach what it was computed from. Store "
    "tensor.detach() there to keep its values (or call under torch.no_grad()), or return "
    "the tensor from the function for its gradient to flow (Note [Tensors a trace stores "
    "in module attributes])."
)

_ARRAY = (
    "torchjax.jit({}): the function stored a jax array of its trace in {} (a jax tracer, "
    "e.g. torchjax.to_jax of a tensor computed inside it), which cannot leave the "
    "compiled program. Store the tensor instead: a tensor stored on a module gets the "
    "call's values (Note [Tensors a trace stores in module attributes])."
)

_MAX_DEPTH = 4
_CONTAINERS = (list, tuple, dict, set, frozenset)
# Searched no further: values, classes, functions, modules (their state is walked as
# state), CPU tensors.
_NOT_SEARCHED = (
    *_LEAF_TYPES, types.FunctionType, types.MethodType, functools.partial, torch.nn.Module,
    torch.Tensor,
)  # fmt: skip


def remember_stored(modules, attributes) -> None:
    """Add to ``attributes`` (a compiled function's remembered plain attributes, (weak
    reference to the module, name) by (id(module), name)) each plain attribute of
    ``modules`` that holds a tensor or jax array of the running trace."""
    for mod in modules:
        for name, value in vars(mod).items():
            if name in REGISTRIES:
                continue
            known = attributes.get((id(mod), name))
            if known is not None and known[0]() is mod:
                continue
            if any(map(_traced, _leaves(value))):
                attributes[id(mod), name] = (weakref.ref(mod), name)


def stored_refusal(fn_name: str, attributes, created) -> RuntimeError | None:
    """The error for a remembered attribute holding what cannot leave the program, or
    None; ``created``: the storages the trace made that the program fills."""
    made = {id(s) for s in created}
    for ref, name in list(attributes.values()):
        mod = ref()
        if mod is None:
            continue
        where = f"{type(mod).__name__}.{name}"
        for v in _leaves(vars(mod).get(name)):
            if isinstance(v, jax.core.Tracer):
                return RuntimeError(_ARRAY.format(fn_name, where))
            if v.grad_fn is not None and id(v._storage) in made:
                what = f"shape {tuple(v.shape)}, {v.dtype}, grad_fn {v.grad_fn.name()}"
                return RuntimeError(_HISTORY.format(fn_name, where, what))
    return None


def _traced(v) -> bool:
    if isinstance(v, jax.core.Tracer):
        return True
    storage = v._storage
    return storage.lazy is None and isinstance(storage.arr, jax.core.Tracer)


def _leaves(value, depth: int = 0, seen=None) -> list:
    """The tpu tensors and jax tracers in ``value``: itself, or inside its containers
    and plain objects, ``_MAX_DEPTH`` deep."""
    if isinstance(value, (JaxTensor, jax.core.Tracer)):
        return [value]
    if depth >= _MAX_DEPTH or isinstance(value, _NOT_SEARCHED):
        return []
    seen = set() if seen is None else seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, _CONTAINERS):
        items = value
    elif hasattr(value, "__dict__"):
        items = vars(value).values()
    else:
        return []
    return [leaf for v in items for leaf in _leaves(v, depth + 1, seen)]
