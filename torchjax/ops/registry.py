"""The op table: ATen overload -> handler, filled by decorators, resolved once per overload.

Lowerings (``@lowering``) are small functions from jax arrays to jax arrays. The registry
does everything around them, reading each overload's schema once:

- unwrapping tpu tensors to jax arrays; 0-d CPU tensors and Python numbers are scalars;
  any other CPU tensor is an error naming both devices (CUDA's rule);
- type promotion declared with torch's own ``ELEMENTWISE_TYPE_PROMOTION_KIND`` and
  resolved by ``torch._prims_common.elementwise_dtypes`` (cached per dtype signature;
  ops/promotion.py);
- view ops (the schema's return aliases ``self``): the result shares ``self``'s storage,
  its sizes/strides/offset computed by running the same op on a meta tensor;
- in-place (``op_``) and ``out=`` overloads: derived from the functional sibling, checked
  with torch's casting rule, written back through the storage (views see the write);
- everything without a lowering: torch's decomposition table (``torch._decomp``), then
  CompositeImplicitAutograd, else ``NotImplementedError`` naming the overload and args.

Note [The eager hot path]
An op on tpu tensors costs what the jax call costs plus a few microseconds, because
everything that can be decided once is: ``JaxTensor.__torch_dispatch__`` swaps x64 on
(Note [x64 without touching the user's JAX]) and looks the overload up in ``_HANDLERS``
(the dict it shares with this module); the handler was built once per overload from its
schema; a lowering runs as one cached jax.jit executable (Note [Compiled lowerings] in
torchjax/ops/compiled.py) whose key comes from the argument types (promotion results are
cached per dtype signature); the result is wrapped from its shape and dtype (``wrap``
caches contiguous metadata per shape), never from device data, so dispatch stays async.
View ops cache the layout the meta-tensor run gives per (base layout, arguments), and
layout-only views compute no value at all (Note [Lazy views]).
Measure any addition here with ``python bench/eager_overhead.py`` (add 1x1 against raw
``jnp.add``): on a 2-core CPU the whole path is about 10 us over a jitted jax call.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax._compat.jax import put_host
from torchjax._compat.torch import (
    ELEMENTWISE_TYPE_PROMOTION_KIND,
    OpOverload,
    OpOverloadPacket,
    has_composite_implicit_kernel,
    set_math_bits,
)
from torchjax.ops import compiled, decompositions, fused, promotion, writeback
from torchjax.tensor import _tensor, dtypes
from torchjax.tensor._errors import describe_args
from torchjax.tensor._reinterpret import Interpretation
from torchjax.tensor._tensor import JaxTensor, view_of, wrap

aten = torch.ops.aten
Kind = ELEMENTWISE_TYPE_PROMOTION_KIND


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One registered lowering and the policy the registry applies around it."""

    fn: Callable
    promote: Kind | None = None
    promote_args: tuple[str, ...] | None = None
    cpu_tensors: bool = False  # accept non-0-d CPU tensors (index arguments)
    raw: bool = False  # fn takes torch-level (args, kwargs) and does everything itself
    jit: bool = True  # may run as a cached jax.jit executable (Note [Compiled lowerings])
    # draws no random key although the overload is tagged nondeterministic_seeded (a
    # dropout-free path of a dropout op): may be compiled
    deterministic: bool = False
    # False: fn reads only the shape and dtype of its first argument, never its values
    # (a sampler overwriting ``self``): a tensor whose array is not made yet stays so
    self_values: bool = True
    # promoted arguments whose one-element value enters the computation dtype unrounded
    # (Note [Half-precision inputs are rounded first])
    exact_scalars: tuple[str, ...] = ()
    # Python floats outside the promotion (add's alpha) rounded to the half input type,
    # as CPU's kernels read them (Note [Half-precision inputs are rounded first])
    round_scalars: tuple[str, ...] = ()
    # arguments whose Python numbers must fit the result dtype, as c10's checked_convert
    # requires where a kernel reads a Scalar as its type (where, clamp, hardtanh)
    checked_scalars: tuple[str, ...] = ()
    # False: numbers into float16/bfloat16/float8 results are not checked (where's number
    # goes through a one-element fill, which checks only the other types)
    checked_half: bool = True


_LOWERINGS: dict[OpOverload, Lowering] = {}
# Resolved handlers, shared with JaxTensor.__torch_dispatch__ (one dict lookup per op).
_HANDLERS: dict[OpOverload, Callable] = _tensor._HANDLERS


