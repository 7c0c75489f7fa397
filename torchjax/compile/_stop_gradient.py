"""Where torch's autograd stops, the compiled VJP stops too.

Note [Stopped gradients in compiled programs]
Where torch's graph of the trace cannot be replayed (Note [The compiled VJP is torch's
autograd] in torchjax/compile/_autograd.py), a torchjax.jit program's ``backward()`` is
``jax.vjp`` of the traced program. jax differentiates every path from an input to an output;
torch's autograd only the paths through tensors that require grad. So without more, a
``detach()`` (``y - y.detach()``), a ``torch.no_grad()`` block or an argument that does
not require grad inside the function gave gradients CPU does not give: silently wrong.
While a program is traced, every op's tensor arguments that do not require grad are
read through ``lax.stop_gradient`` (only for ops called with grad mode on, where torch
records a graph, and only at the op the traced code calls: inside an op's handler,
below autograd, intermediates never require grad and say nothing about the graph):
the stand-in views the same elements of a storage whose array is the stopped root
array, with the argument's size, stride and offset, so
values, layouts and the forward program are unchanged (``stop_gradient`` is the
identity), and the VJP is zero through exactly the tensors torch's graph leaves out.
Not replaced: arguments the op writes or returns a view of (an alias in the op's
schema: ``add_``'s self, ``t``'s input), ``_unsafe_view``'s input (it shares its
storage) and ``set_``'s source (self takes its storage; set to a stand-in, later
writes through self reached a copy), so every write and view still reaches the tensor
itself; constants (no
tracer), and dtype or conj views (their stored array is not read directly), which
keep their value. A few ops write an argument their schema does not mark
(``native_batch_norm``'s running stats): a stand-in written by the op hands its new
array to the tensor's own storage after the op. The stand-in storage is a ``StandIn``
whose ``root`` is the tensor's storage, so the op's checks of memory see the tensor's:
``x[1:].copy_(x[:-1])`` or ``torch.add(x[:-1], 1, out=x[1:])`` is refused for partial
overlap as in eager (torchjax/ops/writeback.py), also when ``x`` is an argument or an
intermediate of the trace. The hook is per thread and only while torchjax.jit traces.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import torch
from jax import lax

from torchjax.tensor import _tensor
from torchjax.tensor._storage import StandIn, Storage
from torchjax.tensor._tensor import JaxTensor, make

_SHARES_STORAGE = frozenset({"_unsafe_view", "set_"})


@functools.lru_cache(maxsize=None)
def _aliased_positions(func) -> frozenset:
    """Positions and names of ``func``'s arguments that it writes or views."""
    if func._opname in _SHARES_STORAGE:
        return frozenset(range(len(func._schema.arguments)))
    out = set()
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None:
            out.add(i)
            out.add(a.name)
    return frozenset(out)


def _stopped(t, pairs):
    if t.__class__ is not JaxTensor or t.requires_grad:
        return t
    s = t._storage
    if s.__class__ is not Storage or s.lazy is not None:
        return t
    arr = s.arr
    if not isinstance(arr, jax.core.Tracer):
        return t
    stand_in = StandIn(lax.stop_gradient(arr), s)
    pairs.append((s, stand_in))
    return make(stand_in, t._size, t._stride, t._offset, t.dtype, t._device_index)


def _stopped_arg(x, pairs):
    if x.__class__ is JaxTensor:
        return _stopped(x, pairs)
    if x.__class__ is list or x.__class__ is tuple:
        return x.__class__(_stopped(y, pairs) if y.__class__ is JaxTensor else y for y in x)
    return x


def _hook(func, args, kwargs):
    if not torch.is_grad_enabled():
        # No graph is recorded (a no_grad block, a custom Function's forward, the
        # backward pass): torch differentiates none of it, nor its arguments here.
        return args, kwargs, None
    _tensor.HOOK.fn = None  # the op's own nested ops see tensors below autograd
    aliased = _aliased_positions(func)
    pairs = []
    args = tuple(a if i in aliased else _stopped_arg(a, pairs) for i, a in enumerate(args))
    if kwargs:
        kwargs = {k: v if k in aliased else _stopped_arg(v, pairs) for k, v in kwargs.items()}
    return args, kwargs, pairs


def _after(pairs):
    """After the op: the hook back on; a stand-in the op wrote (an unmarked write)
    hands its array to the tensor's storage."""
    _tensor.HOOK.fn = _hook
    for storage, stand_in in pairs:
        if stand_in.version:
            storage.replace(stand_in.arr)


@contextlib.contextmanager
def stopping():
    """While tracing a program: tensors that do not require grad are stopped."""
    local = _tensor.HOOK
    previous = getattr(local, "fn", None), getattr(local, "after", None)
    local.fn, local.after = _hook, _after
    _tensor.ARG_HOOKS[0] += 1
    try:
        yield
    finally:
        _tensor.ARG_HOOKS[0] -= 1
        local.fn, local.after = previous
