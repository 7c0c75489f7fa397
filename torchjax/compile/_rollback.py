"""Putting back what a torchjax.jit trace changed when its program never runs.

Note [State after a trace whose program does not run]
A trace binds tracers into the state's storages (Note [State of a jitted function] in
torchjax/compile/_state.py) and the binding gives every storage its own array back when
it ends, whatever happened (torchjax/tensor/_binding.py): the values of parameters,
buffers, existing ``.grad``s and optimizer state come through any trace unchanged. What
the traced Python changed in the objects holding that state is no storage: a
``backward()`` gives a parameter whose ``.grad`` was None a new tensor, an optimizer's
first ``step()`` puts new tensors into ``optimizer.state``, ``GradScaler.scale`` makes
its scale, ``zero_grad()`` sets ``.grad``s to None. Those new tensors hold tracers; the
program's first run fills them (created state, ``Entry.write_back`` in
torchjax/compile/_entry.py). Where the program never ran they stayed, and the next eager
backward or compiled call failed with a leaked-tracer error far from the cause: after
a trace that raised (an error in the user's code, ``.item()`` of a traced value as in
``GradScaler.step``), one refused after tracing (Note [Writes that escape a trace],
Note [Learning rates assigned while tracing]), a first compile or run that failed (out
of memory), a ``repeat`` refused for its created state, ``Jitted.trace`` (which never
runs the program), ``torchjax.export`` (likewise), and a trace set aside for eager
Python (Note [Arguments that share memory]). Note [Gradients that escape a trace] puts
back the ``.grad``s of leaves outside the walk; this is its counterpart for what the
walk sees.

So before a call traces, a second walk of its roots (``Before``, the same walk) notes
every reference it reads on its way to the state: each leaf's ``.grad`` (tensor
arguments too), each module's parameters, buffers and submodules, each optimizer's
``state`` (every entry's contents) and ``param_groups`` (every group's contents), the
items of each list, dict and set, the attributes of each plain object, the closure cells
and the named globals of each function, and each module's plain attributes (Note [Tensors
kept as plain module attributes]) and what they hold. Until the call's
program has written its state back, an exception puts back, before it propagates
unchanged, each of those the trace changed whose value before or after reaches a tpu
tensor; a program that will not run has them put back at once. With the storages'
values, the state is as it was before the call: the ``.grad``s the trace set or cleared,
the entries an optimizer made (removed), a GradScaler's scale and its record of the
optimizers it unscaled. Values that reach no tpu tensor (a list of the shapes traced, a
counter, an LR scheduler's epoch) keep what the Python did, as ``Jitted.trace``
promises and as in eager.
"""

from __future__ import annotations

import contextlib
import functools
import types

import jax
import torch

from torchjax.compile._state import (
    _LEAF_TYPES,
    _MAX_DEPTH,
    REGISTRIES,
    StateWalk,
    _global_names,
)
from torchjax.tensor._tensor import JaxTensor

_MISSING = object()
# What ``StateWalk.add`` reads no container of its own from (or reads in a method
# noted below: modules, optimizers, functions).
_NOT_CONTAINERS = (
    *_LEAF_TYPES, torch.Tensor, torch.nn.Module, torch.optim.Optimizer, types.MethodType,
    types.FunctionType, functools.partial, tuple, frozenset,
)  # fmt: skip


