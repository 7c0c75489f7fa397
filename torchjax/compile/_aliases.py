"""Outputs of a compiled function that are views of its inputs, its state or each other.

Note [Aliased outputs of a compiled function]
On CPU, eager or compiled by inductor, ``def f(x): return x[1:], x.t()`` returns views of
``x``: a write through an output changes ``x``, and two outputs viewing one intermediate
(``y = x * 2; return y[0], y``) share memory. AOTAutograd gives inductor that metadata
(``OutputAliasInfo``) and regenerates each aliased output from its base after the
compiled call (``gen_alias_from_base``: a view replay or ``as_strided``). The tpu backend
hands Dynamo's graph to torchjax.jit without AOTAutograd (its training path is the
program's compiled VJP), so the jit does the same itself: a jax program returns new
arrays, and an output whose storage, seen while tracing, is an argument's or a state
tensor's is returned as ``as_strided`` of that tensor (after the program's in-place
writes are written back), its value from the program unused. Outputs sharing the
storage of an intermediate get that storage as one more program output, wrapped once,
and each is ``as_strided`` of it. ``as_strided`` runs through torch's dispatcher, so the
views have torch's autograd (``AsStridedBackward``), ``_base`` and version counter.

An argument is traced as a contiguous copy of its values, so offsets and strides seen
while tracing count in that layout; for a non-contiguous argument they are mapped to its
storage (``_affine``), and where the mapping is not a view (a ``reshape`` that copies in
eager for that layout) the output stays the program's copy, as eager gives a copy then.
An output reading a storage as another dtype (``x.view(torch.int32)``, ``view_as_real``,
``view_as_complex``) is rebuilt the same way from that tensor seen as its dtype
(``_reinterpret``: torch's own ``view(dtype)`` / ``view_as_real``, so torch's rules on
which layouts allow it hold; ``z.conj().imag`` views the stored values and takes its neg
bit after); where torch refuses that view of the call's layout, the output stays the
program's copy. The argument
itself is given back only where the traced output was that argument object (``return
x``); ``x.detach()`` is a new tensor, and a view the trace saw leave the autograd graph
(``x.detach().t()`` of a ``requires_grad`` argument) is a view of ``x.detach()``.
"""

from __future__ import annotations

import math

import numpy as np

from torchjax.tensor._reinterpret import stored_as

_ARG, _STATE, _BASE = 0, 1, 2

# Note [Arguments that share memory]
# The program takes each tensor argument as its own array (its values), so two arguments
# viewing one storage (``f(t, t[1:])``), or an argument viewing a state tensor (a
# parameter), are independent inside it: where the function writes one in place and
# reads the other, the read would see the value from before the write (CPU, eager or
# inductor, sees the write: inductor's AOTAutograd gives such inputs a synthetic base).
# The call's key records which arguments share a root storage with an earlier argument
# or with state (``sharing``), so a call with another sharing pattern traces anew; and a
# trace that wrote a shared argument (or wrote state while an argument shares it) runs
# as eager Python instead, every call with that pattern: the same values as eager, at
# eager's speed. Sharing arguments that are only read keep the compiled program.


def root(t):
    s = t._storage
    return getattr(s, "root", s)  # an Interpretation's (dtype / conj view's) root


def plan(outs, args, storages, grads):
    """At trace time: how to rebuild each output (a traced JaxTensor) as a view;
    ``grads[j]``: whether output ``j`` stays in the call's autograd graph.

    Returns ``(aliases, bases)``: ``aliases[j]`` is None (the program's value) or
    ``(kind, index, size, stride, offset, conj, neg)``, ``kind`` an argument, a state
    storage or an extra output; ``bases``: the intermediate root storages whose arrays
    the program returns after its outputs."""
    arg_of = {id(root(a)): k for k, a in enumerate(args)}
    state_of = {id(s): i for i, s in enumerate(storages)}
    counts: dict = {}
    for t in outs:
        counts[id(root(t))] = counts.get(id(root(t)), 0) + 1
    aliases, bases, base_of = [], [], {}
    for t, grad in zip(outs, grads):
        r = root(t)
        # Whether the output is the argument object itself (``return x``, not
        # ``x.detach()`` or ``x.view_as(x)``) and whether it stays in the autograd graph
        # (a detached view of a ``requires_grad`` argument does not).
        same = any(t is a for a in args)
        meta = (t._size, t._stride, t._offset, t.is_conj(), t.is_neg(), same, grad)
        meta += (t.dtype,)
        if id(r) in arg_of:
            aliases.append((_ARG, arg_of[id(r)], *meta))
        elif id(r) in state_of:
            aliases.append((_STATE, state_of[id(r)], *meta))
        elif counts[id(r)] > 1:
            j = base_of.setdefault(id(r), len(bases))
            if j == len(bases):
                bases.append(r)
            aliases.append((_BASE, j, *meta))
        else:
            aliases.append(None)
    if all(a is None for a in aliases):
        return None, []
    return aliases, bases


