"""The plain attributes of the modules a torchjax.jit call reaches, as part of its key.

Note [A module's plain attributes are guards]
A forward reads numbers and flags kept as plain attributes of its modules at trace
time: ``Dropout.p``, ``LayerNorm.eps``, ``LeakyReLU.negative_slope``, transformers'
``variance_epsilon``, an attention module's ``scaling`` and ``is_causal``, a user's
``self.temperature``. Keyed without them, ``m[1].p = 0.9`` after a call ran the
program traced with the old ``p``: a silent wrong result. Dynamo guards on each
attribute a graph reads; here each module the walk reaches contributes the values of
its public plain attributes (``__dict__`` entries not starting with ``_``, other than
``training``, which the training flags key already, holding None, a bool, int, float,
complex, str or torch.dtype, or tuples of those) to the key, so a change traces again.

The walk runs on every call, so this must cost little per module. A module's plain
attribute names are found once, remembered by the module's ``id`` (forgotten by a weak
reference callback when it dies, so a new module at its address starts afresh), and
read on each call with one ``operator.itemgetter``, in the walk's loop over modules
(which takes the module's weak reference for its module key from the same entry). They
are found again when that fails (an attribute deleted) or when the ``__dict__`` changes
size (one added). A module's values are compared with its last ones with ``==``, one
tuple comparison: only a changed value builds its typed key (Note [Typed keys for
static values] in torchjax/compile/_keys.py), interned to a small integer, the
module's part of the call's key (a change back finds the first program again). Not
seen, for the cost of comparing each value's identity or type on every call (some 20%
of the walk): a change to an equal value of another type or sign of zero (``2`` to
``2.0``), and an attribute changed from a non-plain value (a tensor, a module) to a
plain one without the ``__dict__`` changing size. A plain value changed to anything
else is seen (but for a one-element tensor equal to it) and drops out of the names. The
interned values stay for the process: one entry per distinct set of values seen, no
more than the traces they cause.

The key is the attributes' state after a trace, not before: a forward that changes
an attribute while tracing (a call counter, ``self.cached_len = n``) changed it for
the program's next call too, whose key then matches the program traced. Such a
change is made once, by the trace; the program does not repeat it on later calls,
as eager code would.
"""

from __future__ import annotations

import functools
import operator
import weakref

import torch

from torchjax.compile._keys import value_key

_PLAIN = frozenset({type(None), bool, int, float, complex, str, torch.dtype})


# What the fast path's getter and comparison raise: KeyError, an attribute deleted;
# RuntimeError and ValueError, a plain value replaced by a tensor or a numpy array of
# several elements, whose ``==`` has no truth value. Each sends the module to ``seen``.
COMPARE_ERRORS = (KeyError, RuntimeError, ValueError)


class Seen:
    """One module's plain attribute names, their getter, and its last values' token."""

    __slots__ = ("get", "names", "ref", "size", "token", "vals")


# id(module) -> Seen; an entry leaves when its module dies (weak reference callback).
SEEN: dict[int, Seen] = {}
# (names, typed values) -> token, and each token's (names, values) for retrace reasons.
_TOKENS: dict = {}
_VALUES: list = []


def _plain(v) -> bool:
    t = type(v)
    return t in _PLAIN or (t is tuple and all(map(_plain, v)))


def _getter(names):
    if len(names) > 1:
        return operator.itemgetter(*names)
    if names:
        name = names[0]
        return lambda d: (d[name],)
    return lambda d: ()


def _forget(table: dict, at: int, ref) -> None:
    # Takes the table as an argument: it can run at interpreter exit, when this
    # module's globals are gone.
    s = table.get(at)
    if s is not None and s.ref is ref:
        del table[at]


def _scan(mod) -> Seen:
    d = mod.__dict__
    s = Seen()
    s.names = tuple(
        n for n, v in d.items() if not n.startswith("_") and n != "training" and _plain(v)
    )
    s.get = _getter(s.names)
    s.size = len(d)
    s.vals = s.token = None  # vals: no tuple equals None
    try:
        s.ref = weakref.ref(mod, functools.partial(_forget, SEEN, id(mod)))
    except TypeError:  # a module class with __slots__ and no weak reference slot
        s.ref = (id(mod), type(mod))
    return s


def seen(mod) -> Seen:
    """``mod``'s entry, made or brought up to date, where the fast path of ``key``
    (repeated in the walk, torchjax/compile/_state.py) found none: a new module, a
    changed ``__dict__`` or value. ``ref``: the module's weak reference, or (id, type)
    for a module that takes none."""
    d = mod.__dict__
    s = SEEN.get(id(mod))
    if s is None or s.size != len(d):
        s = _scan(mod)
    try:
        vals = s.get(d)
    except KeyError:  # an attribute deleted, another added in its place
        s = _scan(mod)
        vals = s.get(d)
    if not all(map(_plain, vals)):  # an attribute now holds something else
        s = _scan(mod)
        vals = s.get(d)
    if vals == s.vals:
        return s
    key = (s.names, value_key(vals))
    token = _TOKENS.get(key)
    if token is None:
        token = _TOKENS[key] = len(_VALUES)
        _VALUES.append((s.names, vals))
    # A new entry, never one changed in place: another thread's walk may be reading the
    # old one, whose values and token must stay a pair.
    new = Seen()
    new.get, new.names, new.ref, new.size = s.get, s.names, s.ref, s.size
    new.vals, new.token = vals, token
    if type(new.ref) is weakref.ref:
        SEEN[id(mod)] = new
    return new


def key(modules) -> tuple:
    """One small integer per module: the values of its plain attributes."""
    out = []
    for mod in modules:
        s = SEEN.get(id(mod))
        try:
            if s is None or s.size != len(d := mod.__dict__) or s.get(d) != s.vals:
                s = seen(mod)
        except COMPARE_ERRORS:
            s = seen(mod)
        out.append(s.token)
    return tuple(out)


def describe(old: tuple, new: tuple, modules: tuple) -> str | None:
    """The first module attribute that differs between two keys of the same modules
    (``modules``: the call's module key, weak references), or None."""
    if len(old) != len(new) or len(modules) != len(old):
        return None
    for a, b, ref in zip(old, new, modules):
        if a == b:
            continue
        mod = ref() if isinstance(ref, weakref.ref) else None
        kind = type(mod).__name__ if mod is not None else "module"
        (names_a, vals_a), (names_b, vals_b) = _VALUES[a], _VALUES[b]
        was, now = dict(zip(names_a, vals_a)), dict(zip(names_b, vals_b))
        for name in (*names_b, *names_a):
            x, y = was.get(name, _MISSING), now.get(name, _MISSING)
            if value_key(x) != value_key(y):
                return f"the attribute {name} of a {kind} changed ({x!r} -> {y!r})"
        return None
    return None


class _Missing:
    def __repr__(self):
        return "unset"


_MISSING = _Missing()
