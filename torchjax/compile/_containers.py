"""Lists and dicts a torchjax.jit function takes as arguments and changes.

Note [Containers a compiled function changes]
A call's arguments are a pytree (torchjax/compile/_call.py): its tensors are inputs of
the program, and the trace gives the function a copy of every list, tuple and dict
around them, holding the traced tensors. So ``out.append(y)``, ``d["k"] = y`` or
``lst[0] = y`` changed the copy: after the call the caller's list or dict was as before,
where eager Python (and torch.compile, which replays such a mutation after its graph)
leaves the change in it. A silent wrong result.

So while tracing, the lists, dicts and deques of the arguments are listed in pytree
order and their items noted (by identity); after the function returns, those whose items
changed are the call's container writes. The new contents of each join the function's
output as one more pytree: tensors the function made become outputs of the program
(with their autograd history, as a returned tensor: ``backward()`` through an appended
loss works), an argument tensor stays that argument (``lst[0], lst[1] = lst[1], lst[0]``
swaps the caller's tensors), a state tensor or a view is rebuilt as the view a returned
one is (Note [Aliased outputs of a compiled function] in _aliases.py), other values are
kept as the trace left them (part of the cache key: a number read from the container,
``d["n"] += 1``, is a static argument). A container of the arguments found among the new
contents, or returned (``return lst``), stands for the caller's own object when it
changed, so nesting and identity are eager's (an unchanged container returned is a new
one holding the same items, as before). After every call of the program, each changed container of
the caller's arguments gets its new contents in place (``lst[:] = ...``; a dict cleared
and refilled in the trace's order), so the objects the caller holds see the change.

Cost: a call whose trace changed no container pays nothing. One
that did lists the caller's containers again (one pytree walk) to write them. A list
that grows on every call (``history.append(loss)`` into the same list) changes the
arguments' structure, which is part of the cache key: each call traces again, with a
``RetraceWarning`` after ``warn_after``; pass a new list per call, or return the value
and append it outside.

What cannot be written back exactly runs another way:
- the same container passed twice (``f(lst, lst)``, or one list inside two dicts),
  where a change made through one must be seen through the other: the trace saw two
  copies, so a call whose arguments share a container the program changes runs the
  function eagerly instead (as Note [Arguments that share memory] does for tensors);
- a change to a dict subclass (``ModelOutput``) is written item by item through its own
  ``__setitem__``, which can add and replace keys but not remove or reorder them: a
  change that did is refused when traced, naming the argument, as is a change to a list
  subclass or to an object of another class registered as a pytree node (its attributes:
  torchjax.jit cannot put the new contents back through an interface it knows);
- a jax array of the trace (``torchjax.to_jax`` of a traced tensor), or an object
  holding a tensor the trace made, put into a container is refused: it cannot leave the
  program (store the tensor itself, or return the object's tensors);
- ``repeat`` and ``torchjax.export`` refuse a function that changes its containers:
  their programs return arrays only.
"""

from __future__ import annotations

import collections

import jax
import torch

from torchjax._compat.torch import pytree
from torchjax.compile._aliases import root
from torchjax.compile._state import StateWalk

# Containers the trace copies and a call can change: the builtin pytree nodes that are
# mutable, and their subclasses (``ModelOutput``).
_MUTABLE = (list, dict, collections.deque)
# Those whose new contents are put back with the builtin type's own methods.
_WRITABLE = frozenset(
    {list, dict, collections.OrderedDict, collections.defaultdict, collections.deque}
)
# Leaves the walk of ``nodes`` skips at once.
_PLAIN = frozenset({type(None), bool, int, float, complex, str, torch.dtype, torch.device})

