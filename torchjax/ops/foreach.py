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
tensor lists the whole foreach op runs as one cached jax.jit (Note [Compiled foreach]).

The fused optimizer kernels are in ops/fused_optim.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax._compat.torch import all_op_schemas
from torchjax.device import _checks
from torchjax.ops import executables, fused_reads, traced_scalars
from torchjax.ops import fused as _fused
from torchjax.ops.functional import cpu_to_jax
from torchjax.ops.pointwise_binary import exact_div
from torchjax.ops.pointwise_ternary import fma
from torchjax.ops.promotion import promoted_by_key
from torchjax.ops.registry import Kind, handler
from torchjax.ops.templates import ARRAY, SEQ, Seq, float_masked, rebuild, signature, static
from torchjax.ops.writeback import write_into
from torchjax.tensor import dtypes
from torchjax.tensor._tensor import JaxTensor, wrap

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
    compiled_run = _CompiledForeach(
        func, base, inplace, bind, run, listed, lead, per_element, numbers
    )
    if inplace:

        def inplace_fn(args, kwargs):
            compiled_run(args, kwargs)

        return inplace_fn
    return compiled_run


# ---------------------------------------------------------------------------------------
# compiled foreach
#
# Note [Compiled foreach]
# A ``_foreach_*`` op on float tpu tensors runs as one executable over its lists instead
# of one op per tensor, through the overload's table of executables (Note [One executable
# table] in torchjax/ops/executables.py), as single ops do. Its template is built of the
# same entries (torchjax/ops/templates.py): a tensor list is a ``Seq`` of ``ARRAY``
# (``None`` for a missing element), a number list a ``Seq`` of ``ARRAY`` too, and the
# ``scalars`` tensor of addcmul/addcdiv one ``ARRAY`` split per element inside. The traced
# function wraps the list elements (tracers) in tpu tensors and runs the same
# per-element ATen ops as the eager path (so promotion, casting rules and errors are the
# per-element ops' own), then the in-place results are written back to the real tensors
# (views see them, as in eager). Per-call values are arguments, not constants, so the
# executable is reused step after step:
# - a ``Scalar[]`` list (torch.optim's per-parameter bias corrections, different every
#   step) becomes 0-d float64/int64 tensors, taking the per-element ops' ``.Tensor``
#   overloads; a 0-d tensor promotes exactly as the Python number it holds does when
#   the list tensors are floating and have dimensions (same category: the tensor's
#   dtype wins); a 0-d list element would promote with it as a peer (float32 and a
#   float64 0-d tensor give float64), so such an element is seen as a 1-element view;
# - addcmul/addcdiv take their ``value`` as a Scalar that the lowering inspects, so with
#   a ``Scalar[]`` (or the ``scalars`` tensor) they compute ``self + value * (t1 op t2)``
#   in the computation dtype here: what their lowering computes for float tensors
#   (``value * x`` is exact when value is 1, so skipping that shortcut changes nothing).
# - a single Python ``float`` (AdamW's ``1 - lr * weight_decay``, ``lerp``'s ``1 - beta1``
#   and SGD's ``alpha=-lr``, each new every step under a schedule), or a traced one (a
#   ``torch.SymFloat`` of a torch.compile graph), is a float64 0-d value too, when every
#   list tensor is real floating: the traced function hands the
#   per-element ops a ``torch.SymFloat`` over it (Note [Traced Python floats] in
#   torchjax/ops/traced_scalars.py), which promotes and computes as the Python float
#   does. A per-element op that needs the number itself (``pow``'s exponent selects a
#   kernel) raises ``NeedsValue`` while tracing, and the overload takes its single floats
#   as static values from then on, each a key (op by op after ``MAX_FLOAT_VARIANTS``, as
#   for single ops: Note [Python floats as values of an op's program]).
# ints, bools and floats of other lists stay static. A single 0-d floating tensor
# (``_foreach_mul_.Tensor``'s ``other``: clip_grad_norm_'s clip coefficient) is an array
# argument, a tensor again inside. Integer/bool lists, CPU tensors in the lists and
# ``.out`` overloads take the eager path, each per-element op on its own (counted as
# ``op_by_op`` of the overload in ``torchjax.stats()["ops"]``).
#
# Note [Recorded foreach ops]
# In fused eager mode (Note [Fused eager] in torchjax/ops/fused.py) a compiled foreach
# call is recorded as one node of the thread's segment, whatever the lists' length, as a
# single op's executable is: the same executable, its function replayed inside the
# segment's program. List elements whose values are recorded (gradients from backward,
# the state a previous foreach op wrote) enter as their ``Pending`` values (a view of one
# through a recorded read), not read, so the segment goes on; the results are tensors
# holding pending values, and an in-place op writes them into its tensors as a recorded
# in-place single op does (``fused.write``; a view of another tensor through
# ``writeback.write_into``, which runs the segment). torch.optim's foreach AdamW step is
# then 8 nodes whatever the number of parameters, where its single-tensor loop recorded
# 8 per parameter. Calls under a user's trace are not recorded (Note [Nothing is
# recorded under a trace]): the executable runs inlined.

