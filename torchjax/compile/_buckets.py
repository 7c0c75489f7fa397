"""Shape buckets: inputs whose length varies along one dimension padded to a few sizes.

Note [Shape buckets]
Each new input shape costs compiles (one per op in eager, one program under
``torchjax.jit``) and, until evicted, their memory (Note [Executable cache budget] in
torchjax/_budget.py). When shapes vary along one dimension only (a sequence length),
padding that dimension up to the next of a few bucket sizes bounds the compiles by the
number of buckets. ``bucketed(fn, buckets=..., dim=1)`` does it around any callable,
eager or ``torchjax.jit``:

- the length ``n`` is the size along ``dim`` of the first tensor argument; every tensor
  argument with that size along ``dim`` is padded at the end (right padding) to the
  bucket ``b >= n``, with ``pad_values[name]`` (keyword arguments) or 0;
- the attention mask (keyword ``mask``, default ``"attention_mask"``) is padded with 0, so
  padded positions are masked out of every real position's attention; when it is
  absent, ``fill_mask`` is True (the default) and ``fn`` takes that keyword, a mask of n
  ones padded with zeros is passed, as a bidirectional model (BERT) needs one. A causal
  model is correct either way: real positions never attend to the later, padded ones;
- every tensor in the result with size ``b`` along ``dim`` is sliced back to ``n``
  (tuples, lists, dicts and HF ``ModelOutput`` are walked), so the caller sees the shapes
  of the unpadded call. Other outputs are returned as computed: a reduction over the
  padded dimension (a pooled output, a loss) includes the padded positions unless the
  function itself masks them.

Where the padding runs: on the tensor's own device. Padding a tpu tensor is one small
compile per new length (the pad itself sees the new shape), besides the bucket's program
that ``fn`` runs; CPU inputs (batches from a DataLoader) pad on the host for free, and
``device="tpu"`` then moves the padded batch, so a new length compiles nothing at all up
to ``fn``'s outputs. Reading a sliced output back (``.cpu()`` of the narrowed view) is one
more small program per new length.

The trade-off: the work of the padded positions (up to the gap to the next bucket: with
buckets doubling, at most 2x the sequence, on average about 1.4x for uniform lengths)
against one compile per new length; lengths above the largest bucket raise.
"""

from __future__ import annotations

import bisect
import functools
import inspect

import torch

from torchjax._compat.torch import pytree


def bucket_for(n: int, buckets) -> int:
    """The smallest bucket size >= ``n`` (``buckets`` sorted ascending)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(
            f"torchjax.bucketed: length {n} is above the largest bucket {buckets[-1]}; "
            f"add a bucket >= {n} to buckets={list(buckets)}"
        )
    return buckets[i]


def pad_to(t: torch.Tensor, dim: int, size: int, value=0) -> torch.Tensor:
    """``t`` padded at the end of ``dim`` to ``size`` with ``value``."""
    n = t.shape[dim]
    if n == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - n
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


def bucketed(
    fn=None,
    *,
    buckets,
    dim: int = 1,
    pad_values=None,
    mask="attention_mask",
    fill_mask: bool = True,
    device=None,
):
    """Call ``fn`` with the inputs' ``dim`` padded to the next of ``buckets`` and the
    outputs sliced back (Note [Shape buckets] in torchjax/compile/_buckets.py).

    Args:
        fn: a module, a function or a ``torchjax.jit`` callable; ``bucketed(buckets=...)``
            without it is a decorator.
        buckets: the sizes ``dim`` is padded to (any order; positive ints).
        dim: the dimension whose length varies (1: ``(batch, seq, ...)``).
        pad_values: ``{keyword argument name: pad value}``; other tensors pad with 0.
        mask: the keyword of the attention mask (1 keep, 0 masked), padded with 0;
            None for a function without one.
        fill_mask: pass a mask of ones padded with zeros when the call gives none.
        device: where the padded tensor arguments go (``"tpu"``: CPU batches are
            padded on the host, then moved); None leaves them where they are.

    Returns:
        A callable with ``fn``'s signature. Outputs with the bucket's size along ``dim``
        are sliced back: they equal the unpadded call's where ``fn`` keeps positions
        apart along ``dim`` or masks the padding (a causal or masked model's logits).
        Other outputs are returned as computed, over the padded inputs: a reduction
        over ``dim`` (``t.mean(1)``, an unmasked loss) includes the padding.
    """
    if fn is None:
        return functools.partial(
            bucketed,
            buckets=buckets,
            dim=dim,
            pad_values=pad_values,
            mask=mask,
            fill_mask=fill_mask,
            device=device,
        )
    sizes = sorted(set(buckets))
    if not sizes or any(not isinstance(b, int) or b <= 0 for b in sizes):
        raise ValueError(f"torchjax.bucketed: buckets must be positive ints, got {buckets!r}")
    pads = dict(pad_values or {})
    fill = fill_mask and mask is not None and _accepts(fn, mask)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
        if first is None or first.dim() <= dim:
            raise ValueError(f"torchjax.bucketed: no tensor argument has a dimension {dim} to pad")
        n = first.shape[dim]
        b = bucket_for(n, sizes)

        def pad(x, value):
            if isinstance(x, torch.Tensor) and x.dim() > dim and x.shape[dim] == n:
                x = pad_to(x, dim, b, value)
            if device is not None and isinstance(x, torch.Tensor):
                x = x.to(device)
            return x

        if fill and kwargs.get(mask) is None:
            shape = list(first.shape[: dim + 1])
            kwargs[mask] = torch.ones(shape, dtype=torch.long, device=first.device)
        args = [pad(a, 0) for a in args]
        kwargs = {k: pad(v, 0 if k == mask else pads.get(k, 0)) for k, v in kwargs.items()}
        out = fn(*args, **kwargs)
        if b == n:
            return out
        return pytree.tree_map(
            lambda y: (
                y.narrow(dim, 0, n)
                if isinstance(y, torch.Tensor) and y.dim() > dim and y.shape[dim] == b
                else y
            ),
            out,
        )

    call.buckets = tuple(sizes)
    return call


def _accepts(fn, name: str) -> bool:
    """Whether ``fn`` (a module: its forward) takes keyword ``name``."""
    target = getattr(fn, "fn", fn)  # a torchjax.jit callable: the traced code
    if isinstance(target, torch.nn.Module):
        target = target.forward
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
