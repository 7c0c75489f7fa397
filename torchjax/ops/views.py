"""The handler of a view overload: the result's layout from the op run on a meta tensor,
its value read lazily from the shared storage where the op only re-describes elements."""

from __future__ import annotations

import jax
import torch

from torchjax._compat.torch import set_math_bits
from torchjax.ops import fused
from torchjax.ops.functional import make_compute
from torchjax.tensor._reinterpret import Interpretation
from torchjax.tensor._tensor import JaxTensor, view_of

# Note [Lazy views]
# A view op that only re-describes the elements (same dtype, values read straight from
# the storage by size/stride/offset) does no jax work when it is called: the result is
# the new layout over ``self``'s storage, with no cached value. Its value is read when
# something needs it, and a compiled lowering reading it does the read inside its own
# executable (Note [Compiled lowerings], torchjax/ops/cached_compute.py), so ``x.t()`` feeding
# ``addmm`` costs no XLA dispatch of its own and XLA folds the transpose into the dot.
# Eagerly, every XLA dispatch costs tens of microseconds (much more on a busy machine);
# a transformer's forward is more than half views. Views that reinterpret the element
# type (``view.dtype``, ``view_as_real``, ``view_as_complex``) are layout views too: the
# storage is read through an interpretation (Note [Views across dtypes]).
_LAYOUT_VIEWS = frozenset(
    {
        "view",
        "_reshape_alias",
        "permute",
        "transpose",
        "t",
        "expand",
        "squeeze",
        "unsqueeze",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "unbind",
        "diagonal",
        "unfold",
        "narrow",
        "alias",
        "view_as_real",
        "view_as_complex",
    }
)


def view_handler(func, entry):
    """Sizes/strides/offset from the op run on a meta tensor; the value from the
    lowering, or read lazily from the storage (Note [Lazy views])."""
    compute = make_compute(func, entry, False)
    lazy = func._opname in _LAYOUT_VIEWS

    # (base storage numel, size, stride, offset, dtype, other args) -> the result views'
    # (size, stride, offset, dtype): running the op on a meta tensor costs more than the
    # op itself, and a model repeats the same few views every step.
    layouts: dict = {}

    def view(args, kwargs):
        base = args[0]
        value = None if lazy else compute(args, kwargs)
        if value is not None and not isinstance(value, jax.Array) and fused.ACTIVE[0]:
            # Recorded (Note [Fused eager]): the view reads its storage when needed.
            value = None
        try:
            key = (
                base._storage.numel,
                base._size,
                base._stride,
                base._offset,
                base.dtype,
                _bits(base),
                _hashable(args[1:]),
                _hashable(tuple(kwargs.items())) if kwargs else (),
            )
            layout = layouts.get(key)
        except TypeError:  # an unhashable argument: no caching
            key = layout = None
        if layout is None:
            meta = func(meta_like(base), *args[1:], **kwargs)
            many = isinstance(meta, (list, tuple))
            layout = (
                type(meta) if many else None,
                tuple(_layout(m) for m in (meta if many else (meta,))),
            )
            if key is not None:
                if len(layouts) > 4096:
                    layouts.clear()
                layouts[key] = layout
        seq, parts = layout
        if seq is None:
            return view_of(base, *parts[0], value)
        if value is None:
            return seq(view_of(base, *p) for p in parts)
        return seq(view_of(base, *p, v) for p, v in zip(parts, value))

    return view


def _layout(meta):
    return (tuple(meta.shape), tuple(meta.stride()), meta.storage_offset(), meta.dtype)


def _hashable(x):
    """``x`` with lists turned into tuples (type-tagged, so 1 and True, [1] and (1,)
    differ); raises TypeError for values that cannot be a cache key (tensors)."""
    cls = x.__class__
    if cls is list or cls is tuple:
        for y in x:
            if y.__class__ is not int:
                return (cls,) + tuple([_hashable(y) for y in x])
        # Sizes and dims, the usual case: ints need no tags (a tagged element is a
        # tuple, so the two forms never meet).
        return (cls,) + x if cls is tuple else (cls, *x)
    if isinstance(x, (list, tuple)):  # a subclass (torch.Size)
        return (cls,) + tuple([_hashable(y) for y in x])
    if isinstance(x, torch.Tensor):
        raise TypeError("tensor argument")
    return (cls, x)


def _bits(t: JaxTensor):
    """(conj, neg): torch's math bits, which follow the storage's interpretation."""
    s = t._storage
    return (s.conj, s.neg) if s.__class__ is Interpretation else None


def meta_like(t: JaxTensor) -> torch.Tensor:
    # The storage's numel is in units of t.dtype (an Interpretation counts its own), and
    # the bits travel, so torch's checks (view_as_real of a conj tensor) run on it.
    flat = torch.empty((t._storage.numel,), dtype=t.dtype, device="meta")
    meta = flat.as_strided(t._size, t._stride, t._offset)
    bits = _bits(t)
    if bits is not None:
        set_math_bits(meta, *bits)
    return meta