_OTHER_TYPE = (
    "torchjax.jit({}) changed {} (a {}) in place: the compiled function got a copy of "
    "it, and torchjax.jit writes the new contents back only into a list, dict, "
    "OrderedDict, defaultdict or deque, or sets the items of another dict whose keys "
    "it only added to. Return the new values instead and store them outside the call "
    "(Note [Containers a compiled function changes])."
)
_TRACED = (
    "torchjax.jit({}) put {} into {}, which cannot leave the compiled program; a call "
    "gives back tensors and plain values only. Put the tensor itself there (it gets the "
    "call's values), or return it (Note [Containers a compiled function changes])."
)


def nodes(tree) -> list:
    """The lists, dicts and deques of ``tree`` (a call's ``(args, kwargs)``), and the
    objects of other classes registered as pytree nodes (not tuples), in pytree order:
    the trace's copies and the caller's objects are listed alike. What pytree takes as
    a leaf (an unregistered subclass) is passed to the function as it is, and watched
    as state (Note [State of a jitted function] in _state.py), not here."""
    found = []
    stack = [tree]
    while stack:
        x = stack.pop()
        t = type(x)
        if t in _WRITABLE:
            found.append(x)
            children = x.values() if isinstance(x, dict) else x
        elif isinstance(x, tuple):  # namedtuples and torch.return_types too
            children = x
        elif t in _PLAIN or isinstance(x, torch.Tensor):
            continue
        elif t in pytree.SUPPORTED_NODES:
            found.append(x)
            children = _contents(x)[0] if not isinstance(x, _MUTABLE) else _values(x)
        else:
            continue
        stack.extend(reversed(list(children)))
    return found


def _values(c):
    return c.values() if isinstance(c, dict) else c


class _Slot:
    """Stands for the caller's ``index``-th container in a program's output."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self):
        return f"<argument container #{self.index}>"


def _contents(c):
    if isinstance(c, dict):
        return dict(c)
    if isinstance(c, _MUTABLE):
        return list(c)
    # Another registered class: its children and structure, one level down.
    return pytree.tree_flatten(c, is_leaf=lambda x: x is not c)


def _writable(c, before) -> bool:
    """Whether a call can give the caller's ``c`` (of ``c``'s type) the contents the
    trace left in its copy ``c`` (holding ``before`` then): a builtin container, or a
    dict subclass whose old keys are still its first ones, in order (set item by item
    through its own ``__setitem__``: ``ModelOutput`` refuses ``clear``)."""
    if type(c) in _WRITABLE:
        return True
    return isinstance(c, dict) and list(c)[: len(before)] == list(before)


def _changed(c, before) -> bool:
    if not isinstance(c, _MUTABLE):
        children, spec = _contents(c)
        return spec != before[1] or any(a is not b for a, b in zip(children, before[0]))
    if isinstance(c, dict):
        return list(c) != list(before) or any(c[k] is not before[k] for k in before)
    return len(c) != len(before) or any(a is not b for a, b in zip(c, before))


class Watch:
    """At trace time: the containers of the function's arguments (the trace's copies)
    and their items before it ran."""

    def __init__(self, traced_tree, fn_name: str):
        self.tree = traced_tree
        self.fn_name = fn_name
        self.nodes = nodes(traced_tree)
        self.before = [_contents(c) for c in self.nodes]

    def finish(self, out, storages):
        """The function's output ``out`` joined with the changed containers' new
        contents, and the ``Writes`` a call replays (None: nothing to replay);
        ``storages``: the call's state storages (tensors the trace did not make)."""
        if not self.nodes:
            return out, None
        changed = [i for i, (c, b) in enumerate(zip(self.nodes, self.before)) if _changed(c, b)]
        for i in changed:
            c = self.nodes[i]
            if not _writable(c, self.before[i]):
                raise RuntimeError(
                    _OTHER_TYPE.format(self.fn_name, self._where(i), type(c).__name__)
                )
        if not changed:
            return out, None
        index = {id(self.nodes[i]): i for i in changed}
        slots = []

        def slot(x):
            if id(x) not in index:
                return x
            slots.append(x)
            return _Slot(index[id(x)])

        def is_node(x):
            return id(x) in index

        out = pytree.tree_map(slot, out, is_leaf=is_node)
        filled = [bool(slots)]  # where a call puts the caller's containers in
        contents = []
        for i in changed:
            del slots[:]
            contents.append(pytree.tree_map(slot, _contents(self.nodes[i]), is_leaf=is_node))
            filled.append(bool(slots))
        known = {id(s) for s in storages}
        for i, new in zip(changed, contents):
            for leaf in pytree.tree_leaves(new):
                what = _leaving(leaf, known)
                if what is not None:
                    raise RuntimeError(_TRACED.format(self.fn_name, what, self._where(i)))
        return (out, contents), Writes(changed, filled)

    def _where(self, i: int) -> str:
        """The ``i``-th container in the user's words: the argument it is or is in."""
        target, found = self.nodes[i], []

        def find(path, x):
            if x is target and not found:
                found.append(path)

        pytree.tree_map_with_path(find, self.tree, is_leaf=lambda x: x is target)
        return "argument " + _describe_path(found[0]) if found else "an argument's container"


