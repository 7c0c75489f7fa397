"""Cache keys for Python values baked into a trace.

Note [Typed keys for static values]
Python's equality merges values a trace tells apart: ``1 == 1.0 == True`` (an int
tensor times 1 stays int, times 1.0 becomes float), ``0.0 == -0.0`` (the sign of
zero survives multiplication), and ``nan != nan`` (a key holding NaN never matches
itself, so every call would trace again). A static value is therefore keyed by its
type and, for floats and complex numbers, by its exact bits; containers by the keys
of their items.

Note [Static values keyed once]
A call's non-tensor arguments are flattened leaf by leaf (torch's pytree) and each leaf
keyed, on every call. A large static value passed on every call, such as compiled
generation's guard of a cache's Python state (a tuple per layer attribute: some 500
leaves for a 16-layer model), cost more to flatten, key and compare than the rest of the
lookup. ``Keyed(value)`` computes the value's key once, when made, and is one leaf:
equal and hashed by that key, opaque to the state walk (no ``__dict__``).
"""

from __future__ import annotations


def value_key(v):
    """A hashable key equal for two values exactly when a trace cannot tell them apart."""
    t = type(v)
    if t is float:
        return (float, v.hex())
    if t is complex:
        return (complex, v.real.hex(), v.imag.hex())
    if t in (bool, int):
        return (t, v)
    if t in (tuple, list):
        return (t, tuple(map(value_key, v)))
    if t is dict:
        return (dict, tuple((k, value_key(x)) for k, x in v.items()))
    return v


class Keyed:
    """A static argument of a torchjax.jit call, keyed once (Note [Static values keyed
    once]): ``value`` as passed; equal to another ``Keyed`` exactly when their
    ``value_key``s are equal."""

    __slots__ = ("value", "_key", "_hash")

    def __init__(self, value):
        self.value = value
        self._key = value_key(value)
        self._hash = hash(self._key)

    def __eq__(self, other) -> bool:
        return type(other) is Keyed and (
            other is self or (other._hash == self._hash and other._key == self._key)
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Keyed({self.value!r})"


def first_difference(a, b) -> tuple:
    """The first pair of items where ``a`` and ``b`` (nested tuples and lists) differ by
    ``value_key``, for a message; ``(a, b)`` themselves where they are not both such."""
    while type(a) is type(b) and type(a) in (tuple, list) and len(a) == len(b):
        pair = next(((x, y) for x, y in zip(a, b) if value_key(x) != value_key(y)), None)
        if pair is None:
            break
        a, b = pair
    return a, b