def _overloads(op) -> list[OpOverload]:
    if isinstance(op, OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def _register(ops, entry: Lowering) -> None:
    for op in ops:
        for ov in _overloads(op):
            if ov in _LOWERINGS:
                raise RuntimeError(f"torchjax: duplicate lowering registration for {ov}")
            _LOWERINGS[ov] = entry
            _HANDLERS.pop(ov, None)


def lowering(
    *ops,
    promote: Kind | None = None,
    promote_args=None,
    cpu_tensors=False,
    jit=True,
    self_values=True,
    exact_scalars=(),
    round_scalars=(),
    checked_scalars=(),
    checked_half=True,
):
    """Register ``fn`` as the jax lowering of ``ops`` (overloads or whole packets).

    ``fn`` receives the op's arguments with tensors as jax arrays (promoted to the
    computation dtype when ``promote`` is given) and returns arrays (or tuples/lists of
    arrays). In-place and ``out=`` overloads of a registered functional op need no
    registration of their own: the registry derives them (see module docstring).

    ``fn`` runs traced, as one cached ``jax.jit`` executable per static signature (see
    Note [Compiled lowerings] in torchjax/ops/compiled.py), unless ``jit=False``: pass it
    when ``fn`` runs an eager check on float/bool *values* guarded by
    ``isinstance(x, jax.core.Tracer)`` (a trace would skip the check silently). Calls
    with integer tensors are never compiled, so index checks need nothing.

    ``self_values=False``: ``fn`` uses only the shape and dtype of its first argument
    (an in-place sampler that overwrites it); the compiled path then passes none of its
    data (Note [Samplers read no values]).

    ``exact_scalars``: promoted arguments whose value, when it has one element, enters
    the computation dtype unrounded; ``round_scalars``: Python floats outside the
    promotion rounded to a half input type (Note [Half-precision inputs are rounded
    first]). ``checked_scalars``: arguments whose Python number raises when it does not
    fit the result dtype, as torch does for where and clamp (``dtypes.
    check_scalar_fits``); ``checked_half=False`` leaves float16/bfloat16/float8 results
    unchecked, as CPU's one-element fill that ``where``'s number goes through does.
    """

    def deco(fn):
        _register(
            ops,
            Lowering(
                fn,
                promote,
                tuple(promote_args) if promote_args else None,
                cpu_tensors,
                jit=jit,
                self_values=self_values,
                exact_scalars=tuple(exact_scalars),
                round_scalars=tuple(round_scalars),
                checked_scalars=tuple(checked_scalars),
                checked_half=checked_half,
            ),
        )
        return fn

    return deco


def handler(*ops):
    """Register ``fn(args, kwargs)`` taking torch-level arguments (tensors unwrapped by
    the handler itself). For ops whose semantics are about tensors, not arrays: copies,
    device transfers, metadata changes."""

    def deco(fn):
        _register(ops, Lowering(fn, raw=True))
        return fn

    return deco


def functional_handler(
    func,
    fn,
    *,
    promote: Kind | None = None,
    promote_args=None,
    deterministic=False,
    round_scalars=(),
):
    """The registry's functional handler for ``fn`` as a lowering of ``func``, for a
    ``@handler`` that checks something at the torch level and then lowers as usual.
    ``deterministic``: ``fn`` draws no random key though ``func`` is a random op (its
    dropout-free path), so it may be compiled (Note [Compiled lowerings])."""
    entry = Lowering(
        fn,
        promote,
        tuple(promote_args) if promote_args else None,
        deterministic=deterministic,
        round_scalars=tuple(round_scalars),
    )
    return _functional_handler(func, entry)


def register_pointwise(op, fn, *, promote: Kind) -> None:
    """Register a 1:1 elementwise op family (``op`` packet) lowered to ``fn``."""
    _register([op], Lowering(lambda *a, **k: fn(*a, **k), promote))


# ---------------------------------------------------------------------------------------
# dispatch


def dispatch(func, args, kwargs):
    h = _HANDLERS.get(func)
    if h is None:
        h = _HANDLERS[func] = _resolve(func)
    return h(args, kwargs)


_tensor._dispatch = dispatch


def has_lowering(func) -> bool:
    return func in _LOWERINGS


def runs_sibling(func) -> bool:
    """Whether ``func``, an in-place or ``out=`` overload without a lowering, runs its
    functional sibling's handler (before any decomposition of its own)."""
    sibling = _functional_sibling(func)
    return sibling is not None and _resolvable(sibling)


def _resolve(func):
    entry = _LOWERINGS.get(func)
    schema = func._schema
    if entry is not None:
        if entry.raw:
            return entry.fn
        if _is_view(schema):
            return _view_handler(func, entry)
        if _out_names(schema):
            return _out_handler(func, _functional_handler(func, entry, strip_out=True))
        if _is_inplace(schema):
            return _inplace_handler(func, _functional_handler(func, entry))
        return _functional_handler(func, entry)
    if runs_sibling(func):
        sibling = _functional_sibling(func)
        sib_handler = _handler_for(sibling)
        if _out_names(schema):
            return _out_handler(func, sib_handler)
        if _is_inplace_view(func, sibling):
            return _inplace_view_handler(sib_handler)
        return _inplace_handler(func, sib_handler)
    decomp = decompositions.get(func)
    if decomp is not None:
        return lambda args, kwargs: decomp(*args, **kwargs)
    impl_aten = getattr(func, "impl_aten", None) if func.namespace == "prims" else None
    if impl_aten is not None:
        # torch._prims' ops (torch._refs is written in them) carry their ATen
        # implementation: it runs on our lowerings.
        return lambda args, kwargs: impl_aten(*args, **kwargs)
    if has_composite_implicit_kernel(func):
        return lambda args, kwargs: func.decompose(*args, **kwargs)
    return _missing_handler(func)


def _handler_for(func):
    h = _HANDLERS.get(func)
    if h is None:
        h = _HANDLERS[func] = _resolve(func)
    return h


def _resolvable(func) -> bool:
    return func in _LOWERINGS or decompositions.has(func) or has_composite_implicit_kernel(func)


def _missing_handler(func):
    def missing(args, kwargs):
        raise NotImplementedError(
            f"torchjax has no lowering for {func.namespace}::{func._opname}."
            f"{func._overloadname}, called "
            f"with {describe_args(args, kwargs)}. Add one in torchjax/ops/ (see "
            "torchjax/ops/registry.py), or run this op on CPU with .cpu()."
        )

    return missing


# ---------------------------------------------------------------------------------------
# schema reading (once per overload)


def _out_names(schema) -> list[str]:
    return [
        a.name
        for a in schema.arguments
        if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
    ]


def _is_inplace(schema) -> bool:
    args = schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _is_view(schema) -> bool:
    if not schema.returns or _is_inplace(schema):
        return False
    ai = schema.returns[0].alias_info
    return ai is not None and not ai.is_write


def _functional_sibling(func):
    """The functional overload an in-place/out= overload derives from, or None."""
    schema = func._schema
    outs = _out_names(schema)
    if not outs and not _is_inplace(schema):
        return None
    name = func._opname
    if not outs:
        if not name.endswith("_"):
            return None
        name = name[:-1]
    packet = getattr(aten, name, None)
    if packet is None:
        return None
    want = [(a.name, str(a.type)) for a in schema.arguments if a.name not in outs]
    if not outs:
        want[0] = (want[0][0], "Tensor")
    for ov_name in packet.overloads():
        ov = getattr(packet, ov_name)
        if ov is func or _out_names(ov._schema) or _is_inplace(ov._schema):
            continue
        got = [(a.name, str(a.type)) for a in ov._schema.arguments]
        if got == want:
            return ov
    return None


def _is_inplace_view(func, sibling) -> bool:
    """``t_``, ``unsqueeze_``, ``as_strided_``...: in-place ops that change metadata."""
    return _is_view(sibling._schema)


# ---------------------------------------------------------------------------------------
# argument conversion


def _device_error(func, t) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, "
        f"tpu:0 and {t.device}! (in aten::{func._opname}.{func._overloadname}; move the "
        f"{tuple(t.shape)} {t.dtype} tensor with .to('tpu'); only 0-d CPU tensors are "
        "accepted as scalars)"
    )