def _describe_path(path) -> str:
    # ((args, kwargs), ...): the first key is 0 (positional) or 1 (keyword).
    if len(path) < 2:
        return "its arguments"
    rest = pytree.keystr(path[2:]) if len(path) > 2 else ""
    where, key = path[0].idx, path[1]
    name = f"#{key.idx}" if where == 0 else repr(key.key)
    return name + rest


def _shared(caller_nodes) -> frozenset:
    """Indices of the containers that are one object with an earlier one."""
    first: dict = {}
    shared = set()
    for i, c in enumerate(caller_nodes):
        j = first.setdefault(id(c), i)
        if j != i:
            shared.update((i, j))
    return frozenset(shared)


def _leaving(leaf, known) -> str | None:
    """What in a new container item cannot leave the program, or None."""
    if isinstance(leaf, (torch.Tensor, _Slot)):
        return None
    if isinstance(leaf, jax.core.Tracer):
        return "a jax array of its trace (torchjax.to_jax of a traced tensor)"
    walk = StateWalk(grads=False)
    walk.add(leaf)
    for t in walk.tensors:
        s = root(t)
        # A storage not made yet holds a fill, a constant: it may leave.
        if id(s) not in known and s.lazy is None and isinstance(s.arr, jax.core.Tracer):
            return f"a {type(leaf).__name__} holding a tensor of the trace"
    return None


class Writes:
    """The containers a traced call changed (their indices in ``nodes``), replayed
    after each run."""

    __slots__ = ("changed", "filled")

    def __init__(self, changed, filled):
        self.changed = changed
        # Whether the output, then each new contents, holds a caller's container.
        self.filled = filled

    def runs_eagerly(self, call) -> bool:
        """Whether this call's arguments share a container the program changes (Note
        [Containers a compiled function changes]): then it runs as eager Python."""
        return bool(_shared(_caller_nodes(call)).intersection(self.changed))

    def apply(self, result, call):
        """Put the new contents into the caller's containers; the function's output,
        with the caller's containers where it returned one."""
        cs = _caller_nodes(call)

        def fill(x):
            return cs[x.index] if type(x) is _Slot else x

        out, contents = result
        for i, new, filled in zip(self.changed, contents, self.filled[1:]):
            c = cs[i]
            if filled:
                new = pytree.tree_map(fill, new)
            if type(c) not in _WRITABLE:  # a dict subclass that only gained keys
                for k, v in new.items():
                    c[k] = v
            elif isinstance(c, dict):
                dict.clear(c)  # the same object: a defaultdict keeps its factory
                dict.update(c, new)
            elif isinstance(c, list):
                list.__setitem__(c, slice(None), new)
            else:
                c.clear()
                c.extend(new)
        return pytree.tree_map(fill, out) if self.filled[0] else out


def _caller_nodes(call) -> list:
    """The caller's containers of ``call``, listed once per call."""
    found = call.containers
    if found is None:
        found = call.containers = nodes(call.tree)
    return found
