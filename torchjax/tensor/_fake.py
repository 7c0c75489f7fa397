"""Fake tpu tensors for torch.compile: what Dynamo sees of a JaxTensor while it traces.

Note [JaxTensor under Dynamo]
Dynamo never runs user code on real tensors: it converts each input to a FakeTensor and
traces with those. A wrapper subclass is converted through ``__tensor_flatten__`` (a
"traceable wrapper subclass"): Dynamo fakes each inner tensor and rebuilds the outer
tensor with ``__tensor_unflatten__``. A JaxTensor's data is a jax array, not an inner
tensor, so it offers a *stand-in*: a plain, data-less tpu tensor of its sizes and dtype
(``torch._C._acc.create_empty_tensor``: no memory behind it). Dynamo fakes the stand-in
(a FakeTensor on device tpu, like the fakes of ``torch.zeros(3, device="tpu")`` made in
the traced code, so both mix) and ``__tensor_unflatten__`` returns a *fake JaxTensor*:
the same class, holding the fake inner tensor instead of a storage. Ops on fake JaxTensors
fail fast in the registry (there is no storage), and ``__torch_dispatch__`` hands them
here: run the op on the inner fakes (FakeTensorMode computes metadata) and wrap results
as fake JaxTensors. The backend (torchjax/compile/_dynamo.py) later runs the captured FX
graph on the real JaxTensors, compiled with torchjax.jit.
"""

from __future__ import annotations

import torch

from torchjax._compat.torch import (
    cpp_meta_kernels,
    create_empty_tensor,
    pytree,
    set_math_bits,
    set_tensor_data,
)
from torchjax.tensor import _fake_errors
from torchjax.tensor._reinterpret import stored_as
from torchjax.tensor._storage import contiguous_strides

_INNER = "_fake_inner"
DEVICE_TYPE = "tpu"


def stand_in(t) -> torch.Tensor:
    """The data-less plain tpu tensor Dynamo fakes in place of ``t``: same sizes, dtype
    and device, contiguous (Dynamo's shape guards pair the inner tensor's sizes with the
    outer's); ``t``'s own strides are restored on the fake side by ``_inner_view``."""
    s = t.__dict__.get("_stand_in_tensor")
    if s is None:
        s = create_empty_tensor(tuple(t.shape), t.dtype)
        t.__dict__["_stand_in_tensor"] = s
    return s


def is_fake(t) -> bool:
    return _INNER in t.__dict__


def inner(t) -> torch.Tensor:
    """The fake inner tensor of a fake JaxTensor."""
    return t.__dict__[_INNER]


def any_fake(args, kwargs) -> bool:
    from torchjax.tensor._tensor import JaxTensor

    return any(
        isinstance(x, JaxTensor) and _INNER in x.__dict__
        for x in pytree.arg_tree_leaves(*args, **kwargs)
    )


def make(inner: torch.Tensor, size=None, stride=None, offset=None):
    """A fake JaxTensor over the fake ``inner`` (its own metadata unless given)."""
    from torchjax.tensor._tensor import JaxTensor

    t = torch.Tensor._make_wrapper_subclass(
        JaxTensor,
        inner.shape if size is None else size,
        strides=inner.stride() if stride is None else stride,
        storage_offset=inner.storage_offset() if offset is None else offset,
        dtype=inner.dtype,
        device=inner.device if inner.device.type == "tpu" else torch.device("tpu", 0),
        requires_grad=inner.requires_grad,
    )
    # The conj / neg bits live on the TensorImpl: the outer tensor carries the inner's,
    # so composites that branch on them (``imag`` of ``z.conj()`` views the ``_conj()``)
    # take the path they take on the real tensor.
    if inner.is_conj() or inner.is_neg():
        set_math_bits(t, inner.is_conj(), inner.is_neg())
    t.__dict__[_INNER] = inner
    return t


def twin(t, mode) -> torch.Tensor:
    """The fake JaxTensor standing for the real ``t`` under the fake ``mode``."""
    return make(mode.from_tensor(stand_in(t)), t.shape, t.stride(), 0)


def unflatten(inner_tensors, ctx, outer_size, outer_stride):
    """``JaxTensor.__tensor_unflatten__``: a real JaxTensor when given its own stand-in
    back, else a fake JaxTensor over the (fake, functional or proxy) inner tensor."""
    from torchjax.tensor import _tensor

    inner = inner_tensors["_stand_in"]
    kind, ref, size, stride, offset, dtype, index = ctx
    if type(inner) is torch.Tensor and kind == "real":
        storage = None if ref is None else ref()
        if storage is None:
            raise RuntimeError(
                "torchjax: a tpu tensor was rebuilt from a flattened context "
                "(__tensor_flatten__) after its storage was freed; rebuild it while the "
                "tensor it came from is alive"
            )
        return _tensor.make(storage, size, stride, offset, dtype, index)
    return make(inner, outer_size, outer_stride, 0)


