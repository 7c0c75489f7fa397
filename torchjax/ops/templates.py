"""Argument templates: what each argument of a compiled call was, as the key of its
executable holds it (Note [Compiled lowerings] in torchjax/ops/cached_compute.py).

A call's arguments become a template, a tuple of entries, and a list of executable
arguments (``dyn``): an array is ``ARRAY`` (the next argument), a Python value that is
part of the key a ``Static``, a list or tuple a ``Seq`` of entries, a view read inside
the executable a ``View``, an input known by its shape alone a ``Shape`` and a tensor
whose conversion is computed inside the executable an ``Astype``, and a Python float
passed as a value of the program (Note [Python floats as values of an op's program] in
torchjax/ops/cached_compute.py) ``FLOAT``. Entries are
named tuples whose first field is their kind, so a key compares and hashes as the plain
tuples it is made of. Inside the executable ``rebuild`` turns the template and the
traced arguments back into the lowering's arguments.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import torch

from torchjax._compat.jax import weak_float
from torchjax.ops.promotion import astype
from torchjax.tensor._storage import _plan, layout_plan

SCALARS = (bool, int, float, complex)
FAST_SCALARS = frozenset(SCALARS)  # exact types: a subclass takes the full template
FAST_STATICS = frozenset(
    {*SCALARS, type(None), str, torch.dtype, torch.device, torch.layout, torch.memory_format}
)

# Template entries (what an argument was; the key is built of these).
ARRAY = 0  # the next executable argument
STATIC = 1
SEQ = 2
VIEW = 3
SHAPE = 4
ASTYPE = 5
TRACED = 6


class Static(NamedTuple):
    """A Python value that is part of the key (a float keyed by its hex form)."""

    kind: int
    cls: type
    key: object
    value: object


class Seq(NamedTuple):
    """A list or tuple of entries."""

    kind: int
    cls: type
    entries: tuple


class View(NamedTuple):
    """A view read inside the executable: the next argument is its storage (and, when
    ``offset`` is None, the argument after it the offset)."""

    kind: int
    numel: int
    size: tuple
    stride: tuple
    offset: int | None


class Shape(NamedTuple):
    """Zeros of ``size`` and ``dtype`` built inside the executable, no argument (Note
    [Samplers read no values])."""

    kind: int
    size: tuple
    dtype: object


class Astype(NamedTuple):
    """A tensor converted inside the executable (Note [Conversions read by their
    consumers] in torchjax/ops/deferred_casts.py): the next argument, its source, as
    ``dtype``; ``source`` is the source's dtype (the fast path's key)."""

    kind: int
    dtype: object
    source: object


class Traced(NamedTuple):
    """A Python float passed as a float64 0-d argument, given to the lowering as a weakly
    typed scalar (it promotes as the Python float does)."""

    kind: int


FLOAT = Traced(TRACED)


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
        return Static(STATIC, t, x.hex(), x)
    return Static(STATIC, t, x, x)


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
        return Seq(SEQ, cls, tuple(parts))
    return None


def float_masked(entry):
    """``entry`` with float static values blanked (keys equal up to float values)."""
    if entry is ARRAY or entry.kind in (VIEW, SHAPE, ASTYPE, TRACED):
        return entry
    if entry.kind == STATIC:
        return (STATIC, float) if entry.cls is float else entry
    return Seq(SEQ, entry.cls, tuple(float_masked(e) for e in entry.entries))


def layout_masked(entry):
    """``entry`` with each view's layout (storage numel, strides, offset) blanked: keys
    equal up to where their views lie in their storages (Note [Views in keys whose
    shapes vary] in torchjax/ops/view_signatures.py)."""
    if entry is ARRAY or entry.kind in (STATIC, SHAPE, ASTYPE, TRACED):
        return entry
    if entry.kind == VIEW:
        return (VIEW, entry.size)
    return Seq(SEQ, entry.cls, tuple(layout_masked(e) for e in entry.entries))


def has_view(entry) -> bool:
    if entry is ARRAY or entry.kind in (STATIC, SHAPE, ASTYPE, TRACED):
        return False
    return entry.kind == VIEW or any(has_view(e) for e in entry.entries)


def has_cast(entry) -> bool:
    if entry is ARRAY or entry.kind in (STATIC, SHAPE, VIEW, TRACED):
        return False
    return entry.kind == ASTYPE or any(has_cast(e) for e in entry.entries)


def rebuild(entry, it):
    if entry is ARRAY:
        return next(it)
    kind = entry.kind
    if kind == STATIC:
        return entry.value
    if kind == SHAPE:
        return jnp.zeros(entry.size, entry.dtype)
    if kind == ASTYPE:
        return astype(next(it), entry.dtype)
    if kind == TRACED:
        return weak_float(next(it))
    if kind == VIEW:
        flat = next(it).reshape(-1)
        if entry.offset is None:  # the offset is the next argument, the numel the array's
            return layout_plan(flat.shape[0], entry.size, entry.stride).read(flat, next(it))
        return _plan(entry.numel, entry.size, entry.stride, entry.offset).read(flat)
    return entry.cls(rebuild(e, it) for e in entry.entries)


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
