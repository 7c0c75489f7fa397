"""Compiled lowerings: an ATen op on tpu tensors runs as one cached ``jax.jit`` executable.

Note [Compiled lowerings]
A lowering is a small jax function, but run op by op it costs one jax dispatch per
primitive inside it: ``layer_norm`` is about ten (mean, subtract, square, mean, rsqrt,
multiply, ...), and even ``add`` is three (two ``broadcast_to`` and ``lax.add``), each
going through jax's Python ``apply_primitive`` (about 13 us for ``lax.add`` alone on
CPU, where a jitted call takes about 5 us through jax's C++ fast path). So the registry
runs every eligible lowering, together with the promotion casts around it, as one
``jax.jit`` executable:

- The key is the overload plus the *static* part of the call: the computation and
  result dtypes of the promotion, and every argument that is not an array - ints,
  floats (by bit pattern: ``-0.0`` and ``0.0`` differ), bools, dtypes, strings, None,
  int lists - together with its Python type (``1``, ``1.0`` and ``True`` are three
  keys). Arrays (tpu tensors, 0-d CPU tensors, lists of tensors) are the executable's
  arguments, so jax's own jit cache handles their shapes and dtypes. A Python scalar in
  a promoted position (``x * 0.5``) becomes a 0-d array of the computation dtype and is
  an argument too, so a changing scalar does not recompile; so does a float in a
  ``Scalar`` position that is not promoted (Note [Python floats as values of an op's
  program]). A view whose value has not
  been read (Note [Lazy views] in torchjax/ops/views.py) enters as its storage's
  array, its layout (storage numel, size, stride, offset) in the key, and is read inside
  the executable, where XLA fuses the read (a transpose into a dot, a slice into an add).
- One executable per key and input signature (the shapes and dtypes of the arrays),
  kept in the overload's table of executables (Note [One executable table] in
  torchjax/ops/executables.py, which foreach ops share): built on first use, an entry of
  the process-wide budget, counted by ``cache_info``. A static float that changes
  every call (one the lowering needs as a number) would compile every call: after
  ``MAX_FLOAT_VARIANTS`` keys that differ only in float values, such calls run op by op.
- Tracers pass through: under ``torchjax.jit`` (tpu tensors holding tracers) calling
  the cached ``jax.jit`` function inlines it into the outer trace.
- The fast path: a call without keyword arguments whose arguments are tpu tensors,
  Python numbers in promoted positions and plain static values (numbers elsewhere, None,
  dtypes, lists of ints) finds its executable in one dict lookup keyed by each tensor's
  (dtype, size) when its value is at hand, or (dtype, layout) for a view still to read
  (passed as its storage's array and, where the read takes it, its offset), each number's
  exact type and each static value's template entry (``fast_keys.call_key``, equal to
  ``fast_keys.key`` of the executable's template), skipping the template; it
  determines the full key, so it never finds another call's executable.
  A tensor whose storage holds a value recorded in fused eager mode is looked up the
  same way. A list of tensors whose values are at hand (or None), such as ``cat``'s
  inputs or an index list, is keyed by each one's (dtype, size), its arrays passed in
  order. Anything else (keyword arguments, random ops, views or masks in a list, tensors
  whose array is not made yet) builds the template. Half the ops of a transformer
  forward take a view (a reshape, a transpose, a slice of the rotary cache).

Views whose storage grows every step (``generate``'s ids, a growing KV cache): Note
[Views in keys whose shapes vary] and Note [Views of a growing storage] in
torchjax/ops/view_signatures.py. A small ``x.to(dtype)`` not made yet enters an
elementwise executable as its source: Note [Conversions read by their consumers] in
torchjax/ops/deferred_casts.py.

Every dtype is compiled: float32/64, bfloat16, float16, float8, every int, bool and
complex. Value checks of integer inputs (index out of range, division by zero) are device
checks (Note [Device-side checks], torchjax/device/_checks.py): traced, they become two
more outputs of the executable, queued without a read and raised at the next sync.

Half types and XLA's numerics (why an executable gives op-by-op's numbers):
- XLA may keep float16/bfloat16 intermediates in float32 inside a fusion ("excess
  precision"), skipping the rounding torch does after every op (``div(..., "trunc")``
  rounds the quotient before truncating). Executables are built with it off
  (``COMPILER_OPTIONS``). Checked bit for bit on every finite float16 and bfloat16 value
  (tests/ops/test_cached_compute.py), compiled against op by op.
- XLA:CPU flushes float32 subnormals (FTZ/DAZ), and computes bfloat16 arithmetic in
  float32, so a bfloat16 subnormal can be flushed; op by op a compare against a scalar
  is its own program with the scalar as an array operand and flushes, where the same
  compare inside a larger program against a constant does not (frexp of bfloat16 1e-40
  differed; tests/ops/test_long_tail.py). One compute path removes that split. float16
  subnormals are float32 normals: unaffected. (A torch-vs-jax difference that remains
  for both paths: a bfloat16 subnormal *divisor* is flushed by XLA:CPU, not by torch.)

Not compiled (run op by op), decided per overload once, or per call:
- random ops (tagged ``nondeterministic_seeded``) called with a CPU ``generator=`` or
  inside an outer trace (Note [Compiled random ops], torchjax/ops/_seeded.py; every other
  call takes its key as an argument), and ops with data-dependent output shapes (``index`` and
  ``index_put`` are compiled unless a bool/uint8 mask is among the indices);
- lowerings registered with ``jit=False``: their eager checks read values;
- a key whose first trace fails with a concretization error (the lowering reads a value
  with ``bool()``/``int()``, or returns a Python value) or ``NeedsValues`` (a value check
  not written as a device check asked for values with ``_checks.concrete``): remembered,
  then op by op.

Caches are changed under the table's lock (two threads dispatching one overload);
lookups take none. Counters: ``torchjax.stats()`` (Note [Eager engine counters]).

Async dispatch is kept: nothing here reads device data; the executable's outputs are
wrapped from their shapes and dtypes (the avals), without waiting for the computation.

Note [Python floats as values of an op's program]
torch.optim computes Python floats that change every step and passes them to ops as
``Scalar`` arguments that are not promoted: Adam's step size (``p.addcdiv_(m, d,
value=-step_size)``), SGD's learning rate under a schedule (``p.add_(g, alpha=-lr)``),
OneCycleLR's momentum (``m.lerp_(g, 1 - beta1)``). As static values each new number
was a new key, one XLA compilation per op, parameter shape and step (0.1 to 1 s each on
a TPU) until ``MAX_FLOAT_VARIANTS``, then the op ran op by op for good. So a Python
``float`` in a ``Scalar`` (or ``Scalar?``) position outside the promoted ones is a value
of the program: a float64 0-d argument (``promotion.scalar_argument``), given to the
lowering as a weakly typed jax scalar, which every lowering of such an argument already
takes (Note [Traced Python floats] in torchjax/ops/traced_scalars.py). It is the number
the static value was: a lowering casts it to the tensors' dtype as it cast the Python
float (``scale_by``, ``lerp``), round to nearest either way; checked as torch checks
it (add's alpha against the result type) on the host, every call, as promoted numbers
are. ints and bools stay static (they select kernels: ``alpha=1``), and so do
``float`` arguments (dropout's ``p``, an ``eps``: lowerings read them as numbers).

Where a number is needed, the key takes its floats as static values again
(``float_static``, decided once per key): a result or computation dtype that is not a
real floating type (integer arithmetic converts a float Scalar by rules that read it;
complex ``alpha`` goes through ``complex()``), an op without promotion whose tensors are
not all real floating, or a trace that fails with the value traced (a lowering branching
on it). Such calls build the template twice; they are rare.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax import _budget
from torchjax._compat.jax import plain_eager
from torchjax.device import _checks
from torchjax.device._stats import cache_info, cache_info_entry  # noqa: F401 (public here)
from torchjax.ops import _seeded, executables, fast_keys, fused_nodes, promotion, view_signatures
from torchjax.ops import fused as _fused
from torchjax.ops import fused_reads as _fused_reads
from torchjax.ops.deferred_casts import Cast, Consumers
from torchjax.ops.executables import CONCRETE_ERRORS
from torchjax.ops.templates import (
    ARRAY,
    ASTYPE,
    FLOAT,
    SCALARS,
    SEQ,
    SHAPE,
    VIEW,
    Astype,
    Seq,
    Shape,
    View,
    float_masked,
    has_view,
    rebuild,
    signature,
    static,
)
from torchjax.tensor import dtypes
from torchjax.tensor._storage import _plan, contiguous_strides, read_strides
from torchjax.tensor._tensor import JaxTensor

# Keys of one overload that read a view inside (their layouts are part of the key): a
# loop whose views change layout every step (a growing KV cache) would compile a new
# key every step; past this many, views are read first (one executable) and the op
# uses its plain key.
MAX_VIEW_KEYS = 16
MAX_VIEW_SIGNATURES = view_signatures.MAX_VIEW_SIGNATURES

_INTEGER_DTYPES = frozenset(
    {
        torch.uint8,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
    }
)
_default_dtype = torch.get_default_dtype
_F64 = np.dtype(np.float64)
# Schema types of the arguments whose Python floats are values of the program (Note
# [Python floats as values of an op's program]).
_TRACED_TYPES = frozenset({"number", "Optional[number]"})


def _real_float(dtype) -> bool:
    """Whether ``dtype`` (torch or numpy/JAX) is a real floating type."""
    if isinstance(dtype, torch.dtype):
        return dtype.is_floating_point
    return jnp.issubdtype(dtype, jnp.floating)


class NotCompilable(Exception):
    """This call runs op by op (an unhashable static argument, a lowering returning a
    Python value, a check that needs concrete values: ``_checks.NeedsValues``)."""


_TRACE_ERRORS = (NotCompilable, _checks.NeedsValues, *CONCRETE_ERRORS)
_NO_KEY = object()  # a key not built (dtypes may be None: a key without promotion)


_aten = torch.ops.aten
# Overloads whose output shape is data-dependent only for bool/uint8 mask indices
# (torch tags ``index.Tensor`` dynamic for them): calls with integer indices alone are
# compiled, calls with a mask run op by op.
_MASK_INDEXED = frozenset(
    {_aten.index.Tensor, _aten.index_put.default, _aten._index_put_impl.default}
)
_MASK_DTYPES = fast_keys.MASK_DTYPES


def compilable(func, entry) -> bool:
    """Whether ``func``'s lowering may be compiled at all (decided once per overload)."""
    tags = func.tags
    return (
        entry.jit
        and (torch.Tag.dynamic_output_shape not in tags or func in _MASK_INDEXED)
        and torch.Tag.data_dependent_output not in tags
    )