def _cpu_to_jax(t: torch.Tensor) -> jax.Array:
    # A transfer compiles nothing (jnp.asarray compiles a copy per new shape); put_host
    # is jax.device_put's own transfer without its Python (Note [Host arrays onto a
    # device] in torchjax/_compat/jax.py).
    return put_host(dtypes.cpu_tensor_to_numpy(t))


def _unwrap(func, entry, x):
    if isinstance(x, JaxTensor):
        return x._value()
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 or entry.cpu_tensors:
            return _cpu_to_jax(x)
        raise _device_error(func, x)
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(func, entry, y) for y in x)
    return x


def _device_index(args):
    for a in args:
        if isinstance(a, JaxTensor):
            return a._device_index
    return 0


def _wrap_out(x, device_index):
    if isinstance(x, jax.Array):
        return wrap(x, device_index)
    if isinstance(x, (tuple, list)):
        return type(x)(_wrap_out(y, device_index) for y in x)
    if isinstance(x, np.ndarray):
        return wrap(jnp.asarray(x), device_index)
    if x.__class__ is fused.Pending:  # recorded, not run (Note [Fused eager])
        return fused.wrap(x, device_index)
    return x


def _compute(func, entry, strip_out):
    """fn(args, kwargs) -> jax arrays of the functional op (no wrapping): one cached
    jax.jit executable per call signature where the op allows it (Note [Compiled
    lowerings]), else the lowering run op by op."""
    eager = _eager_compute(func, entry, strip_out)
    if not compiled.compilable(func, entry):
        info = compiled.cache_info_entry(func)

        def op_by_op(args, kwargs):
            info.op_by_op += 1
            return eager(args, kwargs)

        return op_by_op
    outs = frozenset(_out_names(func._schema)) if strip_out else frozenset()
    policy = promotion.Policy(func, entry)
    return compiled.CompiledCompute(
        func, entry, outs, policy, eager, _cpu_to_jax, lambda t: _device_error(func, t)
    )


