"""Argument templates: what each argument of a compiled call was, as the key of its
executable holds it (Note [Compiled lowerings] in torchjax/ops/compiled.py).

A call's arguments become a template, a tuple of entries, and a list of executable
arguments (``dyn``): an array is ``ARRAY`` (the next argument), a Python value that is
part of the key is ``(STATIC, type, key value, value)``, a list or tuple ``(SEQ, type,
entries)``, a view read inside the executable ``(VIEW, storage numel, size, stride,
offset)`` and an input known by its shape alone ``(SHAPE, size, jax dtype)``. Inside the
executable ``rebuild`` turns the template and the traced arguments back into the
lowering's arguments.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from torchjax.tensor._storage import _plan, layout_plan

SCALARS = (bool, int, float, complex)
FAST_SCALARS = frozenset(SCALARS)  # exact types: a subclass takes the full template
FAST_STATICS = frozenset(
    {*SCALARS, type(None), str, torch.dtype, torch.device, torch.layout, torch.memory_format}
)

# Template entries (what an argument was; the key is built of these).
ARRAY = 0  # ("arg": the next executable argument)
STATIC = 1  # (STATIC, type, key value, value)
SEQ = 2  # (SEQ, list or tuple, entries)
VIEW = 3  # (VIEW, storage numel, size, stride, offset): the next argument is a storage
# (and, when offset is None, the argument after it the offset)
SHAPE = 4  # (SHAPE, size, jax dtype): zeros of that shape, no argument
# (Note [Samplers read no values])

# Note [Samplers read no values]
# ``torch.randn(n)`` is ``empty`` then ``normal_``, and ``normal_`` overwrites its input:
# only its shape and dtype matter. Passing the input's array would make the array of a
# new tensor (Note [Storages filled on first read]) just to be overwritten, a transfer
# or a fill per call. A lowering registered with ``self_values=False`` gets zeros of the
# input's shape built inside its executable instead (XLA drops them, unused), and the
# input enters the key by its shape and dtype only.


def static(x):
    t = type(x)
    if t is float:
        return (STATIC, t, x.hex(), x)
    return (STATIC, t, x, x)


def static_entry(x):
    """``_entry``'s template entry for a plain static argument (a number outside the
    promoted positions, None, a string, a dtype, a list or tuple of them); None for
    anything else."""
    cls = x.__class__
    if cls in FAST_STATICS:
        return static(x)
    if cls is list or cls is tuple:
        parts = []
        for y in x:
            if y.__class__ not in FAST_STATICS:
                return None
            parts.append(static(y))
        return (SEQ, cls, tuple(parts))
    return None


def float_masked(entry):
    """``entry`` with float static values blanked (keys equal up to float values)."""
    if entry is ARRAY or entry[0] in (VIEW, SHAPE):
        return entry
    if entry[0] == STATIC:
        return (STATIC, float) if entry[1] is float else entry
    return (SEQ, entry[1], tuple(float_masked(e) for e in entry[2]))


def has_view(entry) -> bool:
    if entry is ARRAY or entry[0] in (STATIC, SHAPE):
        return False
    return entry[0] == VIEW or any(has_view(e) for e in entry[2])


def rebuild(entry, it):
    if entry is ARRAY:
        return next(it)
    if entry[0] == STATIC:
        return entry[3]
    if entry[0] == SHAPE:
        return jnp.zeros(entry[1], entry[2])
    if entry[0] == VIEW:
        flat = next(it).reshape(-1)
        if entry[4] is None:  # the offset is the next argument
            return layout_plan(*entry[1:4]).read(flat, next(it))
        return _plan(*entry[1:]).read(flat)
    return entry[1](rebuild(e, it) for e in entry[2])


def signature(dyn) -> tuple:
    """The input signature of an executable's arguments: (shape, dtype) of each array,
    the type of each Python scalar (cast to a 0-d array of the computation dtype)."""
    sig = []
    for d in dyn:
        try:
            sig.append((d.shape, d.dtype))
        except AttributeError:
            sig.append(type(d))
    return tuple(sig)
