"""Compiled ``_foreach_*`` calls: one cached executable over a whole list, and one
recorded node of a fused segment (Notes [Compiled foreach], [Recorded foreach ops]).

torchjax/ops/foreach.py matches each overload's schema and hands float tensor lists to
:class:`CompiledForeach` here.
"""

from __future__ import annotations

import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax.device import _checks
from torchjax.ops import executables, foreach_donate, fused_reads, fused_run, traced_scalars
from torchjax.ops import fused as _fused
from torchjax.ops.functional import cpu_to_jax
from torchjax.ops.pointwise_binary import exact_div
from torchjax.ops.pointwise_ternary import fma
from torchjax.ops.promotion import promoted_by_key
from torchjax.ops.registry import Kind
from torchjax.ops.templates import ARRAY, SEQ, Seq, float_masked, rebuild, signature, static
from torchjax.ops.writeback import write_into
from torchjax.tensor import dtypes
from torchjax.tensor._tensor import JaxTensor, wrap

aten = torch.ops.aten

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
# recorded under a trace]): the executable runs inlined. With captured calls on, a
# repeated optimizer step records none of them: its calls are taped and the step runs as
# one program (Note [Captured optimizer steps] in torchjax/compile/_captured_optim.py).

_FLOATING = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128}
)
_REAL_FLOATING = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


class _Tape(threading.local):
    # The optimizer step this thread is capturing, if any: it sees every compiled
    # foreach call first (Note [Captured optimizer steps] in
    # torchjax/compile/_captured_optim.py).
    current = None


TAPE = _Tape()
# The overloads whose calls go through a CompiledForeach.
COMPILED: set = set()


class CompiledForeach:
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
        COMPILED.add(func)

    def clear(self):
        with self.table.lock:
            self.table.clear()
            self.keys, self.eager_keys = set(), set()

    def _op_by_op(self, args, kwargs):
        """The per-element run (counted: ``op_by_op`` of ``torchjax.stats()["ops"]``)."""
        self.info.op_by_op += 1
        return self.eager(args, kwargs)

    def __call__(self, args, kwargs):
        tape = TAPE.current
        if tape is not None:
            # An optimizer step being captured on this thread (Note [Captured optimizer
            # steps] in torchjax/compile/_captured_optim.py).
            return tape.call(self, args, kwargs)
        return self.run(args, kwargs)

    def run(self, args, kwargs):
        """The call through the overload's executables (recorded in fused eager mode),
        or element by element."""
        bound, kw = self.bind(args, kwargs)
        lead = bound.get(self.lead)
        if not lead or (self.orders and any(t.is_complex() for t in lead)):
            # Complex maximum/minimum: torch's error depends on the overload the
            # per-element op takes (clamp for numbers), which eager keeps.
            return self._op_by_op(args, kwargs)
        n = len(lead)
        lead_at = None
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
                if k == self.lead:
                    lead_at = len(dyn)
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
        if self.inplace and _aliased(lead, [v for k, v in bound.items() if k != self.lead]):
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
            donated = ()
            if self.inplace and lead_at is not None:
                # Note [In-place foreach calls donate their old values]
                donated = foreach_donate.positions(lead, dyn, lead_at)
            if donated:
                results, checks = foreach_donate.call(run, dyn, donated)
                # The new values go into the tensors before any check can raise: the
                # old ones are gone.
                for t, r in zip(lead, results):
                    t._write(r)
                self.info.calls += 1
                _checks.finish((None, checks))
                return None
            results = _checks.finish(executables.call(run, dyn))
        except jax.errors.JaxRuntimeError as e:
            if not fused_run.fits_op_by_op(e, dyn, donated):
                raise
            self._forget(key, remember=True)  # element by element from now on
            warnings.warn(
                f"torchjax: {self.func} over {n} tensors does not fit in device memory as "
                f"one program ({str(e).splitlines()[0][:200]}); it runs tensor by tensor "
                "from now on.",
                ResourceWarning,
                stacklevel=2,
            )
            return self._op_by_op(args, kwargs)
        except traced_scalars.NeedsValue:
            # A per-element op needs a single float's number: static floats from now on.
            self._forget(key, remember=False)
            self.floats_static = True
            return self.run(args, kwargs)
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
                    # Note [In-place foreach mul rounds its number] (ops/foreach.py): the
                    # numbers as floats.
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
        if isinstance(ts, JaxTensor):
            # A single tensor (``_foreach_mul_.Tensor``'s scalar) in a written tensor's
            # memory: eager raises torch's overlap error at that element, or reads the
            # value an earlier element wrote.
            if id(ts._storage) in owner:
                return True
            continue
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