def _eager_compute(func, entry, strip_out):
    """fn(args, kwargs) -> jax arrays of the functional op, the lowering run op by op."""
    fn = entry.fn
    outs = set(_out_names(func._schema)) if strip_out else set()
    policy = promotion.Policy(func, entry)
    kind, pidx, pnames = policy.kind, policy.pidx, policy.pnames

    def compute(args, kwargs):
        if outs:
            kwargs = {k: v for k, v in kwargs.items() if k not in outs}
        jargs = [_unwrap(func, entry, a) for a in args]
        jkwargs = {k: _unwrap(func, entry, v) for k, v in kwargs.items()}
        if kind is None:
            return fn(*jargs, **jkwargs)
        vals = [args[i] for i in pidx if i < len(args) and args[i] is not None]
        vals += [v for k, v in kwargs.items() if k in pnames and v is not None]
        dts = promotion.promoted_dtypes(kind, vals)
        policy.cast_args(jargs, jkwargs, dts)
        return promotion.cast_out(fn(*jargs, **jkwargs), dts[1])

    return compute


def _functional_handler(func, entry, strip_out=False):
    compute = _compute(func, entry, strip_out)

    def functional(args, kwargs):
        out = compute(args, kwargs)
        a0 = args[0] if args else None
        index = a0._device_index if isinstance(a0, JaxTensor) else _device_index(args)
        if isinstance(out, jax.Array):
            return wrap(out, index)
        return _wrap_out(out, index)

    return functional


# Note [Lazy views]
# A view op that only re-describes the elements (same dtype, values read straight from
# the storage by size/stride/offset) does no jax work when it is called: the result is
# the new layout over ``self``'s storage, with no cached value. Its value is read when
# something needs it, and a compiled lowering reading it does the read inside its own
# executable (Note [Compiled lowerings], torchjax/ops/compiled.py), so ``x.t()`` feeding
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


def _view_handler(func, entry):
    """Sizes/strides/offset from the op run on a meta tensor; the value from the
    lowering, or read lazily from the storage (Note [Lazy views])."""
    compute = _compute(func, entry, False)
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
            meta = func(_meta_like(base), *args[1:], **kwargs)
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
    if isinstance(x, (list, tuple)):
        return (type(x),) + tuple(_hashable(y) for y in x)
    if isinstance(x, torch.Tensor):
        raise TypeError("tensor argument")
    return (type(x), x)


def _bits(t: JaxTensor):
    """(conj, neg): torch's math bits, which follow the storage's interpretation."""
    s = t._storage
    return (s.conj, s.neg) if s.__class__ is Interpretation else None


def _meta_like(t: JaxTensor) -> torch.Tensor:
    # The storage's numel is in units of t.dtype (an Interpretation counts its own), and
    # the bits travel, so torch's checks (view_as_real of a conj tensor) run on it.
    flat = torch.empty((t._storage.numel,), dtype=t.dtype, device="meta")
    meta = flat.as_strided(t._size, t._stride, t._offset)
    bits = _bits(t)
    if bits is not None:
        set_math_bits(meta, *bits)
    return meta


