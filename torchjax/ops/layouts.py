"""Result layouts: the strides CPU gives a functional op's result when an input's
dimensions are out of row-major order.

Note [Result layouts follow CPU]
On CPU an elementwise op lays its result out in its inputs' memory order (TensorIterator:
``x.t() * 2`` has strides (1, 3), a channels_last input gives a channels_last result),
as do convolutions and the ops that allocate with ``empty_like``. Code relies on it:
``(y.t() * 2).t().view(-1)`` works on CPU because the result's transpose is contiguous
again, and ``is_contiguous(memory_format=torch.channels_last)`` steers conv nets. So a
functional op whose arguments include a tpu tensor with dimensions out of row-major
order gets the strides torch's meta kernel gives the same call: the C++ or Python
kernel CPU's own layout comes from, run on meta tensors of the arguments' sizes, strides
and dtypes, and cached per (arguments' layouts, other arguments) because it costs more
than the op. A result at a dense permutation of dimensions keeps its computed value as
its read cache, its storage in memory order made on first read (Note [Storages in
memory order, made on first read] in torchjax/tensor/_memory_format.py); one whose
strides differ only at size-1 dimensions reports them (``restrided``). Anything else
(no meta kernel, a non-dense layout, a shape that differs) stays contiguous.

Inputs that are contiguous, sliced or expanded (strides of the dimensions larger than 1
never increasing, stride-0 dimensions aside) give a row-major result on CPU too and
never reach the meta call: the check is one cached lookup per tensor argument. In fused
eager mode the storage in memory order is a recorded read of the result, so the
segment goes on (Note [Fused eager] in torchjax/ops/fused.py).
"""

from __future__ import annotations

import functools

import torch

from torchjax._compat.torch import conv_memory_format
from torchjax.ops import fused, fused_reads
from torchjax.tensor._errors import to_meta
from torchjax.tensor._memory_format import (
    in_memory_order,
    in_row_major_order,
    is_dense_permutation,
    memory_order,
    restrided,
)
from torchjax.tensor._storage import contiguous_strides
from torchjax.tensor._tensor import JaxTensor, make, view_of


@functools.lru_cache(maxsize=8192)
def out_of_order(size, stride) -> bool:
    """Whether some dimension larger than 1 has a larger stride than one before it
    (stride-0 dimensions aside): the data is not in row-major order."""
    last = None
    for n, s in zip(size, stride):
        if n == 1 or s == 0:
            continue
        if last is not None and s > last:
            return True
        last = s
    return False


def any_out_of_order(args, kwargs) -> bool:
    """Whether a tpu tensor among ``args``, ``kwargs`` (or their lists) is out of
    row-major order."""
    for a in args:
        cls = a.__class__
        if cls is JaxTensor:
            if out_of_order(a._size, a._stride):
                return True
        elif (cls is list or cls is tuple) and _seq_out_of_order(a):
            return True
    return bool(kwargs) and any_out_of_order(kwargs.values(), None)


def _seq_out_of_order(seq) -> bool:
    return any(x.__class__ is JaxTensor and out_of_order(x._size, x._stride) for x in seq)


class ResultLayouts:
    """The meta-derived layouts of one overload's results, per argument layout (see the
    Note)."""

    def __init__(self, func):
        self.func = func
        self.cache: dict = {}

    def __call__(self, args, kwargs, result):
        try:
            key = (_key(args), _key(tuple(kwargs.items())) if kwargs else ())
            plan = self.cache.get(key)
        except TypeError:  # an unhashable argument: no caching
            key = plan = None
        if plan is None:
            plan = self._plan(args, kwargs)
            if key is not None:
                if len(self.cache) > 4096:
                    self.cache.clear()
                self.cache[key] = plan
        if not plan:
            return result
        if result.__class__ is JaxTensor:
            return apply_layout(result, plan[0])
        outs = [apply_layout(r, p) if r.__class__ is JaxTensor else r for r, p in zip(result, plan)]
        return type(result)(outs)

    def _plan(self, args, kwargs) -> tuple:
        """Per result: the strides to report (None: contiguous, as computed); () when no
        result changes."""
        func = self.func
        if func._opname.startswith("_fft_"):
            # The meta kernels of the FFTs give layouts CPU's pocketfft does not.
            return ()
        try:
            meta = func(*to_meta(args), **{k: to_meta(v) for k, v in kwargs.items()})
            if func._opname in ("convolution", "_convolution"):
                meta = _conv_layout(meta, args)
        except Exception:  # no meta kernel, or one that refuses: contiguous results
            return ()
        many = isinstance(meta, (list, tuple))
        plan = tuple(strides_for(m) for m in (meta if many else (meta,)))
        return plan if any(p is not None for p in plan) else ()


def _conv_layout(meta, args):
    """``meta`` (the convolution's result) at the memory format CPU's convolution picks:
    its meta kernel decides by the input alone, CPU by the backend it selects for input
    and weight (what fake tensors ask too). Empty CPU tensors stand for the arguments;
    their memory is never touched."""
    x, w, b = (
        None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        for t in args[:3]
    )
    fmt = conv_memory_format(x, w, b, *args[3:9])
    if meta.dim() == 3 and fmt == torch.channels_last:
        return meta.unsqueeze(2).to(memory_format=fmt).squeeze(2)
    return meta.to(memory_format=fmt)


def strides_for(meta):
    """``(size, stride)`` to give a result laid out as ``meta`` (a tensor whose strides
    are row-major up to size-1 dimensions, or a dense permutation), or None
    (contiguous)."""
    if not isinstance(meta, torch.Tensor) or meta.layout != torch.strided:
        return None
    size, stride = tuple(meta.shape), tuple(meta.stride())
    if stride == contiguous_strides(size) or 0 in size:
        return None
    if in_row_major_order(size, stride) or is_dense_permutation(size, stride):
        return (size, stride)
    return None


def apply_layout(t: JaxTensor, planned):
    """``t``, a fresh contiguous result, reporting ``planned`` (``strides_for``'s): the
    same tensor restrided, or its value over a storage in memory order."""
    if planned is None:
        return t
    size, stride = planned
    if t._size != size or t._stride != contiguous_strides(size):
        return t  # not the fresh contiguous result the plan was made for
    if in_row_major_order(size, stride):
        return restrided(t, stride)
    if fused.ACTIVE[0]:
        recorded = _recorded(t, size, stride)
        if recorded is not None:
            return recorded
    return in_memory_order(t._value(), size, stride, t.dtype, t._device_index)


def _recorded(t, size, stride):
    """In fused eager mode, ``t`` at ``stride`` over a storage that is a recorded read
    of ``t`` in memory order; None when ``t`` is not a recorded value."""
    order = memory_order(size, stride)
    physical = (tuple(size[d] for d in order), tuple(t._stride[d] for d in order))
    pending = fused_reads.record_read(view_of(t, *physical, 0))
    if pending is None:
        return None
    storage = fused.wrap(pending, t._device_index)._storage
    return make(storage, size, stride, 0, t.dtype, t._device_index)


def _key(x):
    """``x`` as a cache key: tensors by (class, size, stride, dtype), sequences by their
    elements (type-tagged, so 1 and True, [1] and (1,) differ)."""
    cls = x.__class__
    if cls is JaxTensor:
        return (cls, x._size, x._stride, x.dtype)
    if isinstance(x, torch.Tensor):
        return (torch.Tensor, tuple(x.shape), x.stride(), x.dtype, x.device.type)
    if isinstance(x, (list, tuple)):
        return (cls,) + tuple(_key(y) for y in x)
    hash(x)
    return (cls, x)