class Before(StateWalk):
    """The references to a call's state as they were before its trace (Note [State after
    a trace whose program does not run]): its state walk, noting what it reads."""

    def __init__(self, call):
        super().__init__()
        # The call whose write-back makes the trace's changes the program's (a retrace
        # with the state made in a first call replaces it).
        self.call = call
        self.grads = []  # (leaf, its .grad)
        self.whole = []  # (dict, list or set, a copy)
        self.keys = []  # (dict, key, value or _MISSING): globals, module attributes
        self.cells = []  # (closure cell, contents or _MISSING)
        for r in call.roots:
            self.add(r)
        self.add_attributes(call.jitted.attributes)
        for t in call.tensors:
            self.add_tensor(t)

    def add_tensor(self, t) -> None:
        # A non-leaf keeps no .grad (reading it warns); leaves hold what backward fills.
        if isinstance(t, torch.Tensor) and id(t) not in self._seen_tensor and t.is_leaf:
            self.grads.append((t, t.grad))
        super().add_tensor(t)

    def add_module(self, m) -> None:
        first = len(self.modules)
        super().add_module(m)
        for mod in self.modules[first:]:
            self._whole(mod._parameters, mod._buffers, mod._modules)
            # Its plain attributes and what they hold, which a trace may set (Note
            # [Tensors a trace stores in module attributes] in _stored.py).
            self._whole(vars(mod))
            for name, v in list(vars(mod).items()):
                if name not in REGISTRIES:
                    self.add(v, 1)

    def add_optimizer(self, opt) -> None:
        self._whole(opt.state, *opt.state.values(), opt.param_groups, *opt.param_groups)
        super().add_optimizer(opt)

    def add(self, obj, depth: int = 0) -> None:
        if not (
            isinstance(obj, _NOT_CONTAINERS) or depth > _MAX_DEPTH or id(obj) in self._seen_obj
        ):
            if isinstance(obj, (list, dict, set)):
                self._whole(obj)
            elif hasattr(obj, "__dict__"):
                self._whole(vars(obj))
        super().add(obj, depth)

    def add_function(self, fn, depth: int = 0) -> None:
        for cell in fn.__closure__ or ():
            try:
                self.cells.append((cell, cell.cell_contents))
            except ValueError:  # an empty cell
                self.cells.append((cell, _MISSING))
        g = fn.__globals__
        self.keys += [(g, name, g[name]) for name in _global_names(fn.__code__) if name in g]
        super().add_function(fn, depth)

    def add_attributes(self, attributes) -> None:
        for ref, name in attributes.values():
            mod = ref()
            if mod is not None:  # one attribute, not the module's whole __dict__
                self.keys.append((vars(mod), name, vars(mod).get(name, _MISSING)))
        super().add_attributes(attributes)

    def _whole(self, *containers) -> None:
        # Copies of the builtin type: a subclass's copy() may build more than a container.
        for c in containers:
            base = dict if isinstance(c, dict) else list if isinstance(c, list) else set
            self.whole.append((c, base(c)))

    def put_back(self) -> None:
        """Give every noted reference that reached state, or reaches it now, what it held
        before the trace. Through the builtin types' own methods: a subclass's
        (``ModelOutput`` refuses ``update``) could raise over the exception being
        propagated."""
        for c, old in self.whole:
            if isinstance(c, dict):
                _put_back_items(c, old)
            elif len(c) != len(old) or any(a is not b for a, b in zip(c, old)):
                ids = {id(v) for v in old}
                changed = [v for v in c if id(v) not in ids]
                ids = {id(v) for v in c}
                changed += [v for v in old if id(v) not in ids]
                if any(map(_holds_state, changed)):
                    if isinstance(c, list):
                        list.__setitem__(c, slice(None), old)
                    else:
                        set.clear(c)
                        set.update(c, old)
        for d, name, value in self.keys:
            now = d.get(name, _MISSING)
            if now is not value and (_holds_state(value) or _holds_state(now)):
                if value is _MISSING:
                    dict.pop(d, name)
                else:
                    dict.__setitem__(d, name, value)
        for cell, value in self.cells:
            try:
                now = cell.cell_contents
            except ValueError:  # emptied
                now = _MISSING
            if now is value or not (_holds_state(value) or _holds_state(now)):
                continue
            if value is _MISSING:
                del cell.cell_contents
            else:
                cell.cell_contents = value
        for t, grad in self.grads:
            now = t.grad
            if now is not grad and (_holds_state(grad) or _holds_state(now)):
                t.grad = grad


def _holds_state(value) -> bool:
    """Whether the walk finds a tpu tensor in ``value``, or it is (or a list, tuple or
    dict holds) a jax tracer a trace left."""
    if isinstance(value, (JaxTensor, jax.core.Tracer)):
        return True
    if value is _MISSING or isinstance(value, _LEAF_TYPES):
        return False
    if isinstance(value, (list, tuple, dict)) and any(
        isinstance(v, jax.core.Tracer)
        for v in (value.values() if isinstance(value, dict) else value)
    ):
        return True
    walk = StateWalk(grads=False)
    walk.add(value)
    return bool(walk.storages)


def _put_back_items(d: dict, old: dict) -> None:
    """Put back the items of ``d`` that reached state before the trace or reach it now,
    in their old order."""
    back = {
        k
        for k in d.keys() | old.keys()
        if d.get(k, _MISSING) is not old.get(k, _MISSING)
        and (_holds_state(d.get(k, _MISSING)) or _holds_state(old.get(k, _MISSING)))
    }
    if not back:
        return
    items = [(k, old[k] if k in back else d[k]) for k in old if k in back or k in d]
    items += [(k, v) for k, v in d.items() if k not in old and k not in back]
    dict.clear(d)  # the same object: an optimizer's state is a defaultdict
    dict.update(d, items)


@contextlib.contextmanager
def put_back_on_failure(call):
    """Within the block, which traces ``call`` and may run the new program: an exception
    raised before the program wrote ``call``'s state back puts the references back
    (Note [State after a trace whose program does not run]). Yields the ``Before``."""
    before = Before(call)
    try:
        yield before
    except BaseException:
        if not before.call.written_back:
            before.put_back()
        raise