_FLOATING = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128}
)
_REAL_FLOATING = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


class _CompiledForeach:
    """``run(args, kwargs)`` of one ``_foreach_*`` overload through cached executables
    (Note [Compiled foreach]); ``eager`` is the per-element run."""

    def __init__(self, func, base, inplace, bind, eager, listed, lead, per_element, numbers):
        self.func, self.base, self.inplace = func, base, inplace
        self.bind, self.eager, self.listed, self.lead = bind, eager, listed, lead
        self.per_element = per_element
        self.addc = base in ("addcmul", "addcdiv")
        self.orders = base in ("maximum", "minimum")
        self.check_number = _NUMBER_CHECKS.get(base)
        self.numbers = numbers
        self.table = executables.Executables(func)
        self.info = self.table.info
        # Set once a trace needed a single float's number: static floats from then on.
        # A norm's order selects its computation (linalg_vector_norm reads it as a
        # number, which a traced float is not): static from the start.
        self.floats_static = base in ("norm", "powsum")
        self.keys: set = set()
        self.eager_keys: set = set()
        executables.register(self)

    def clear(self):
        with self.table.lock:
            self.table.clear()
            self.keys, self.eager_keys = set(), set()

    def _op_by_op(self, args, kwargs):
        """The per-element run (counted: ``op_by_op`` of ``torchjax.stats()["ops"]``)."""
        self.info.op_by_op += 1
        return self.eager(args, kwargs)

    def __call__(self, args, kwargs):
        bound, kw = self.bind(args, kwargs)
        lead = bound.get(self.lead)
        if not lead or (self.orders and any(t.is_complex() for t in lead)):
            # Complex maximum/minimum: torch's error depends on the overload the
            # per-element op takes (clamp for numbers), which eager keeps.
            return self._op_by_op(args, kwargs)
        n = len(lead)
        # Note [Recorded foreach ops]
        recording = _fused.ACTIVE[0] and _fused.recording()
        dyn, tmpl = [], []
        traced_floats = not self.floats_static and all(
            t is None or t.dtype in _REAL_FLOATING for t in lead
        )
        for k, v in bound.items():
            if type(v) is float and traced_floats:
                # A value of the program (Note [Compiled foreach]).
                dyn.append(np.asarray(v, np.float64))
                tmpl.append(ARRAY)
                continue
            if k in self.listed:
                if k in self.numbers and self.check_number is not None:
                    for t, x in zip(lead, v):
                        self.check_number(x, t.dtype)
                entry = self._list_entry(v, n, dyn, recording)
            elif isinstance(v, torch.Tensor):
                entry = _one_tensor_entry(v, dyn, recording)
            elif v.__class__ is torch.SymFloat:
                entry = _traced_float_entry(v, dyn, traced_floats)
            else:
                entry = static(v)
            if entry is None:
                return self._op_by_op(args, kwargs)
            tmpl.append(entry)
        if self.inplace and _aliased(lead, [bound.get(k) for k in self.listed if k != self.lead]):
            # Sequential semantics: element i may read what element j < i wrote.
            return self._op_by_op(args, kwargs)
        kwtmpl = []
        for k, v in kw.items():  # after the positional ones in ``dyn``
            if type(v) is float and traced_floats:
                dyn.append(np.asarray(v, np.float64))
                kwtmpl.append((k, ARRAY))
            elif v.__class__ is torch.SymFloat:
                entry = _traced_float_entry(v, dyn, traced_floats)
                if entry is None:
                    return self._op_by_op(args, kwargs)
                kwtmpl.append((k, entry))
            else:
                kwtmpl.append((k, static(v)))
        kwtmpl = tuple(kwtmpl)
        key = (tuple(tmpl), kwtmpl)
        try:
            run_key = (key, signature(dyn))
            run = self.table.get(run_key)
        except TypeError:  # an unhashable argument
            return self._op_by_op(args, kwargs)
        if run is None:
            run = self._new_run(key, run_key, tuple(bound))
            if run is None:
                return self._op_by_op(args, kwargs)
        index = lead[0]._device_index
        try:
            if recording:
                # One node of this thread's segment for the whole lists (Note [Recorded
                # foreach ops]).
                results = _fused.record(run, dyn)
                if results is not _fused.NOT_RECORDED:
                    return self._recorded(lead, results, index)
            results = _checks.finish(executables.call(run, dyn))
        except traced_scalars.NeedsValue:
            # A per-element op needs a single float's number: static floats from now on.
            self._forget(key, remember=False)
            self.floats_static = True
            return self(args, kwargs)
        except executables.CONCRETE_ERRORS:
            # A per-element lowering reads values (raised while tracing): op by op.
            self._forget(key, remember=not _traced(dyn))
            return self._op_by_op(args, kwargs)
        self.info.calls += 1
        if not self.inplace:
            return [wrap(r, index) for r in results]
        for t, r in zip(lead, results):
            t._write(r)
        return None

    def _recorded(self, lead, results, index):
        """The results of a recorded call: new tensors holding the pending values, or
        (in-place) the pending values written into ``lead``: a whole tensor takes its
        pending value; the others (a view) are written as a recorded single op's result
        is (``writeback.write_into``: the segment runs), once every value is held by a
        tensor, so the run computes them all."""
        if not self.inplace:
            return [_fused.wrap(p, index) for p in results]
        rest = [(t, p) for t, p in zip(lead, results) if not _fused.write(t, p)]
        outs = [(t, _fused.wrap(p, index)) for t, p in rest]
        for t, out in outs:
            write_into(self.func, t, out, check_cast=False)
        return None

    def _new_run(self, key, run_key, names):
        """The executable of a new (key, input signature), or None: op by op."""
        tmpl = key[0]
        with self.table.lock:
            if key in self.eager_keys:
                return None
            if key not in self.keys:
                masked = (
                    tuple(float_masked(e) for e in tmpl),
                    tuple((k, float_masked(e)) for k, e in key[1]),
                )
                if not self.table.new_float_variant(masked):
                    return None
                self.keys.add(key)
                self.info.keys += 1
        return self.table.add(run_key, self._build(names, tmpl, key[1]))

    def _forget(self, key, remember):
        with self.table.lock:
            self.table.drop_key(key)
            if key in self.keys:
                self.keys.discard(key)
                self.info.keys -= 1
            if remember and key not in self.eager_keys:
                self.eager_keys.add(key)
                self.info.eager_keys += 1

    def _list_entry(self, v, n, dyn, recording):
        """The template entry of a list argument (None: take the eager path)."""
        if isinstance(v, torch.Tensor):  # addcmul/addcdiv ``scalars``: one value per element
            if not isinstance(v, JaxTensor) or v.dtype not in _FLOATING or v.numel() != n:
                return None
            dyn.append(_value(v, recording))
            return ARRAY
        if len(v) != n:
            return None  # the eager path raises torch's length error
        first = v[0] if v else None
        if isinstance(first, torch.Tensor):
            if not all(
                t.__class__ is JaxTensor and t.dtype in _FLOATING for t in v if t is not None
            ):
                return None
            dyn.extend(_value(t, recording) for t in v if t is not None)
            return Seq(SEQ, list, tuple(_NONE if t is None else ARRAY for t in v))
        if all(type(x) in (float, int) for x in v):
            dyn.extend(np.asarray(x, np.float64 if type(x) is float else np.int64) for x in v)
            return Seq(SEQ, list, (ARRAY,) * n)
        return None

    def _build(self, names, tmpl, kwtmpl):
        per_element, addc, inplace, lead = self.per_element, self.addc, self.inplace, self.lead
        base, info, listed, numbers = self.base, self.info, self.listed, self.numbers
        tensor_lists = [j for j, k in enumerate(names) if k in listed and k not in numbers]
        lift = any(k in numbers for k in names)
        floats_as_numbers = numbers if base == "mul" and inplace else frozenset()

        def traced(*dyn):
            info.traces += 1
            it = iter(dyn)
            lists = {}
            for k, entry in zip(names, tmpl):
                value = rebuild(entry, it)
                if entry == _ONE_TENSOR:
                    lists[k] = wrap(value[0])
                elif k not in listed:
                    # ARRAY outside the lists: a single float made a value.
                    lists[k] = traced_scalars.traced(value) if entry is ARRAY else value
                elif entry is ARRAY:  # a tensor holding one value per element
                    lists[k] = [wrap(value[i]) for i in range(value.shape[0])]
                elif k in floats_as_numbers:
                    # Note [In-place foreach mul rounds its number]: the numbers as floats.
                    lists[k] = [_number(a) for a in value]
                else:
                    lists[k] = [None if a is None else wrap(a) for a in value]
            kw = {}
            for k, entry in kwtmpl:
                value = rebuild(entry, it)
                kw[k] = traced_scalars.traced(value) if entry is ARRAY else value
            results = []
            for i in range(len(lists[lead])):
                pos = [lists[k][i] if k in listed else lists[k] for k in names]
                if addc and isinstance(pos[3], torch.Tensor):
                    results.append(_addc_dynamic(base, inplace, *pos[:3], pos[3]))
                elif lift and all(pos[j] is None or not pos[j]._size for j in tensor_lists):
                    # Number-list scalars arrive as 0-d tensors: seen by 0-d elements as
                    # 1-element views, so they promote as the Python numbers they were.
                    for j in tensor_lists:
                        pos[j] = None if pos[j] is None else pos[j].view(1)
                    out = per_element(*pos, **kw)
                    results.append(None if out is None else out.view(()))
                else:
                    results.append(per_element(*pos, **kw))
            out = lists[lead] if inplace else results
            return [t._value() for t in out], None  # (results, device checks)

        return executables.build(traced, f"{self.func._opname}_{self.func._overloadname}")


