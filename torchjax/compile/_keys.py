"""Cache keys for Python values baked into a trace.

Note [Typed keys for static values]
Python's equality merges values a trace tells apart: ``1 == 1.0 == True`` (an int
tensor times 1 stays int, times 1.0 becomes float), ``0.0 == -0.0`` (the sign of
zero survives multiplication), and ``nan != nan`` (a key holding NaN never matches
itself, so every call would trace again). A static value is therefore keyed by its
type and, for floats and complex numbers, by its exact bits; containers by the keys
of their items.
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
        return (t, tuple(value_key(x) for x in v))
    if t is dict:
        return (dict, tuple((k, value_key(x)) for k, x in v.items()))
    return v