def _inner_view(t) -> torch.Tensor:
    """The fake inner tensor with ``t``'s strides, so stride-sensitive ops (``view``)
    behave as on the real tensor; a view reaching outside the contiguous stand-in's
    elements keeps the stand-in's strides (sizes and dtypes, what tracing needs, agree)."""
    inner = t.__dict__[_INNER]
    if inner.stride() != t.stride() and inner.shape == t.shape:
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
        if span <= inner.numel():
            inner = inner.as_strided(t.shape, t.stride(), inner.storage_offset())
    return inner


def dispatch(func, args, kwargs):
    """Run ``func`` on the inner fakes; in-place and out= ops return their fake outer
    argument, everything else new fake JaxTensors."""
    from torchjax.tensor._tensor import JaxTensor

    flat = pytree.arg_tree_leaves(*args, **kwargs)
    mode = (
        next(
            x.__dict__[_INNER].fake_mode
            for x in flat
            if isinstance(x, JaxTensor)
            and _INNER in x.__dict__
            and hasattr(x.__dict__[_INNER], "fake_mode")
        )
        if any(isinstance(x, JaxTensor) and not is_fake(x) for x in flat)
        else None
    )

    def unwrap(x):
        if not isinstance(x, JaxTensor):
            return x
        if _INNER in x.__dict__:
            return _inner_view(x)
        # A real tpu tensor made while tracing (FakeTensorMode evaluates constants such
        # as torch.tensor([...], device="tpu") for real): its fake twin.
        return _inner_view(twin(x, mode))

    outer = (args, kwargs)
    args, kwargs = pytree.tree_map(unwrap, args), pytree.tree_map(unwrap, kwargs)
    schema = func._schema
    before = [_layout(x) for x in _written(schema, args, kwargs)]
    own = _OWN_SHAPE_RULES.get(func)
    with _fake_errors.eager_errors(func, *outer):  # Note [Errors of ops traced with fake tensors]
        out = own(func, *args, **kwargs) if own is not None else func(*args, **kwargs)
    if schema.returns and schema.returns[0].alias_info is not None:
        if schema.returns[0].alias_info.is_write:
            targets = _written(schema, *outer)
            changed = _written(schema, args, kwargs)
            for t, inner_now, old in zip(targets, changed, before):
                if isinstance(t, JaxTensor) and is_fake(t) and _layout(inner_now) != old:
                    _relayout(t, inner_now, func, outer, len(targets) == 1)
            outer_args, outer_kwargs = outer
            name = next(a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write)
            return outer_kwargs[name] if name in outer_kwargs else outer_args[0]
        return _views_with_eager_strides(func, outer, out)
    # A copy to another device (``.cpu()``, ``.to("cpu")``) is that device's plain fake,
    # as eager gives a plain tensor there.
    return pytree.tree_map(
        lambda x: (
            make(x)
            if isinstance(x, torch.Tensor)
            and not isinstance(x, JaxTensor)
            and x.device.type == DEVICE_TYPE
            else x
        ),
        out,
    )


# Note [Fake views take eager strides]
# Where a view has a dimension of size 1, that dimension's stride is a convention, and
# torch's kernels differ on it: ATen's eager (and C++ meta) kernels give
# ``x[0].expand(1)`` stride (0,) and ``(1, 4, 3, 16, 16)`` reshaped, permuted and
# flattened to ``(1, 768, 4)`` strides (768, 1, 768), while FakeTensor's view rules, and
# the meta kernels under torch's Python dispatcher, give (1,) and (3072, 1, 768). That
# matters for inputs: Dynamo fakes an input that is a view of a traceable wrapper
# subclass by replaying its view chain on the fake base under the Python dispatcher
# (meta_utils' ``view_from_base``), then checks the fake's sizes, strides and offset
# against the real tensor's; a tpu input made by a view (diffusers' Wan timestep
# ``t.expand(1)``, LTX-2's packed latents) failed to compile with "Expected cond to be
# True". So a fake view takes the strides ATen's eager kernel gives, computed by the C++
# meta kernel on meta tensors of the real metadata; with symbolic sizes (dynamic shapes)
# it keeps torch's fake strides.
def _views_with_eager_strides(func, outer, out):
    from torchjax.tensor._tensor import JaxTensor

    eager = _eager_view(func, *outer)
    flat, spec = pytree.tree_flatten(out)
    eager_flat = pytree.tree_leaves(eager) if eager is not None else [None] * len(flat)
    wrapped = [
        make(x, stride=None if m is None else m.stride())
        if isinstance(x, torch.Tensor) and not isinstance(x, JaxTensor)
        else x
        for x, m in zip(flat, eager_flat)
    ]
    return pytree.tree_unflatten(wrapped, spec)