_NONE = static(None)
# A tensor argument that is not a list (``_foreach_mul_.Tensor``'s ``other``: clip_grad_norm_'s
# clip coefficient): the next executable argument, a tensor again inside the trace.
_ONE_TENSOR = Seq(SEQ, tuple, (ARRAY,))


def _value(t, recording):
    """The array of list element ``t``; while this thread records, its recorded value
    (or a recorded read of a view of one) instead of running the segment to read it
    (Note [Recorded foreach ops])."""
    if recording:
        p = fused_reads.record_read(t)
        if p is not None:
            return p
    return t._value()


def _traced_float_entry(v, dyn, traced_floats):
    """The template entry of a traced Python float (a ``torch.SymFloat`` of a compiled
    graph, Note [Traced Python floats]): a value of the program, as a single float is,
    given to the per-element ops as the same SymFloat; where single floats are static,
    None (each per-element op takes it, inside the trace)."""
    if not traced_floats:
        return None
    dyn.append(traced_scalars.value_of(v))
    return ARRAY


def _one_tensor_entry(t, dyn, recording):
    """The template entry of a single tensor argument: a 0-d floating tpu tensor (or a
    0-d CPU one, which every per-element op accepts beside tpu tensors) is an argument
    of the executable; anything else takes the eager path (None), with its errors."""
    if t.dim() != 0 or t.dtype not in _FLOATING:
        return None
    if isinstance(t, JaxTensor):
        dyn.append(_value(t, recording))
    elif t.device.type == "cpu":
        dyn.append(cpu_to_jax(t))
    else:
        return None
    return _ONE_TENSOR


