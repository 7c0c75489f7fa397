"""The tape of one captured optimizer step: its foreach calls learned from a recorded
step, replayed as one program, and the fallback that runs them as recorded calls (Note
[Captured optimizer steps] in torchjax/compile/_captured_optim.py)."""

from __future__ import annotations

import functools
import threading
import weakref

import jax
import numpy as np
import torch

from torchjax import _budget
from torchjax._compat.jax import trace_state_clean, x64
from torchjax.compile._keys import value_key
from torchjax.device import _checks, _stats
from torchjax.ops import foreach_compiled as _foreach
from torchjax.ops import fused as _fused
from torchjax.ops import fused_replay, fused_run
from torchjax.ops.xla_options import COMPILER_OPTIONS
from torchjax.tensor import _tensor
from torchjax.tensor._storage import Storage
from torchjax.tensor._tensor import make

_REAL_FLOATING = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_NUMBERS = frozenset({float, int})
_NO = object()
# Parts of a call's description: (argument name, kind, what the kind needs).
_FLOAT, _NUMS, _TENSORS, _STATIC = range(4)


class Learned:
    """A learned step: ``calls`` (each foreach call's description), ``metas`` (per
    call, its results' (size, stride, dtype, device index); None in place), ``arrays``
    (the walk positions whose arrays are the program's array inputs), ``srcs`` (per
    input of the segment: (0 array, 1 float, 2 int), index), ``outputs`` (the walk
    positions it writes, in the program's output order), ``donatable`` (the positions in
    ``arrays`` of the values it writes), ``step``/``live``/``checked`` (the recorded
    segment's last step, its outputs' refs, its nodes' device-check codes), ``body`` (the
    segment function), ``runs`` (the executables its nodes replay, held), ``jitted``
    (its programs by donated positions, while the budget keeps them) and ``orders``
    (by donated positions, the order of each program's outputs: ``order``)."""

    __slots__ = ("calls", "metas", "arrays", "srcs", "outputs", "donatable", "step", "live")
    __slots__ += ("checked", "body", "runs", "jitted", "orders", "__weakref__")

    def program(self, donated: tuple):
        prog = self.jitted.get(donated)
        if prog is not None:
            _budget.hit(prog)
            return prog
        body, srcs, n = self.body, self.srcs, len(self.arrays)
        kept = [i for i in range(n) if i not in donated]
        order = self.order(donated)

        def optimizer_step(pred, given, others, floats, ints):
            # ``given``: the donated arrays (argument 1), ``others`` the rest, in order.
            arrays = [None] * n
            for i, a in zip(donated, given):
                arrays[i] = a
            for i, a in zip(kept, others):
                arrays[i] = a
            vectors = (arrays, floats, ints)
            values, checks = body(pred, *[vectors[kind][i] for kind, i in srcs])
            return [values[k] for k in order], checks

        prog = jax.jit(optimizer_step, compiler_options=COMPILER_OPTIONS, donate_argnums=(1,))
        self.jitted[donated] = prog
        ref = weakref.ref(self)

        def evict():
            learned = ref()
            if learned is not None and learned.jitted.get(donated) is prog:
                del learned.jitted[donated]

        _budget.admit(prog, evict)
        return prog

    def order(self, donated: tuple) -> list:
        """The program's outputs (positions in ``outputs``): the new value of each donated
        array first, in the donated order, so jax aliases each donated buffer with its own
        new value (it gives an output the first donated input of its shape and dtype
        left: Note [Fused segments donate their dead inputs] in
        torchjax/ops/fused_run.py); then the others."""
        order = self.orders.get(donated)
        if order is None:
            at = {i: k for k, i in enumerate(self.outputs)}
            first = [at[self.arrays[j]] for j in donated]
            taken = set(first)
            order = first + [k for k in range(len(self.outputs)) if k not in taken]
            self.orders[donated] = order
        return order

    def forget(self) -> None:
        for prog in list(self.jitted.values()):
            _budget.forget(prog)