# Note [In-place layout changes of fakes]
# An in-place op that changes its argument's layout (``t_``, ``transpose_``,
# ``unsqueeze_``, ``squeeze_``, ``as_strided_``, ``resize_``; stft's composite ends in
# ``out.transpose_(1, 2)``) runs on the fake inner tensor, which takes the new layout;
# the fake JaxTensor around it kept its old sizes, so Dynamo saw stft's result as
# (batch, frames, freqs): a shape read in the graph was wrong, and istft of that result
# failed its frequency check. So when the inner's layout changed, the outer takes the
# layout ATen's eager kernel gives (as views do: Note [Fake views take eager strides])
# and the changed inner. (A user's own ``y.t_()`` in traced code is Dynamo's business:
# it keeps y's traced sizes, on CPU too.)
def _written(schema, args, kwargs) -> list:
    """The arguments ``schema`` writes (``self`` of an in-place op, ``out=``)."""
    return [
        kwargs[a.name] if a.name in kwargs else args[i] if i < len(args) else None
        for i, a in enumerate(schema.arguments)
        if a.alias_info and a.alias_info.is_write
    ]


def _layout(x):
    if not isinstance(x, torch.Tensor):
        return None
    return (tuple(x.shape), tuple(x.stride()), x.storage_offset())


def _relayout(t, changed, func, outer, single: bool) -> None:
    """Give the fake JaxTensor ``t`` the layout its inner tensor ``changed`` took
    (Note [In-place layout changes of fakes]); ATen's eager layout where the op writes
    one tensor and has a C++ meta kernel."""
    eager = _eager_view(func, *outer) if single else None
    m = eager if isinstance(eager, torch.Tensor) else changed
    set_tensor_data(t, make(changed, tuple(m.shape), tuple(m.stride()), m.storage_offset()))
    t.__dict__[_INNER] = changed


def _is_static(x) -> bool:
    if isinstance(x, torch.Tensor):
        return not any(
            isinstance(v, torch.SymInt) for v in (*x.shape, *x.stride(), x.storage_offset())
        )
    return not isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _to_meta(x):
    if not isinstance(x, torch.Tensor):
        return x
    # A meta base long enough for the view's offset and extent, then the view itself.
    span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()) if n > 0)
    base = torch.empty(x.storage_offset() + span, dtype=x.dtype, device="meta")
    return base.as_strided(x.shape, x.stride(), x.storage_offset())


def _eager_view(func, args, kwargs):
    """``func`` run on meta tensors with the outer (real) metadata by its C++ kernel, or
    None when some size is symbolic or there is no such kernel."""
    leaves = pytree.arg_tree_leaves(*args, **kwargs)
    if not all(_is_static(x) for x in leaves):
        return None
    with cpp_meta_kernels():
        margs, mkwargs = pytree.tree_map(_to_meta, (args, kwargs))
        try:
            return func(*margs, **mkwargs)
        except (NotImplementedError, RuntimeError):
            # A view op without a C++ meta kernel: torch's fake strides, as before.
            return None


def _grouped_mm_any_dtype(func, mat_a, mat_b, *args, **kwargs):
    # torch's meta for _grouped_mm keeps CUDA's rule that the inputs be bfloat16; the tpu
    # lowering takes every float dtype, so the shapes come from bfloat16 stand-ins and
    # the result takes the dtype torch's rule gives (out_dtype, else the inputs').
    dtype = mat_a.dtype
    if dtype == torch.bfloat16:
        return func(mat_a, mat_b, *args, **kwargs)
    out = func(mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), *args, **kwargs)
    out_dtype = kwargs.get("out_dtype", args[2] if len(args) > 2 else None)
    return out if out_dtype is not None else out.to(dtype)


# Ops whose torch meta kernel refuses what their tpu lowering computes.
_OWN_SHAPE_RULES = {torch.ops.aten._grouped_mm.default: _grouped_mm_any_dtype}


