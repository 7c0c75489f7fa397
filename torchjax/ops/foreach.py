"""The ``_foreach_*`` family.

``aten::_foreach_<op>`` applies ``<op>`` to each element of tensor lists. One generic
handler lowers every overload from its schema (no per-op code): ``Tensor[]`` and
``Scalar[]`` arguments are indexed per element, a ``Tensor scalars`` argument (the
``.Tensor`` overloads of addcmul/addcdiv) is read as one Python scalar per element, and
everything else is passed unchanged to the per-tensor aten op. In-place variants
(``_foreach_add_``) call the per-tensor in-place op (``aten.add_``) on each JaxTensor, so
views of the parameters see the writes and torch's casting rule applies per tensor.
``.out`` overloads write each result with the registry's out= rules.

This matches torch's ``foreach_tensor_*_slow`` kernels (ATen/native/ForeachOpsKernels.cpp),
which are what CPU runs too; the fast CUDA kernels compute the same values. On float
tensor lists the whole foreach op runs as one cached jax.jit (Note [Compiled foreach] in
torchjax/ops/foreach_compiled.py).

The fused optimizer kernels are in ops/fused_optim.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from torchjax._compat.torch import all_op_schemas
from torchjax.ops import traced_scalars
from torchjax.ops.foreach_compiled import CompiledForeach
from torchjax.ops.registry import handler
from torchjax.ops.writeback import write_into
from torchjax.tensor import dtypes

aten = torch.ops.aten

_PREFIX = "_foreach_"
_LIST_TYPES = ("List[Tensor]", "List[number]", "List[Optional[Tensor]]")


# Note [Per-element overloads]
# A packet (``aten.lerp``) picks its overload in C++, trying each schema in turn and
# formatting the arguments of every one it rejects; a tpu tensor's repr reads its
# data, so the packet read each element back to the host in eager mode and failed
# under a trace (tracers have no data), sending the whole foreach op off its compiled
# path. ``_by_kinds`` picks the overload from the arguments' kinds (tensor, number,
# None) once per combination, without formatting anything.
_NUMBER_TYPES = ("Scalar", "number", "int", "float", "bool", "complex", "SymInt")


def _kind(x) -> str:
    if isinstance(x, torch.Tensor):
        return "tensor"
    if x is None:
        return "none"
    if isinstance(x, (bool, int, float, complex, torch.SymFloat)):
        return "number"
    return "other"


def _accepts(schema_arg, kind: str) -> bool:
    t = str(schema_arg.type)
    if kind == "tensor":
        return t in ("Tensor", "Optional[Tensor]")
    if kind == "number":
        return t.removeprefix("Optional[").removesuffix("]") in _NUMBER_TYPES
    if kind == "none":
        return t.startswith("Optional[") or schema_arg.has_default_value()
    return t not in ("Tensor", "Optional[Tensor]")


def _matches(op, kinds, kw_kinds) -> bool:
    params = op._schema.arguments
    positional = [a for a in params if not a.kwarg_only]
    if len(kinds) > len(positional):
        return False
    if any(not _accepts(a, k) for a, k in zip(positional, kinds)):
        return False
    for a in positional[len(kinds) :]:
        if a.name not in kw_kinds and not a.has_default_value():
            return False
    by_name = {a.name: a for a in params}
    return all(n in by_name and _accepts(by_name[n], k) for n, k in kw_kinds.items())


def _by_kinds(packet):
    """``packet`` called through the overload its arguments' kinds select (Note
    [Per-element overloads]); the packet itself where no schema matches (its error)."""
    if not hasattr(packet, "overloads"):  # an overload or a function already
        return packet
    chosen = {}

    def call(*args, **kwargs):
        key = (tuple(_kind(a) for a in args), tuple((k, _kind(v)) for k, v in kwargs.items()))
        op = chosen.get(key)
        if op is None:
            kinds, kw_kinds = key[0], dict(key[1])
            overloads = (getattr(packet, name) for name in packet.overloads())
            op = next((o for o in overloads if _matches(o, kinds, kw_kinds)), packet)
            chosen[key] = op
        return op(*args, **kwargs)

    return call


def _addc(op):
    op = _by_kinds(op)
    return lambda self, tensor1, tensor2, value=1: op(self, tensor1, tensor2, value=value)


def _clamp_or(binary, clamp):
    # _foreach_maximum.Scalar has no per-tensor "maximum.Scalar": torch's slow kernel
    # calls clamp_min (resp. clamp_max), which also propagates NaN from self.
    binary, clamp = _by_kinds(binary), _by_kinds(clamp)

    def fn(self, other):
        return (binary if isinstance(other, torch.Tensor) else clamp)(self, other)

    return fn


# Note [In-place foreach mul rounds its number]
# CPU's in-place ``_foreach_mul_`` (``.Scalar`` and ``.ScalarList``) multiplies a float16
# or bfloat16 tensor by its number rounded to the tensor's dtype (through float, as c10
# converts a double), where ``Tensor.mul_``, the out-of-place ``_foreach_mul`` and every
# other in-place foreach op read the number in float32 (Note [Half-precision inputs are
# rounded first] in torchjax/ops/promotion.py): ``_foreach_mul_([x_bf16], 0.99)`` differed
# from CPU in about one element in ten when it ran ``mul_``. Measured against torch 2.13's
# CPU kernels; AdamW's weight decay and Adam's ``beta2`` decay take this path.
def _half_number(x, dtype):
    if isinstance(x, float):
        return float(torch.tensor(float(np.float32(x))).to(dtype))
    value = traced_scalars.value_of(x)  # a traced Python float
    return traced_scalars.traced(value.astype(jnp.float32).astype(dtypes.to_jax_dtype(dtype)))


def _mul_rounding_numbers():
    mul_ = _by_kinds(aten.mul_)

    def fn(self, other):
        if self.dtype in (torch.float16, torch.bfloat16) and isinstance(
            other, (float, torch.SymFloat)
        ):
            other = _half_number(other, self.dtype)
        return mul_(self, other)

    return fn


def _binary_out_(op):
    # maximum/minimum have no in-place overload: write through out=self (same cast check).
    return lambda self, other: op(self, other, out=self)


def _norm(self, ord=2, dtype=None):
    # aten::linalg_vector_norm's lowering does not repeat the check torch.linalg does.
    torch._check(
        self.is_floating_point() or self.is_complex(),
        lambda: (
            "linalg.vector_norm: Expected a floating point or complex tensor as input. "
            f"Got {self.dtype} (in aten::_foreach_norm)"
        ),
    )
    return aten.linalg_vector_norm(self, ord, dtype=dtype)


def _powsum(self, ord=2, dtype=None):
    return aten.sum.dim_IntList(aten.pow(aten.abs(self), ord), [], dtype=dtype)


# Per-element functional ops whose name or calling convention differs from the foreach op.
_FUNCTIONAL = {
    "addcmul": _addc(aten.addcmul),
    "addcdiv": _addc(aten.addcdiv),
    "maximum": _clamp_or(aten.maximum, aten.clamp_min),
    "minimum": _clamp_or(aten.minimum, aten.clamp_max),
    "norm": _norm,
    "powsum": _powsum,
    "max": aten.max.default,
    "zero": aten.zeros_like.default,
    "copy": aten.copy.default,
}
_INPLACE = {
    "mul": _mul_rounding_numbers(),
    "addcmul": _addc(aten.addcmul_),
    "addcdiv": _addc(aten.addcdiv_),
    "maximum": _clamp_or(_binary_out_(aten.maximum.out), aten.clamp_min_),
    "minimum": _clamp_or(_binary_out_(aten.minimum.out), aten.clamp_max_),
}


def _per_element_fn(base: str, inplace: bool):
    table, suffix = (_INPLACE, "_") if inplace else (_FUNCTIONAL, "")
    fn = table.get(base)
    if fn is None:
        fn = _by_kinds(getattr(aten, base + suffix))
    return fn


def _foreach_handler(func):
    """fn(args, kwargs) running ``func`` (a ``_foreach_*`` overload) element by element."""
    schema = func._schema
    name = func._opname
    outs = [a.name for a in schema.arguments if a.kwarg_only and a.alias_info is not None]
    inplace = name.endswith("_") and not outs
    base = name[len(_PREFIX) :].rstrip("_")
    per_element = _per_element_fn(base, inplace)
    params = [a for a in schema.arguments if a.name not in outs]
    listed = {a.name for a in params if str(a.type) in _LIST_TYPES}
    if base in ("addcmul", "addcdiv") and func._overloadname.startswith("Tensor"):
        listed.add("scalars")
    # The list that sets the length: self, except for pow.ScalarAndTensor (Scalar self).
    lead = next(a.name for a in params if str(a.type) == "List[Tensor]")
    op_name = f"aten::{name}.{func._overloadname}" if func._overloadname else f"aten::{name}"

    def bind(args, kwargs):
        bound = {}
        for i, a in enumerate(params):
            if a.kwarg_only:
                continue
            if i < len(args):
                bound[a.name] = args[i]
            elif a.name in kwargs:
                bound[a.name] = kwargs[a.name]
            elif a.has_default_value():
                # keep later positional arguments in their place
                bound[a.name] = a.default_value
        kw = {a.name: kwargs[a.name] for a in params if a.kwarg_only and a.name in kwargs}
        return bound, kw

    def run(args, kwargs):
        bound, kw = bind(args, kwargs)
        n = len(bound[lead])
        torch._check(n > 0, lambda: f"{op_name}: Tensor list must have at least one tensor.")
        for k in listed & bound.keys():
            v = bound[k]
            if isinstance(v, torch.Tensor):
                v = bound[k] = v.tolist()
            torch._check(
                len(v) == n,
                lambda k=k, v=v: (
                    f"{op_name}: Tensor lists must have the same number of elements, got "
                    f"{n} in {lead} and {len(v)} in {k}"
                ),
            )
        results = []
        for i in range(n):
            pos = [bound[k][i] if k in listed else bound[k] for k in bound]
            results.append(per_element(*pos, **kw))
        return results

    if outs:

        def out(args, kwargs):
            results = run(args, {k: v for k, v in kwargs.items() if k not in outs})
            for o, r in zip(kwargs[outs[0]], results):
                write_into(func, o, r, resize=True)

        return out
    numbers = frozenset(a.name for a in params if str(a.type) == "List[number]")
    compiled_run = CompiledForeach(
        func, base, inplace, bind, run, listed, lead, per_element, numbers
    )
    if inplace:

        def inplace_fn(args, kwargs):
            compiled_run(args, kwargs)

        return inplace_fn
    return compiled_run


def _register_foreach():
    for schema in all_op_schemas():
        if not schema.name.startswith("aten::" + _PREFIX):
            continue
        packet = getattr(aten, schema.name.removeprefix("aten::"))
        func = getattr(packet, schema.overload_name or "default")
        handler(func)(_foreach_handler(func))


_register_foreach()