class _Deferred:
    """The value of a storage a replayed step writes, until its program runs: read
    before, the step's calls run now (the fallback) and the read sees their result."""

    __slots__ = ("tape", "storage", "arr")

    def __init__(self, tape, storage, arr):
        self.tape, self.storage, self.arr = tape, weakref.ref(storage), arr

    def resolve(self):
        self.tape.materialise()
        return self.storage().arr


class _Placeholder:
    """The value of a result of a replayed step's call (a temporary of the step): read,
    the step's calls run now (the fallback) and it takes their result."""

    __slots__ = ("tape", "storage")

    def __init__(self, tape):
        self.tape = tape
        self.storage = None

    def resolve(self):
        self.tape.materialise()
        return self.storage().arr


def _adopt(s, real) -> None:
    """Placeholder storage ``s`` takes the value of tensor ``real`` (a new, whole one)."""
    r = real._storage
    lazy = r.lazy
    if lazy.__class__ is _fused.Pending:
        s.lazy = lazy
        lazy.storages.append(weakref.ref(s))
    else:
        s.arr = r.arr
        s.lazy = None
    s.version += 1


def _sharded(a) -> bool:
    return type(getattr(a, "sharding", None)).__name__ == "NamedSharding"


def _watch(func, args, kwargs):
    # The per-op hook while a step is captured on this thread: a compiled foreach call
    # reaches the tape; any other tpu op is foreign to the step.
    if func not in _foreach.COMPILED:
        tape = _foreach.TAPE.current
        if tape is not None:
            tape.foreign()
    return args, kwargs, None


