"""The op table: ATen overload -> handler, filled by decorators, resolved once per overload.

Lowerings (``@lowering``) are small functions from jax arrays to jax arrays. The registry
builds a handler around each, reading the overload's schema once (ops/schema.py):

- functional overloads (ops/functional.py): tpu tensors unwrapped to jax arrays (0-d
  CPU tensors and Python numbers are scalars, any other CPU tensor is an error naming
  both devices, CUDA's rule), type promotion as torch's ``ELEMENTWISE_TYPE_PROMOTION_KIND``
  says (ops/promotion.py), the lowering run as one cached executable (ops/cached_compute.py);
- view ops (the schema's return aliases ``self``, ops/views.py): the result shares
  ``self``'s storage, its sizes/strides/offset computed by running the same op on a meta
  tensor;
- in-place (``op_``) and ``out=`` overloads (ops/writeback.py): derived from the
  functional sibling, checked with torch's casting rule, written back through the
  storage (views see the write);
- everything without a lowering: torch's decomposition where ops/decompositions.txt
  names the overload, then CompositeImplicitAutograd, else ``NotImplementedError``
  naming the overload and args.

Note [The eager hot path]
An op on tpu tensors costs what the jax call costs plus a few microseconds, because
everything that can be decided once is: ``JaxTensor.__torch_dispatch__`` swaps x64 on
(Note [x64 without touching the user's JAX]) and looks the overload up in ``_HANDLERS``
(the dict it shares with this module); the handler was built once per overload from its
schema; a lowering runs as one cached jax.jit executable (Note [Compiled lowerings] in
torchjax/ops/cached_compute.py) whose key comes from the argument types (promotion results are
cached per dtype signature); the result is wrapped from its shape and dtype (``wrap``
caches contiguous metadata per shape), never from device data, so dispatch stays async.
View ops cache the layout the meta-tensor run gives per (base layout, arguments), and
layout-only views compute no value at all (Note [Lazy views]).
Measure any addition here with ``python bench/eager_overhead.py`` (add 1x1 against raw
``jnp.add``): on a 2-core CPU the whole path is about 10 us over a jitted jax call.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from torchjax._compat.torch import (
    ELEMENTWISE_TYPE_PROMOTION_KIND,
    OpOverload,
    OpOverloadPacket,
    has_composite_implicit_kernel,
)
from torchjax.ops import (
    _cpu_generator,
    decompositions,
    dtype_refusals,
    functional,
    schema,
    views,
    writeback,
)
from torchjax.tensor import _tensor
from torchjax.tensor._errors import describe_args

aten = torch.ops.aten
Kind = ELEMENTWISE_TYPE_PROMOTION_KIND


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One registered lowering and the policy the registry applies around it."""

    fn: Callable
    promote: Kind | None = None
    promote_args: tuple[str, ...] | None = None
    cpu_tensors: bool = False  # accept non-0-d CPU tensors (index arguments)
    # fn is a handler: it takes torch-level (args, kwargs) and does everything itself
    is_handler: bool = False
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
    # a CPU ``generator=`` runs the overload (and its in-place and out= siblings) on CPU
    # (Note [CPU draws keep the layout] in torchjax/ops/_cpu_generator.py)
    cpu_generator: bool = False


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
    cpu_generator=False,
):
    """Register ``fn`` as the jax lowering of ``ops`` (overloads or whole packets).

    ``fn`` receives the op's arguments with tensors as jax arrays (promoted to the
    computation dtype when ``promote`` is given) and returns arrays (or tuples/lists of
    arrays). In-place and ``out=`` overloads of a registered functional op need no
    registration of their own: the registry derives them (see module docstring).

    ``fn`` runs traced, as one cached ``jax.jit`` executable per static signature (see
    Note [Compiled lowerings] in torchjax/ops/cached_compute.py), unless ``jit=False``: pass it
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
    ``cpu_generator``: a call given a CPU ``generator=`` runs the overload on CPU
    (Note [CPU draws keep the layout] in torchjax/ops/_cpu_generator.py); ``fn`` never
    sees one.
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
                cpu_generator=cpu_generator,
            ),
        )
        return fn

    return deco


def handler(*ops, cpu_generator=False):
    """Register ``fn(args, kwargs)`` taking torch-level arguments (tensors unwrapped by
    the handler itself). For ops whose semantics are about tensors, not arrays: copies,
    device transfers, metadata changes. ``cpu_generator`` as for ``lowering``."""

    def deco(fn):
        _register(ops, Lowering(fn, is_handler=True, cpu_generator=cpu_generator))
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
    checked_scalars=(),
    cpu_tensors=False,
):
    """The registry's functional handler for ``fn`` as a lowering of ``func``, for a
    ``@handler`` that checks something at the torch level, or chooses among lowerings,
    and then lowers as usual. ``deterministic``: ``fn`` draws no random key though
    ``func`` is a random op (its dropout-free path), so it may be compiled (Note
    [Compiled lowerings]); ``cpu_tensors`` as for ``lowering``."""
    entry = Lowering(
        fn,
        promote,
        tuple(promote_args) if promote_args else None,
        cpu_tensors,
        deterministic=deterministic,
        round_scalars=tuple(round_scalars),
        checked_scalars=tuple(checked_scalars),
    )
    return functional.make_handler(func, entry)


# overload -> checks run before its handler (``precheck``).
_PRECHECKS: dict[OpOverload, list[Callable]] = {}


def precheck(*ops):
    """Register ``fn(args, kwargs)``, run before the handler of ``ops`` (overloads or whole
    packets) on every call, and so before the in-place overloads that run a functional
    sibling's handler: a torch-level check of the arguments (a divisor that is a Python
    number is read on the host), the lowering left to compute. Costs one dict lookup per
    overload when its handler is built; none for other ops."""

    def deco(fn):
        for op in ops:
            for ov in _overloads(op):
                _PRECHECKS.setdefault(ov, []).append(fn)
                _HANDLERS.pop(ov, None)
        return fn

    return deco


def _prechecked(func, h):
    checks = _PRECHECKS.get(func)
    if not checks:
        return h

    def prechecked_handler(args, kwargs):
        for check in checks:
            check(args, kwargs)
        return h(args, kwargs)

    return prechecked_handler


def register_pointwise(op, fn, *, promote: Kind) -> None:
    """Register a 1:1 elementwise op family (``op`` packet) lowered to ``fn``."""
    _register([op], Lowering(lambda *a, **k: fn(*a, **k), promote))


# ---------------------------------------------------------------------------------------
# dispatch


def dispatch(func, args, kwargs):
    return _handler_for(func)(args, kwargs)


_tensor._dispatch = dispatch


def has_lowering(func) -> bool:
    return func in _LOWERINGS


def runs_sibling(func) -> bool:
    """Whether ``func``, an in-place or ``out=`` overload without a lowering, runs its
    functional sibling's handler (before any decomposition of its own)."""
    sibling = schema.functional_sibling(func)
    return sibling is not None and _resolvable(sibling)