def _check_cast(func, result_dtype, out_dtype):
    if not torch.can_cast(result_dtype, out_dtype):
        raise RuntimeError(
            f"result type {_type_name(result_dtype)} can't be cast to the desired output "
            f"type {_type_name(out_dtype)} (in aten::{func._opname}.{func._overloadname})"
        )


def _type_name(dt) -> str:
    return dtypes.aten_type_name(dt)


def write_into(func, dst: torch.Tensor, src: JaxTensor, *, check_cast=True, resize=False):
    """Write ``src`` into ``dst`` with torch's out=/in-place rules (cast, shape)."""
    if not isinstance(dst, JaxTensor):
        raise _device_error(func, dst)
    if check_cast:
        _check_cast(func, src.dtype, dst.dtype)
    pending = fused.pending_of(src) if fused.ACTIVE[0] else None
    if pending is not None and fused.write(dst, pending):
        return dst  # recorded: the write happens at the flush (Note [Fused eager])
    arr = src._value()
    if arr.dtype != dtypes.to_jax_dtype(dst.dtype):
        arr = arr.astype(dtypes.to_jax_dtype(dst.dtype))
    if tuple(arr.shape) != dst._size:
        if resize:
            if dst.numel() != 0:
                warnings.warn(
                    f"An output with one or more elements was resized since it had shape "
                    f"{list(dst._size)}, which does not match the required output shape "
                    f"{list(arr.shape)}. This behavior is deprecated, and in a future PyTorch "
                    "release outputs will not be resized unless they have zero elements. You "
                    "can explicitly reuse an out tensor t by resizing it, inplace, to zero "
                    "elements with t.resize_(0).",
                    UserWarning,
                    stacklevel=4,
                )
            dst._resize(arr.shape)  # in its storage, as CPU: a view's base sees the write
            dst._write(arr)
            return dst
        try:
            shape = jnp.broadcast_shapes(tuple(arr.shape), dst._size)
        except ValueError:
            shape = None
        if shape != dst._size:
            raise RuntimeError(
                f"output with shape {list(dst._size)} doesn't match the broadcast shape "
                f"{list(arr.shape) if shape is None else list(shape)} "
                f"(in aten::{func._opname}.{func._overloadname})"
            )
        arr = jnp.broadcast_to(arr, dst._size)
    dst._write(arr)
    return dst


def _inplace_handler(func, functional):
    overlap = writeback.checks_overlap(func)

    def inplace(args, kwargs):
        if overlap and len(args) > 1:
            writeback.check_no_partial_overlap(func, args[:1], args[1:], kwargs)
        result = functional(args, kwargs)
        if isinstance(result, (list, tuple)):
            result = result[0]
        return write_into(func, args[0], result)

    return inplace


def _inplace_view_handler(functional_view):
    def inplace_view(args, kwargs):
        self = args[0]
        v = functional_view(args, kwargs)
        self._rebind(self._storage, v._size, v._stride, v._offset)
        return self

    return inplace_view


def _out_handler(func, functional):
    """out= overloads: torch's checks (Note [out= checks] in torchjax/ops/writeback.py),
    the functional result, then a write into each out tensor (resized if needed)."""
    names = _out_names(func._schema)
    overlap = writeback.checks_overlap(func)

    # ``Tensor(a!)[] out`` (split_with_sizes_copy, unbind_copy...): one argument holding
    # a list of tensors, one per result; such overloads return nothing.
    list_out = len(names) == 1 and not func._schema.returns

    def out(args, kwargs):
        outs = list(kwargs[names[0]]) if list_out else [kwargs[n] for n in names]
        for o in outs:
            if not isinstance(o, JaxTensor):
                raise _device_error(func, o)
        rest = {k: v for k, v in kwargs.items() if k not in names}
        if overlap:
            writeback.check_no_internal_overlap(func, outs)
            writeback.check_no_partial_overlap(func, outs, args, rest)
        meta_ok = writeback.check_out_on_meta(func, args, kwargs, names, _meta_like)
        result = functional(args, rest)
        results = result if isinstance(result, (list, tuple)) else (result,)
        exact = writeback.exact_integer_outputs(func, len(outs))
        for o, r in zip(outs, results):
            values = r.dtype.is_floating_point or r.dtype.is_complex
            if exact and not values and r.dtype != torch.bool and o.dtype != r.dtype:
                raise writeback.exact_dtype_error(func, r.dtype, o.dtype)
            write_into(func, o, r, check_cast=values and not meta_ok, resize=True)
        if list_out:
            return None
        return outs[0] if len(outs) == 1 else tuple(outs)

    return out