def _reinterpret(base, dtype):
    """``base``'s stored elements seen as ``dtype``, as torch views them; None where
    torch refuses. The view is of what the storage holds, without ``base``'s conj / neg
    bits: the output's own bits, applied after, are relative to that."""
    if base.dtype == dtype:
        return base
    try:
        return stored_as(base, dtype)
    except RuntimeError:
        return None


def regenerate(aliases, outs, bases, args, state):
    """At run time: ``outs`` (the program's output tensors) with aliased ones replaced by
    views of ``args`` (the call's tensors), ``state`` (its state tensors, by storage) or
    ``bases`` (tensors over the extra outputs)."""
    result = list(outs)
    for j, alias in enumerate(aliases):
        if alias is None:
            continue
        kind, index, size, stride, offset, conj, neg, same, grad, dtype = alias
        if kind == _BASE:
            base = bases[index]
            if (
                offset == 0
                and tuple(size) == tuple(base.shape)
                and tuple(stride) == base.stride()
                and dtype == base.dtype
            ):
                result[j] = base  # the intermediate itself, as CPU returns it
                continue
            base = _reinterpret(base, dtype)
            if base is None:
                continue
        else:
            base = args[index] if kind == _ARG else state[index]
            if dtype != base.dtype:
                same = False
                base = _reinterpret(base, dtype)
                if base is None:
                    continue
            mapped = _affine(base, size, stride, offset)
            if mapped is None:
                continue
            stride, offset = mapped
            same_bits = conj == base.is_conj() and neg == base.is_neg()
            if (
                (same or kind == _STATE)
                and (tuple(size), tuple(stride), offset) == _layout(base)
                and same_bits
                and grad == base.requires_grad
            ):
                result[j] = base  # ``return x``: the tensor itself, as eager gives
                continue
            if base.requires_grad and not grad:
                base = base.detach()  # ``x.detach()``, ``x.detach().t()``: no graph
        view = base.as_strided(size, stride, offset)
        if conj != view.is_conj():
            view = view.conj()
        if neg != view.is_neg():
            view = view._neg_view()
        result[j] = view
    return result


def _layout(t):
    return tuple(t.shape), t.stride(), t.storage_offset()


def _affine(base, size, stride, offset):
    """Strides and offset in ``base``'s storage of the view (size, stride, offset) of its
    values laid out contiguously; None where that is not a strided view of ``base``."""
    if base.is_contiguous():
        return stride, base.storage_offset() + offset
    if math.prod(size) == 0:
        return stride, base.storage_offset()
    # Storage position of each element of base in row-major order, then of each output
    # element; a view when the output's positions are affine in its index.
    pos = np.zeros(base.shape, dtype=np.int64) + base.storage_offset()
    for d, (n, s) in enumerate(zip(base.shape, base.stride())):
        shape = [1] * base.dim()
        shape[d] = n
        pos = pos + np.arange(n, dtype=np.int64).reshape(shape) * s
    flat = pos.reshape(-1)
    idx = np.zeros(size, dtype=np.int64) + offset
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + np.arange(n, dtype=np.int64).reshape(shape) * s
    got = flat[idx]
    first = int(got.reshape(-1)[0])
    new_stride = []
    for d, n in enumerate(size):
        if n == 1:
            new_stride.append(1)
            continue
        step = np.take(got, 1, axis=d) - np.take(got, 0, axis=d)
        new_stride.append(int(step.reshape(-1)[0]))
    want = np.zeros(size, dtype=np.int64) + first
    for d, (n, s) in enumerate(zip(size, new_stride)):
        shape = [1] * len(size)
        shape[d] = n
        want = want + np.arange(n, dtype=np.int64).reshape(shape) * s
    if not np.array_equal(want, got):
        return None
    return tuple(new_stride), first


def sharing(tensors, storages) -> tuple:
    """Per tensor argument, the first argument (``("arg", k)``) or state storage
    (``("state", i)``) holding its root storage; () when no two share one (Note
    [Arguments that share memory])."""
    seen = {id(s): ("state", i) for i, s in enumerate(storages)}
    pattern = []
    for k, t in enumerate(tensors):
        pattern.append(seen.setdefault(id(root(t)), ("arg", k)))
    if all(p == ("arg", k) for k, p in enumerate(pattern)):
        return ()
    return tuple(pattern)


def writes_shared(pattern, args_written, state_written) -> bool:
    """Whether a trace with sharing ``pattern`` wrote an argument that shares memory, or
    wrote state that an argument shares (the call then runs eagerly)."""
    if not pattern:
        return False
    for k in args_written:
        if pattern[k] != ("arg", k) or pattern.count(("arg", k)) > 1:
            return True
    states = {i for kind, i in pattern if kind == "state"}
    return bool(states.intersection(state_written))