class Tape:
    """One optimizer step being learned (``learned`` None) or replayed on this thread,
    over ``walk`` (the tensors the step may read or write, Note [Captured optimizer
    steps]); refusals go to ``caps.refuse(key)``."""

    def __init__(self, opt, caps, key, walk, learned):
        self.opt, self.caps, self.key, self.walk, self.learned = opt, caps, key, walk, learned
        self.owner = threading.get_ident()
        self.lock = threading.RLock()
        self.active = True
        self.watching = False
        self.busy = False  # a learned call running: its own ops are not foreign
        # id -> position: walk tensors (>= 0), then the step's results (-1 - n, in
        # order), held in ``results`` while the step runs, so that no id comes back.
        self.pos = dict(zip(map(id, walk), range(len(walk))))
        self.results: list = []
        self.floats: list = []
        self.ints: list = []
        self.calls: list = []
        self.metas: list = []
        self.written: set = set()
        self.seg = None
        self.arrays = None
        self.pending: list = []
        self.markers: list = []
        self.taped: list = []  # (op, description, arguments but its tensor lists)
        self.placeholders: list = []  # (storage, meta) of each replayed result

    # -- both ----------------------------------------------------------------------------
    def start(self) -> bool:
        """Set up the step before torch's Python runs; False: not captured this time."""
        walk = self.walk
        if len(self.pos) != len(walk):
            return False  # a tensor walked twice: positions would be ambiguous
        if self.learned is None:
            _fused.flush_current()  # the step records into a segment of its own
            arrays = {}
            for i, t in enumerate(walk):
                if not _fused.whole(t) or t._storage.__class__ is not Storage:
                    return False
                a = t._value()
                if id(a) in arrays or _sharded(a):
                    return False
                arrays[id(a)] = i
            self.arrays = arrays
        else:
            learned = self.learned
            # Whole tensors (the signature): their storages' arrays, not read through the
            # tensors, whose read caches would hold them (no donation).
            arrays = self.arrays = [walk[i]._storage.arr for i in learned.arrays]
            if any(map(_sharded, arrays)):
                return False
            for i in learned.outputs:
                t = walk[i]
                s = t._storage
                m = _Deferred(self, s, s.arr)
                s.lazy = m  # before the array goes: a reader sees one of them
                del s.arr
                s.version += 1
                t._cache, t._cache_version = None, -1
                self.markers.append((s, m))
        _foreach.TAPE.current = self
        _tensor.HOOK.fn = _watch
        _tensor.ARG_HOOKS[0] += 1
        self.watching = True
        return True

    def end(self) -> None:
        """Stop seeing this thread's ops (on the step's thread only)."""
        if threading.get_ident() != self.owner:
            return
        if _foreach.TAPE.current is self:
            _foreach.TAPE.current = None
        if self.watching:
            self.watching = False
            _tensor.HOOK.fn = None
            _tensor.ARG_HOOKS[0] -= 1

    def call(self, op, args, kwargs):
        """A compiled foreach call of the step (``CompiledForeach.__call__``)."""
        if self.learned is None:
            return self._learn(op, args, kwargs)
        with self.lock:
            if self.active:
                out = self._replay(op, args, kwargs)
                if out is not _NO:
                    return out
        self.end()
        return op.run(args, kwargs)

    def foreign(self) -> None:
        """Another tpu op on this thread while the step runs."""
        if not self.busy:
            self.abandon()

    def abandon(self) -> None:
        """The step does something else, raised, or another step began inside it."""
        if self.learned is None:
            self._fail()
        else:
            self.materialise()
        self.end()

    def describe(self, op, bound, kw):
        """The description of one compiled foreach call, its arguments bound; its
        numbers appended to ``floats``/``ints`` in the order ``CompiledForeach`` makes
        them inputs (Note [Compiled foreach]). None where it is not captured."""
        lead = bound.get(op.lead)
        if not lead or lead.__class__ not in (list, tuple):
            return None
        traced = not op.floats_static and all(t is None or t.dtype in _REAL_FLOATING for t in lead)
        parts = []
        for k, v in list(bound.items()) + list(kw.items()):
            if type(v) is float and traced:
                self.floats.append(v)
                parts.append((k, _FLOAT))
            elif k in op.listed and k in bound:
                part = self._list(op, k, v, lead)
                if part is None:
                    return None
                parts.append((k, *part))
            elif isinstance(v, torch.Tensor) or v.__class__ is torch.SymFloat:
                return None
            else:
                parts.append((k, _STATIC, value_key(v)))
        return (op, op.floats_static, tuple(parts))

    def _list(self, op, k, v, lead):
        if v.__class__ not in (list, tuple) or len(v) != len(lead):
            return None
        if isinstance(v[0], torch.Tensor):
            sources = tuple(map(self.pos.get, map(id, v)))
            return None if None in sources else (_TENSORS, sources)
        types = tuple(map(type, v))
        if not _NUMBERS.issuperset(types):
            return None
        if k in op.numbers and op.check_number is not None:
            for t, x in zip(lead, v):
                op.check_number(x, t.dtype)
        if float not in types:
            self.ints.extend(v)
        elif int not in types:
            self.floats.extend(v)
        else:
            for x, t in zip(v, types):
                (self.floats if t is float else self.ints).append(x)
        return (_NUMS, types)

    def _result(self, t) -> None:
        self.pos[id(t)] = -1 - len(self.results)
        self.results.append(t)

    # -- learning --------------------------------------------------------------------
    def _fail(self) -> None:
        if self.active:
            self.active = False
            self.caps.refuse(self.key)
        self.results = []
        self.end()

    def _learn(self, op, args, kwargs):
        if not self.active:
            return op.run(args, kwargs)
        bound, kw = op.bind(args, kwargs)
        spec = self.describe(op, bound, kw)
        before = _fused.current_segment()
        depth = 0 if before is None else before.step.depth
        self.busy = True
        try:
            out = op.run(args, kwargs)
        finally:
            self.busy = False
        seg = _fused.current_segment()
        if (
            spec is None
            or seg is None
            or seg is not (self.seg or seg)
            or (self.seg is None and before is not None)
            or seg.step.depth != depth + 1
        ):
            self._fail()  # not one recorded node in a segment of the step's own
            return out
        self.seg = seg
        self.calls.append(spec)
        if op.inplace:
            self.metas.append(None)
            self.written.update(s for s in map(self.pos.get, map(id, bound[op.lead])) if s >= 0)
        else:
            self.metas.append(tuple((t._size, t._stride, t.dtype, t._device_index) for t in out))
            for t in out:
                self._result(t)
        return out

    def _learned(self):
        """The ``Learned`` of the step just recorded, or None."""
        seg = self.seg
        self.results = []  # a result still referenced now is the program's to return
        if (
            not self.active
            or seg is None
            or seg is not _fused.current_segment()
            or seg.step.depth != len(self.calls)
        ):
            return None
        srcs, arrays, counts = [], [], [0, 0, 0]
        numbers = (None, self.floats, self.ints)
        for d in seg.inputs:
            if d.__class__ is np.ndarray:
                kind = 1 if d.dtype == np.float64 else 2 if d.dtype == np.int64 else 0
                k = counts[kind]
                if not kind or k >= len(numbers[kind]):
                    return None
                if value_key(d.item()) != value_key(numbers[kind][k]):
                    return None
            else:
                kind, k = 0, counts[0]
                i = self.arrays.get(id(d))
                if i is None:
                    return None
                arrays.append(i)
            srcs.append((kind, k))
            counts[kind] += 1
        if counts[1] != len(self.floats) or counts[2] != len(self.ints):
            return None
        live, pending, outputs = [], [], sorted(self.written)
        for i in outputs:
            p = self.walk[i]._storage.lazy
            if p.__class__ is not _fused.Pending or p.segment is not seg or p.ref in live:
                return None
            live.append(p.ref)
            pending.append(p)
        held = set(live)
        if any(p.ref not in held and p.live() for p in seg.outs):
            return None  # a value the program would not return is still referenced
        learned = Learned()
        learned.calls, learned.metas = tuple(self.calls), tuple(self.metas)
        learned.arrays, learned.srcs, learned.outputs = tuple(arrays), tuple(srcs), tuple(outputs)
        learned.donatable = tuple(j for j, i in enumerate(arrays) if i in self.written)
        learned.step, learned.live, learned.checked = seg.step, tuple(live), seg.step.checked
        learned.runs = list(seg.runs)
        learned.body = fused_run.segment_function(fused_replay.nodes(seg.step), live)
        learned.jitted, learned.orders = {}, {}
        self.pending = pending
        return learned

    # -- replaying -------------------------------------------------------------------
    def _replay(self, op, args, kwargs):
        learned, k = self.learned, len(self.taped)
        nf, ni = len(self.floats), len(self.ints)
        bound, kw = op.bind(args, kwargs)
        spec = self.describe(op, bound, kw)
        if k >= len(learned.calls) or spec != learned.calls[k]:
            del self.floats[nf:], self.ints[ni:]
            self._materialise()
            return _NO
        # Kept without its tensor lists, which the description names.
        lists = {name for name, kind, *_ in spec[2] if kind == _TENSORS}
        kw.update((name, v) for name, v in bound.items() if name not in lists)
        self.taped.append((op, spec, kw))
        metas = learned.metas[k]
        if metas is None:
            return None
        outs = []
        for meta in metas:
            lazy = _Placeholder(self)
            s = Storage.made_later(meta[0], lazy)
            lazy.storage = weakref.ref(s)
            t = make(s, meta[0], meta[1], 0, meta[2], meta[3])
            self._result(t)
            self.placeholders.append((s, meta))
            outs.append(t)
        return outs

    def finish(self):
        """The step's end (its optimizer's post-hook): the ``Learned`` of a learned step
        (None if refused); a replayed step's program run."""
        if self.learned is None:
            learned = self._learned() if self.active else None
            if learned is None:
                self._fail()
                return None
            self.end()
            # The recorded step runs as the learned program: the program the later steps
            # run is compiled now, in place of the segment's.
            fits = [True]
            run = functools.partial(self._run_learned, learned, fits)
            if fused_run.close_with(self.seg, self.pending, run) and fits[0]:
                _stats.CAPTURED.steps += 1
            if not fits[0]:  # its later steps would not fit either
                self.caps.refuse(self.key)
                return None
            return learned
        with self.lock:
            refs = list(map(weakref.ref, self.results))
            self.results = []
            if not self.active:
                pass
            elif len(self.taped) != len(self.learned.calls) or any(r() is not None for r in refs):
                self._materialise()  # a call missing, or a placeholder still referenced
            else:
                self._run()
        self.end()
        return None

    def _execute(self, learned, arrays):
        """The learned program on ``arrays`` (the list holding them; each written one
        held by one more reference, the deferred value's or the segment's) and this
        step's numbers: (values, checks), or None where it did not fit in device memory
        and consumed nothing. A written array held by nothing else is donated (Note
        [Fused segments donate their dead inputs] in torchjax/ops/fused_run.py)."""
        donated = tuple(i for i in learned.donatable if fused_run.donatable(arrays, i, 1))
        program = learned.program(donated)
        given = [arrays[i] for i in donated]
        others = [a for i, a in enumerate(arrays) if i not in donated]
        floats = np.asarray(self.floats, np.float64)
        ints = np.asarray(self.ints, np.int64)
        try:
            with x64(True):
                values, checks = program(fused_run.PRED, given, others, floats, ints)
        except jax.errors.JaxRuntimeError as e:
            if not fused_run.fits_op_by_op(e, arrays, donated):
                raise
            return None
        return fused_run.unordered(values, learned.order(donated)), checks

    def _run(self) -> None:
        self.end()  # a first call traces the nodes, whose ops are not the step's
        learned = self.learned
        out = self._execute(learned, self.arrays)
        if out is None:  # not in device memory: the calls run as recorded ones
            self._materialise()
            return
        values, checks = out
        for (s, m), v in zip(self.markers, values):
            m.arr = None
            if s.lazy is m:
                s.arr = v
                s.lazy = None
                s.version += 1
        self.active = False
        _stats.CAPTURED.steps += 1
        for codes, (bads, vals) in zip(learned.checked, checks):
            _checks.add_collected(codes, bads, vals)

    def _run_learned(self, learned, fits, inputs):
        # ``inputs``: the recorded segment's, its only list of them.
        arrays = [inputs[j] for j, (kind, _) in enumerate(learned.srcs) if kind == 0]
        out = self._execute(learned, arrays)
        if out is None:  # the segment as fused mode runs it (op by op if need be)
            fits[0] = False
            del arrays
            return fused_run.run(learned.step, self.pending, learned.live, inputs, learned.runs)
        return out

    def materialise(self) -> None:
        with self.lock:
            self._materialise()

    def _materialise(self) -> None:
        """The fallback: the calls taped so far run now, as recorded foreach calls, on
        the values the step started from; the signature is refused."""
        if not self.active:
            return
        self.active = False
        self.end()
        self.caps.refuse(self.key)
        for s, m in self.markers:
            if s.lazy is m:
                s.arr = m.arr
                s.lazy = None
                s.version += 1
        taped, self.taped = self.taped, []
        if trace_state_clean():
            self._run_taped(taped)
        else:
            # Read from inside a trace (a step that raised, then a torchjax.jit call):
            # the calls run on a thread of their own, concretely, not into the trace.
            worker = threading.Thread(target=self._run_taped, args=(taped,))
            worker.start()
            worker.join()

    def _run_taped(self, taped) -> None:
        held = self.results
        tensors = [
            held[j] if j < len(held) else make(s, meta[0], meta[1], 0, meta[2], meta[3])
            for j, (s, meta) in enumerate(self.placeholders)
        ]
        made = 0
        with x64(True):
            for op, spec, kwargs in taped:
                for name, kind, *part in spec[2]:
                    if kind == _TENSORS:
                        walk = self.walk
                        kwargs[name] = [walk[i] if i >= 0 else tensors[-1 - i] for i in part[0]]
                out = op.run((), kwargs)
                if not op.inplace:
                    for real in out:
                        _adopt(self.placeholders[made][0], real)
                        made += 1