def _number(a):
    """A number list's element (a 0-d float64 or int64 value) as the Python number it was:
    a traced float, or a 0-d tensor for an int."""
    return traced_scalars.traced(a) if a.dtype == jnp.float64 else wrap(a)


def _check_clamp_number(x, dtype):
    # clamp_min/clamp_max (what maximum/minimum with numbers run) read them as the
    # tensor's type, checked.
    dtypes.check_scalar_fits(x, dtype, "clamp")


def _check_pow_number(x, dtype):
    if dtypes.is_half(dtype):  # as aten::pow.Tensor_Scalar (ops/power.py)
        dtypes.check_scalar_fits(x, dtype, "pow")


# Number lists the per-element op checks on the host (the compiled path passes them as
# tensors, which nothing checks): the same check, before the executable runs.
_NUMBER_CHECKS = {
    "maximum": _check_clamp_number,
    "minimum": _check_clamp_number,
    "clamp_min": _check_clamp_number,
    "clamp_max": _check_clamp_number,
    "pow": _check_pow_number,
}


def _traced(dyn) -> bool:
    return any(isinstance(a, jax.core.Tracer) for a in dyn)


def _aliased(lead, lists) -> bool:
    """True when a written tensor shares its storage with another element of any list,
    or with its own element of another list other than as the same view (the compiled
    path reads every input before writing; eager runs element by element)."""
    owner = {}
    for i, t in enumerate(lead):
        if owner.setdefault(id(t._storage), i) != i:
            return True
    for ts in lists:
        if not isinstance(ts, (list, tuple)):
            continue
        for i, t in enumerate(ts):
            if not isinstance(t, torch.Tensor):
                continue
            j = owner.get(id(t._storage))
            if j is not None and (j != i or not _same_view(t, lead[i])):
                # Another element's memory, or this element's seen another way (a
                # shifted slice): eager runs element by element, with torch's
                # partial-overlap check.
                return True
    return False