# Note [Inputs sharing a storage]
# Dynamo fakes an input that is not a view but shares its storage with another input
# (``x[:2].detach()`` and ``x[2:].detach()``, parameters over one flat buffer), or sits
# at an offset, the way torch's meta converter does for any tensor: it makes the fake,
# then points it at the shared fake storage with ``r.set_(storage, offset, size,
# stride)``, Python dispatch off. A fake JaxTensor's own TensorImpl is a tpu one, and
# torch's meta kernel refused a meta storage for it ("Attempted to set the storage of
# a tensor on device tpu:0 to a storage on different device meta"), so torch.compile
# raised InternalTorchDynamoError. ``JaxTensor.set_`` sends that call here: the fake
# takes the layout (its sizes, strides and offset) and keeps its inner fake, laid out as
# its stand-in is, as Dynamo's guards pair them (Note [Replaying a view input]). The
# fakes then do not share a storage; nothing in the backend reads that: the captured
# graph runs on the real tensors under torchjax.jit, which takes aliased arguments
# (Note [Arguments that share memory] in torchjax/compile/_aliases.py).
def set_storage(t, args, kwargs) -> bool:
    """``t.set_(storage, offset, size, stride)`` on a fake JaxTensor, given a storage of
    another device (Note [Inputs sharing a storage]); False when it is not that call."""
    names = ("source", "storage_offset", "size", "stride")
    given = dict(zip(names, args), **kwargs)
    source = given.get("source")
    if not isinstance(source, torch.UntypedStorage) or source.device.type == DEVICE_TYPE:
        return False
    size = tuple(given.get("size", t.shape))
    stride = given.get("stride")
    stride = tuple(stride) if stride else contiguous_strides(size)
    offset = given.get("storage_offset", 0)
    own = inner(t)
    set_tensor_data(t, make(own, size, stride, offset))
    t.__dict__[_INNER] = own
    return True


# Note [Replaying a view input]
# Dynamo fakes an input that is a view of a traceable wrapper subclass by replaying the
# input's view chain (autograd's view func, read through ``_view_func_unsafe``) on the
# fake of its base, and checks that the replay has the input's sizes, strides and
# offset. The chain records the view ops only: after an in-place metadata change of
# the view (``x.t_()``, ``x.squeeze_()``, ``x.as_strided_()``) it gives the old layout,
# and Dynamo raised "Expected cond to be True"; replaying ``z.conj().imag`` on a fake
# base failed in torch's conj fallback. A JaxTensor's ``_view_func_unsafe`` checks the
# replay against the tensor it describes and, where it differs or fails, builds the
# same layout as ``as_strided`` of the base seen as the view's dtype, then sets the
# view's conj / neg bits: what Dynamo does for a plain tensor's views. The replay's
# inner tensor is then a fresh one, laid out as the real view's stand-in is: Dynamo
# guards that the two agree (symbolically, once sizes are dynamic). The replay keeps the
# chain's ints as they are (``symint_visitor_fn`` is not applied).
def replay_view(t, replay, new_base, symint_visitor_fn=None, tensor_visitor_fn=None):
    """``t``'s view of ``new_base``: ``replay`` (torch's view func) where it gives
    ``t``'s layout, else ``as_strided`` (Note [Replaying a view input])."""
    try:
        # The chain's ints stay ints: Dynamo's visitor makes each a symbol with no source
        # (expected to simplify away), and one that did not, ``b[::2][1:]`` with dynamic
        # sizes, failed every guard built on it. So the view's own sizes are static:
        # a new size is a new graph (Dynamo's recompile limit then applies).
        out = replay(new_base, None, tensor_visitor_fn)
        if _same_layout(out, t):
            return _with_own_inner(out)
    except RuntimeError:
        pass
    out = stored_as(new_base, t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
    if t.is_conj():
        out = out._conj()
    if t.is_neg():
        out = out._neg_view()
    return _with_own_inner(out)


def _with_own_inner(out):
    # The replay's inner tensor is a view of the base's stand-in, at the view's offset;
    # Dynamo pairs it with the real view's own stand-in (contiguous, at offset 0) and
    # guards that the two agree. With dynamic sizes that guard is symbolic (``offset ==
    # 6 - s0`` for the second half of a ``chunk``) and failed on the frame that made it.
    # So the replayed view gets an inner tensor laid out as its stand-in is.
    if not is_fake(out):
        return out
    old = inner(out)
    fresh = old.new_empty(out.shape)
    if old.is_conj() or old.is_neg():
        set_math_bits(fresh, old.is_conj(), old.is_neg())
    out.__dict__[_INNER] = fresh
    return out


def _same_layout(a, b) -> bool:
    return (
        a.dtype == b.dtype
        and _static_equal(a.shape, b.shape)
        and _static_equal(a.stride(), b.stride())
        and _static_equal((a.storage_offset(),), (b.storage_offset(),))
        and (a.is_conj(), a.is_neg()) == (b.is_conj(), b.is_neg())
    )


def _static_equal(xs, ys) -> bool:
    # Symbolic sizes compare as equal: the replay's are the ones Dynamo wants.
    return len(xs) == len(ys) and all(
        isinstance(x, torch.SymInt) or isinstance(y, torch.SymInt) or x == y for x, y in zip(xs, ys)
    )