def _resolve(func):
    entry = _LOWERINGS.get(func)
    sch = func._schema
    if entry is not None:
        if entry.is_handler:
            return entry.fn
        if schema.is_view(sch):
            return views.view_handler(func, entry)
        if schema.out_names(sch):
            return writeback.out_handler(func, functional.make_handler(func, entry, strip_out=True))
        if schema.is_inplace(sch):
            return writeback.inplace_handler(func, functional.make_handler(func, entry))
        return functional.make_handler(func, entry)
    if runs_sibling(func):
        sibling = schema.functional_sibling(func)
        sib_handler = _handler_for(sibling)
        if schema.out_names(sch):
            return writeback.out_handler(func, sib_handler)
        if schema.is_inplace_view(func, sibling):
            return writeback.inplace_view_handler(sib_handler)
        return writeback.inplace_handler(func, sib_handler)
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
        h = _HANDLERS[func] = _prechecked(func, dtype_refusals.guarded(func, _routed(func)))
    return h


def _routed(func):
    """``_resolve(func)``, calls with a CPU generator sent to CPU where the lowering of
    ``func`` (or of its functional sibling) asks for it."""
    h = _resolve(func)
    entry = _LOWERINGS.get(func)
    if entry is None and runs_sibling(func):
        entry = _LOWERINGS.get(schema.functional_sibling(func))
    if entry is not None and entry.cpu_generator:
        return _cpu_generator.routed(func, h)
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