def _same_view(a, b) -> bool:
    return a._size == b._size and a._stride == b._stride and a._offset == b._offset


def _addc_dynamic(base, inplace, self, tensor1, tensor2, value):
    """``self + value * (tensor1 op tensor2)`` with a traced ``value`` (see Note
    [Compiled foreach]): what aten::addcmul/addcdiv's lowerings compute for float
    tensors, in CPU's order (``(value * tensor1) op tensor2``, addcmul's last product
    and sum in one FMA in float32), in the computation dtype, cast to the result dtype."""
    compute, result, _ = promoted_by_key(
        Kind.DEFAULT, [(t.dtype, not t._size) for t in (self, tensor1, tensor2)]
    )
    v = value._value() if isinstance(value, JaxTensor) else value
    s, a, b = (t._value().astype(compute) for t in (self, tensor1, tensor2))
    scaled = v.astype(compute) * a
    if base == "addcdiv":
        out = s + exact_div(scaled, b)
    elif compute == jnp.float32:
        out = fma(scaled, b, s)
    else:
        out = s + scaled * b
    res = wrap(out.astype(result))
    if inplace:
        return write_into(getattr(aten, base + "_").default, self, res)
    return res


def _register_foreach():
    for schema in all_op_schemas():
        if not schema.name.startswith("aten::" + _PREFIX):
            continue
        packet = getattr(aten, schema.name.removeprefix("aten::"))
        func = getattr(packet, schema.overload_name or "default")
        handler(func)(_foreach_handler(func))


_register_foreach()