def _array(storage):
    """``storage.arr``, or its pending value while this thread records (Note [Fused
    eager] in torchjax/ops/fused.py): reading ``arr`` would run the segment."""
    lazy = storage.lazy
    if lazy is not None and lazy.__class__ is _fused.Pending and _fused.recording():
        return lazy
    return storage.arr


def _check_outputs(out):
    if out is None or isinstance(out, (jax.Array, np.ndarray)):
        return
    if isinstance(out, (tuple, list)):
        for o in out:
            _check_outputs(o)
        return
    raise NotCompilable


class CompiledCompute:
    """``compute(args, kwargs)`` for one overload through cached executables, falling
    back to ``eager(args, kwargs)`` (the op-by-op compute) when a call is not compiled.

    ``policy`` is the overload's promotion (``promotion.Policy``); ``unwrap_cpu(x)`` turns
    an accepted CPU tensor into a jax array; ``device_error(x)`` builds the error for a
    CPU tensor that is not accepted (the registry's functions).
    """

    def __init__(self, func, entry, outs, policy, eager, unwrap_cpu, device_error):
        self.func = func
        self.fn = entry.fn
        self.kind = entry.promote
        self.cpu_ok = entry.cpu_tensors
        self.outs = outs
        self.policy = policy
        self.pidx = frozenset(policy.pidx)
        self.pnames = policy.pnames
        self.eager = eager
        self.unwrap_cpu, self.device_error = unwrap_cpu, device_error
        # Python numbers in promoted positions are checked on the host, every call;
        # static ones once, in the trace (a failed trace caches nothing).
        self.checked = policy.checks_promoted_numbers()
        # key -> its (computation, result) dtypes; (key, input signature) -> executable
        # in the table.
        self.cache: dict = {}
        self.table = executables.Executables(func)
        self.info = self.table.info
        # Held while the caches are changed (a new key, a forgotten one).
        self.lock = self.table.lock
        # Calls whose arguments are all plain tpu tensors (no kwargs): keyed by their
        # (dtype, size) pairs alone, the common case, checked first.
        self.tensor_cache: dict = {}
        self.eager_keys: set = set()
        self.view_keys = 0
        self.view_signatures = view_signatures.ViewSignatures(self.lock)
        self.casts = Consumers(self.kind, self._build, _TRACE_ERRORS)
        self.masks = func in _MASK_INDEXED
        # Random ops take their key as an argument (Note [Compiled random ops]).
        self.seeded = not entry.deterministic and _seeded.seeded(func)
        self.shape_only_self = not entry.self_values
        # Positions and names of the floats passed as values (Note [Python floats as
        # values of an op's program]); keys that take them static instead.
        scalar_args = [
            (i, a.name)
            for i, a in enumerate(func._schema.arguments)
            if str(a.type) in _TRACED_TYPES and i not in self.pidx
        ]
        self.tidx = frozenset(i for i, _ in scalar_args)
        self.tnames = frozenset(n for _, n in scalar_args)
        self.tchecked = frozenset(n for _, n in scalar_args if n in policy.checked)
        self.float_static: set = set()
        executables.register(self)

    def clear(self):
        with self.lock:
            self.table.clear()
            self.cache, self.tensor_cache = {}, {}
            self.eager_keys = set()
            self.float_static = set()
            self.view_keys = 0
            self.view_signatures = view_signatures.ViewSignatures(self.lock)
            self.casts = Consumers(self.kind, self._build, _TRACE_ERRORS)

    def _entry(
        self, x, dyn, psig, scalars, promoted, read_views=False, read_casts=True, floats=None
    ):
        """The template entry of argument ``x``; appends its arrays to ``dyn``, its
        promotion key to ``psig`` (if ``promoted``) and the index in ``dyn`` of a Python
        scalar to cast to ``scalars``. ``read_views``: a view enters as its value;
        ``read_casts``: a deferred conversion may enter as its source; ``floats``: where
        a Python float is a value of the program, the list of their indices in ``dyn``
        (Note [Python floats as values of an op's program])."""
        if isinstance(x, JaxTensor):
            if self.masks and x.dtype in _MASK_DTYPES:
                raise NotCompilable  # a mask index: data-dependent shape
            if promoted:
                psig.append((x.dtype, not x._size))
            storage = x._storage
            if x._cache_version == storage.version:
                dyn.append(x._cache)
                return ARRAY
            size, stride, offset = x._size, x._stride, x._offset
            if storage.covers(size, stride, offset) and stride == contiguous_strides(size):
                lazy = storage.lazy
                if lazy.__class__ is Cast and read_casts and plain_eager():
                    # Converted inside (Note [Conversions read by their consumers]).
                    dyn.append(lazy.src)
                    return Astype(ASTYPE, lazy.dtype, lazy.src.dtype)
                arr = _array(storage)
                if arr.__class__ is not _fused.Pending:
                    # The value _value() would read: kept, so the next call of this
                    # tensor takes __call__'s fast path (a new tensor's array is made
                    # lazily and never read through _value()).
                    x._cache, x._cache_version = arr, storage.version
                dyn.append(arr)
                return ARRAY
            if read_views or self.view_keys >= MAX_VIEW_KEYS:
                # A view of a recorded value is read by a recorded node (Note [Fused eager]).
                arr = _fused_reads.record_read(x) if _fused.ACTIVE[0] else None
                dyn.append(x._value() if arr is None else arr)
                return ARRAY
            # A view not read yet (Note [Lazy views]): the read joins this executable,
            # its offset an argument where it can be (Note [View offsets as arguments]).
            arr = _array(storage)
            dyn.append(arr)
            # Inside a trace the offset stays a constant of the read (Note [View offsets
            # inside a trace] in torchjax/tensor/_view_plans.py).
            if _plan(storage.numel, size, stride, offset).dynamic and not isinstance(
                arr, jax.core.Tracer
            ):
                dyn.append(np.int32(offset))
                # Keyed by the layout alone (Note [Views of a growing storage] in
                # torchjax/ops/view_signatures.py).
                return View(VIEW, None, size, read_strides(size, stride), None)
            return View(VIEW, storage.numel, size, stride, offset)
        if isinstance(x, torch.Tensor):
            if x.dim() != 0 and not self.cpu_ok:
                raise self.device_error(x)
            if self.masks and x.dtype in _MASK_DTYPES:
                raise NotCompilable
            dyn.append(self.unwrap_cpu(x))
            if promoted:
                psig.append((x.dtype, x.dim() == 0))
            return ARRAY
        if promoted and isinstance(x, SCALARS):
            psig.append(type(x))
            scalars.append(len(dyn))
            dyn.append(x)
            return ARRAY
        if floats is not None and x.__class__ is float:
            floats.append(len(dyn))
            dyn.append(x)
            return FLOAT
        if x.__class__ is torch.SymFloat:
            raise NotCompilable  # a traced Python float: op by op, inside the trace
        if isinstance(x, (list, tuple)):
            return Seq(
                SEQ,
                type(x),
                tuple(self._entry(y, dyn, psig, scalars, False, read_views, read_casts) for y in x),
            )
        return static(x)

    def __call__(self, args, kwargs):
        if not kwargs and not self.seeded:
            # The fast path: one lookup keyed by the arguments alone (``fast_keys``).
            found = fast_keys.call_key(args, self.pidx, self.masks, self.tidx)
            run = None if found is None else self.tensor_cache.get(found[0])
            if run is not None:
                _, vals, scalars, floats = found
                if scalars:
                    compute_dt = run.dts[0]
                    for j in scalars:
                        if self.checked:
                            self.policy.check_number(vals[j], run.dts[1])
                        vals[j] = promotion.scalar_argument(vals[j], compute_dt)
                if floats:
                    # Positional floats are checked by position's name in _float_args.
                    self._float_args(vals, floats, run.dts, self._checked_positions(args))
                try:
                    _budget.touch(run)
                except KeyError:  # evicted by another thread just now
                    pass
                try:
                    if _fused.ACTIVE[0] and _fused.recording():
                        out = _fused.record(run, vals)
                        if out is not _fused.NOT_RECORDED:
                            return out
                    out = executables.call(run, vals)
                except _TRACE_ERRORS:
                    # A new shape whose trace needs values: _call forgets the key.
                    return self._call(args, kwargs)
                self.info.calls += 1
                return _checks.finish(out, vals)
        return self._call(args, kwargs)

    def _op_by_op(self, args, kwargs, reserved=None):
        self.info.op_by_op += 1
        if self.seeded and _seeded.usable(args, kwargs):
            # The keys the compiled call would draw, with the counter value it reserved if
            # it got that far (Note [Random ops compiled or not]).
            return _seeded.as_compiled(self.eager, args, kwargs, reserved)
        return self.eager(args, kwargs)

    def _checked_positions(self, args):
        """Whether a positional float of ``args`` is one torch checks (``tchecked``)."""
        if not self.tchecked:
            return False
        names = self.policy.names
        return any(
            a.__class__ is float and i in self.tidx and names[i] in self.tchecked
            for i, a in enumerate(args)
        )

    def _float_args(self, dyn, floats, dts, checked):
        """In place: the floats at ``floats`` in ``dyn`` as float64 0-d arguments, checked
        against the result dtype first where torch checks them (``checked``)."""
        for j in floats:
            if checked and dts is not None:
                self.policy.check_number(dyn[j], dts[1])
            dyn[j] = promotion.scalar_argument(dyn[j], _F64)

    def _floats_ok(self, key, psig, args, kwargs) -> bool:
        """Whether ``key`` may take its floats as values of the program (Note [Python
        floats as values of an op's program]); remembered when not."""
        if key in self.float_static:
            return False
        if self.kind is not None:
            dts = self.cache.get(key, _NO_KEY)
            if dts is _NO_KEY:
                dts = promotion.promoted_by_key(self.kind, psig)
            ok = all(_real_float(np.dtype(d)) for d in dts[:2])
        else:
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            ok = bool(tensors) and all(_real_float(t.dtype) for t in tensors)
        if not ok:
            with self.lock:
                self.float_static.add(key)
        return ok

    def _call(
        self, args, kwargs, read_views=False, read_casts=True, reserved=None, static_floats=False
    ):
        if kwargs and self.outs:
            kwargs = {k: v for k, v in kwargs.items() if k not in self.outs}
        dyn, psig, scalars = [], [], []
        # Indices in dyn of the floats passed as values; None: every float static.
        floats = None if static_floats or not self.tidx else []
        tidx, tnames = self.tidx, self.tnames
        pidx, pnames, entry = self.pidx, self.pnames, self._entry
        # A random op's conversions are made first: its draw is not elementwise, so one
        # read inside would only be refused and the call made again.
        rv, rc = read_views, read_casts and not self.seeded
        try:
            shape_only = (
                self.shape_only_self and args and isinstance(args[0], JaxTensor) and 0 not in pidx
            )
            # A small draw at its power-of-two bucket (Note [Random draws in size buckets]).
            drawn = (
                _seeded.bucket(self.func, args[0]._size)
                if shape_only and self.seeded and not _fused.ACTIVE[0]
                else None
            )
            tmpl = tuple(
                [
                    Shape(
                        SHAPE,
                        a._size if drawn is None else (drawn,),
                        dtypes.to_jax_dtype(a.dtype),
                    )
                    if shape_only and i == 0
                    else entry(
                        a, dyn, psig, scalars, i in pidx, rv, rc, floats if i in tidx else None
                    )
                    for i, a in enumerate(args)
                ]
            )
            kwtmpl = (
                tuple(
                    [
                        (
                            k,
                            entry(
                                v,
                                dyn,
                                psig,
                                scalars,
                                k in pnames,
                                rv,
                                rc,
                                floats if k in tnames else None,
                            ),
                        )
                        for k, v in kwargs.items()
                    ]
                )
                if kwargs
                else ()
            )
            if self.seeded:
                if not _seeded.usable(args, kwargs):
                    return _seeded.one_key_per_op(self._op_by_op, args, kwargs)
                if reserved is None:
                    reserved = _seeded.key_args(args)
                dyn.extend(reserved)
            key = (tuple(psig), tmpl, kwtmpl, _default_dtype())
            run_key = (key, signature(dyn))
            run = self.table.get(run_key)
        except (NotCompilable, TypeError):
            # TypeError: an unhashable static argument (no key to cache under).
            return self._op_by_op(args, kwargs, reserved)
        if run is None:
            if floats and not self._floats_ok(key, psig, args, kwargs):
                return self._call(args, kwargs, read_views, read_casts, reserved, True)
            if not read_views and self.view_signatures.varying(key, tmpl, kwtmpl, run_key[1]):
                return self._call(args, kwargs, True, read_casts, reserved, static_floats)
            built = self.casts.build(key, tmpl, kwtmpl, psig, dyn, scalars, floats) if rc else None
            if built is False and floats:
                # Its trace may need a float's value (a lowering that reads it as a
                # number): static floats first, before its conversions are made.
                return self._call(args, kwargs, read_views, read_casts, reserved, True)
            if built is False:  # not elementwise: its conversions are made first
                return self._call(args, kwargs, read_views, False, reserved, static_floats)
            dts = self.cache.get(key, _NO_KEY)
            if dts is _NO_KEY:
                dts = self._new_key(key, tmpl, kwtmpl, psig)
                if dts is _NO_KEY:
                    return self._op_by_op(args, kwargs, reserved)
            run = self._new_run(
                run_key, built or self._build(tmpl, kwtmpl, dts), tmpl, dts, args, kwargs
            )
        dts = run.dts
        if scalars:
            # Python scalars in promoted positions: 0-d arrays of the computation dtype
            # (numpy's astype wraps out-of-range ints as torch does), passed as arguments.
            compute_dt = dts[0]
            for j in scalars:
                if self.checked:
                    self.policy.check_number(dyn[j], dts[1])
                dyn[j] = promotion.scalar_argument(dyn[j], compute_dt)
        if floats:
            checked = self.tchecked and (
                any(k in self.tchecked and v.__class__ is float for k, v in kwargs.items())
                or self._checked_positions(args)
            )
            self._float_args(dyn, floats, dts, checked)
        try:
            if _fused.ACTIVE[0] and _fused.recording():
                # Fused eager: recorded, run later with its segment (Note [Fused eager]).
                out = _fused.record(run, dyn)
                if out is not _fused.NOT_RECORDED:
                    return out
            out = executables.call(run, dyn)
        except _TRACE_ERRORS:
            # Raised while tracing (never by a built executable): this key runs op by op.
            # Under an outer trace the op-by-op run raises the same error, as it should,
            # so only eager failures are remembered.
            if floats:
                # First with its floats static (Note [Python floats as values of an op's
                # program]).
                self._forget(key, remember=False)
                with self.lock:
                    self.float_static.add(key)
                return self._call(args, kwargs, read_views, read_casts, reserved, True)
            self._forget(key, remember=not any(isinstance(d, jax.core.Tracer) for d in dyn))
            return self._op_by_op(args, kwargs, reserved)
        self.info.calls += 1
        if run.nbytes is None:
            self._measure(run, dyn)
        out = _checks.finish(out, dyn)
        return out if drawn is None else _seeded.cut(out, args[0]._size)

    def _new_key(self, key, tmpl, kwtmpl, psig):
        """The dtypes for a key seen for the first time, or _NO_KEY when the key runs op
        by op (Note [Compiled lowerings])."""
        with self.lock:
            dts = self.cache.get(key, _NO_KEY)
            if dts is not _NO_KEY:
                return dts
            if key in self.eager_keys:
                return _NO_KEY
            masked = (
                key[0],
                tuple(float_masked(e) for e in tmpl),
                tuple((k, float_masked(e)) for k, e in kwtmpl),
            )
            if not self.table.new_float_variant(masked):
                return _NO_KEY
            dts = self.cache[key] = (
                promotion.promoted_by_key(self.kind, psig) if self.kind is not None else None
            )
            self.info.keys += 1
            # Note [Captured traces leave the view limits alone] (fused_nodes.py)
            if fused_nodes.pred() is None and (
                any(has_view(e) for e in tmpl) or any(has_view(e) for _, e in kwtmpl)
            ):
                self.view_keys += 1
            return dts

    def _new_run(self, run_key, run, tmpl, dts, args, kwargs):
        """``run``, the executable of a new (key, input signature), entered in the budget."""
        run.dts = dts
        run.nbytes = None if _budget.measure_bytes() else 0
        fast = None if kwargs else fast_keys.key(args, tmpl, self.pidx)
        if fast is None:
            return self.table.add(run_key, run)

        def on_add():
            self.tensor_cache[fast] = run

        def on_evict():
            # The key's dtypes stay (a few tuples; a new signature reuses them).
            if self.tensor_cache.get(fast) is run:
                del self.tensor_cache[fast]

        return self.table.add(run_key, run, on_add, on_evict)

    def _measure(self, run, dyn):
        """Bytes of ``run``'s executable, once, when a byte budget is set."""
        if any(isinstance(d, jax.core.Tracer) for d in dyn):
            return
        run.nbytes = _budget.code_bytes(run, dyn)
        _budget.resize(run, run.nbytes)

    def _forget(self, key, remember):
        with self.lock:
            if self.cache.pop(key, _NO_KEY) is not _NO_KEY:
                self.info.keys -= 1
            for run in self.table.drop_key(key):
                # A new dict, not a mutation: the lock-free fast path may be reading it.
                self.tensor_cache = {k: v for k, v in self.tensor_cache.items() if v is not run}
            if remember and key not in self.eager_keys:
                self.eager_keys.add(key)
                self.info.eager_keys += 1

    def _build(self, tmpl, kwtmpl, dts):
        fn, info = self.fn, self.info
        policy = self.policy

        def compute(dyn):
            it = iter(dyn)
            jargs = [rebuild(e, it) for e in tmpl]
            jkwargs = {k: rebuild(e, it) for k, e in kwtmpl}
            if dts is None:
                out = fn(*jargs, **jkwargs)
                _check_outputs(out)
                return out
            policy.cast_args(jargs, jkwargs, dts)
            out = fn(*jargs, **jkwargs)
            _check_outputs(out)
            return promotion.cast_out(out, dts[1])

        seeded = self.seeded

        def run(*dyn):
            info.traces += 1
            # The lowering's device checks become outputs (Note [Device-side checks]).
            with _checks.collecting() as collected:
                if seeded:
                    *dyn, base, n = dyn
                    with _seeded.stream(base, n):
                        out = compute(dyn)
                else:
                    out = compute(dyn)
            return out, _checks.outputs(collected, dyn)

        return executables.build(run, f"{self.func._opname}_{self.func._overloadname}")
