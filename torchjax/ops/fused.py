"""Fused eager mode: ops are recorded, and each segment runs as one compiled program.

Note [Fused eager]
Plain eager runs every op as its own cached executable (Note [Compiled lowerings] in
torchjax/ops/cached_compute.py): one XLA dispatch per op, with no fusion between ops. In
fused eager mode (``with torchjax.fused():``, ``TORCHJAX_EAGER=fused`` in the
environment, or ``torchjax.set_eager_mode("fused")``) an op that would call its cached
executable records the call instead, and a *segment* of such calls runs later as one
``jax.jit`` program:

- Recording. Where ``CompiledCompute`` would call ``run(*dyn)``, it appends (the
  executable's traceable function, its arguments) to this thread's segment. Real
  arrays become inputs of the segment; a ``Pending`` argument (an output of an earlier
  node of the same segment) refers to that node. The outputs are ``Pending`` values of
  the avals the op's trace gives (traced once per executable and input weak types), and
  the registry wraps them as tensors whose storage has no array yet: its ``arr`` slot
  is unset and ``lazy`` holds the ``Pending`` (the mechanism of Note [Storages filled on
  first read] in torchjax/tensor/_storage.py). Tensor metadata (shape, dtype, strides)
  is known at once, as in eager; values are not.
- Flushing. Anything that reads ``storage.arr`` of such a storage - an op that is not
  recorded (random ops, ``jit=False`` lowerings, mask indexing, ``.cpu()``, ``.item()``,
  ``print``, a partial in-place write, the autograd engine reading a saved tensor
  outside the segment's thread) - flushes the segment first and gets the real array.
  So the segment ends exactly where a value is needed, by construction; everything else
  stays recorded. A segment also ends when it reaches ``MAX_NODES`` ops, when the mode
  is turned off in this thread (``fused()`` exits), at every synchronisation point of
  device checks (``_checks.raise_pending``: ``torch.tpu.synchronize()``, a host read),
  and at the end of a backward pass that recorded ops.
- The program. A flush builds (or finds in a cache keyed by the segment's structure:
  its last step, Note [Replaying a recorded sequence] in torchjax/ops/fused_replay.py,
  which stands for every node's function and wiring, plus which outputs are still
  referenced) one
  ``jax.jit`` that replays the nodes and returns the outputs some live storage still
  holds (weak references taken at flush time) and every node's device-check outputs;
  the storages are filled, the checks queued in program order (Note [Device-side
  checks], torchjax/device/_checks.py). Intermediates nobody holds are never
  materialised: XLA fuses through them. The program is built with the same
  ``COMPILER_OPTIONS`` as the per-op executables (no excess precision), so half types
  round after every op as in eager. Programs are entries of the process-wide budget
  (Note [Executable cache budget]).
- Retracing. A segment's key is its op sequence: each node's per-op executable (itself
  keyed by overload, static arguments, shapes and dtypes: Note [Compiled lowerings]),
  where each argument comes from (a segment input or node k's output j) and the set of
  live outputs. A loop repeating the same ops on the same shapes reuses one program; a
  new shape, a new static argument, a different live set (a tensor kept that was
  dropped before) or a different cut point (a host read moved) is a new program.
  ``torchjax.stats()`` counts ``fused_ops`` recorded, ``fused_segments`` run and
  ``fused_compiles`` (program traces). In steady state recording an op makes no JAX
  call: its place in a known sequence is one dict lookup (Note [Replaying a recorded
  sequence]).
- Threads. Segments are per thread; the mode is per thread inside ``fused()`` and
  process-wide when set with the environment variable or ``set_eager_mode``. Any
  thread reading a pending value flushes the segment that holds it (under that
  segment's lock). ``fused()`` also runs ``backward()`` on the calling thread
  (``torch.autograd.set_multithreading_enabled(False)``, thread-local), so a train
  step's backward records into the same segments; a pass that recorded ops flushes at
  its end (an engine callback).
- Not recorded: calls under a user's trace (``torchjax.jit``, ``jax.jit``: tracers in
  the arguments; pending arguments are flushed first, evaluated at compile time), and
  every op not on the compiled path: those run as in eager and flush their pending
  inputs on the way.
- Errors. Shape and dtype errors are raised at the op (``eval_shape`` traces the op
  when it is recorded). Device checks (an index out of range) are raised at the next
  synchronisation point, as in eager; in immediate mode (``TORCHJAX_SYNC_CHECKS=1``)
  nothing is recorded, so they raise at the op. An op whose check eager makes at the op
  (``histc`` over the data's range) ends its segment, which runs and raises there.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

import jax
import torch
from jax import tree_util

from torchjax._compat.jax import trace_state_clean
from torchjax._compat.torch import graph_task_id as _graph_task_id
from torchjax._compat.torch import queue_engine_callback
from torchjax.device import _checks, _stats
from torchjax.ops import fused_replay as replay
from torchjax.ops import fused_run as run_segment
from torchjax.ops.fusion_cuts import cut_outputs, elementwise
from torchjax.tensor import dtypes
from torchjax.tensor._storage import Storage, contiguous_strides
from torchjax.tensor._tensor import make

# A segment runs once it holds this many ops: bounds the program size (compile time)
# and the latency before the first op of a long recorded stretch runs.
MAX_NODES = 256
_MODES = ("eager", "fused")


def _env_mode() -> bool:
    raw = os.environ.get("TORCHJAX_EAGER", "")
    if raw in ("", "eager"):
        return False
    if raw == "fused":
        return True
    raise ValueError(
        f"torchjax: environment variable TORCHJAX_EAGER={raw!r} must be 'eager' or "
        "'fused' (or unset for 'eager')"
    )


def _env_capture() -> bool:
    raw = os.environ.get("TORCHJAX_CAPTURE", "1")
    if raw not in ("0", "1"):
        raise ValueError(
            f"torchjax: environment variable TORCHJAX_CAPTURE={raw!r} must be '1' (repeated "
            "module calls in fused eager mode run as captured programs, the default) or '0'"
        )
    return raw == "1"


class _Local(threading.local):
    # Class defaults: a thread that never set them reads these, not an AttributeError
    # (``getattr(local, name, None)`` on a missing name costs about 1 us).
    mode = None
    segment = None
    capture = None


_local = _Local()
# The process-wide mode (TORCHJAX_EAGER / set_eager_mode).
_GLOBAL = [_env_mode()]
# ACTIVE[0]: some thread may be recording (the global mode, or a fused() context open
# somewhere): the one check cached_compute.py makes on its hot path.
ACTIVE = [_GLOBAL[0]]
_open = [0]
# Whether repeated module calls are captured in fused mode (Note [Captured module
# calls] in torchjax/compile/_captured.py), where no fused(capture=...) block says.
_CAPTURE = [_env_capture()]
_open_lock = threading.Lock()
_CHECKLESS = ()


# Called with True when ACTIVE turns on and False when it turns off (captured module
# calls install their patch only while fused mode may be on: Note [Captured module
# calls] in torchjax/compile/_captured.py).
_ON_ACTIVE: list = []


def on_active(hook) -> None:
    """Call ``hook(active)`` whenever ``ACTIVE[0]`` changes (and now, if it is on)."""
    _ON_ACTIVE.append(hook)
    if ACTIVE[0]:
        hook(True)


def _update_active() -> None:
    active = _GLOBAL[0] or _open[0] > 0
    if active != ACTIVE[0]:
        ACTIVE[0] = active
        for hook in _ON_ACTIVE:
            hook(active)


def recording() -> bool:
    """Whether ops on this thread are recorded (fused mode is on here)."""
    mode = _local.mode
    # Immediate device checks raise at the op: nothing is recorded meanwhile.
    return (_GLOBAL[0] if mode is None else mode) and not _checks._SYNC[0]


def capturing() -> bool:
    """Whether this thread records and captures repeated module calls (Note [Captured
    module calls] in torchjax/compile/_captured.py)."""
    capture = _local.capture
    return recording() and (_CAPTURE[0] if capture is None else capture)


def set_eager_mode(mode: str) -> None:
    """The process-wide eager mode: ``"fused"`` records ops and runs them as fused
    segments (Note [Fused eager] in torchjax/ops/fused.py), ``"eager"`` (the default)
    runs each op at once. A ``torchjax.fused()`` block overrides it in its thread."""
    if mode not in _MODES:
        raise ValueError(f"torchjax.set_eager_mode: mode must be 'eager' or 'fused', got {mode!r}")
    with _open_lock:
        _GLOBAL[0] = mode == "fused"
        _update_active()
    if not recording():
        flush_current()


def eager_mode() -> str:
    """This thread's eager mode: ``"fused"`` or ``"eager"``."""
    return "fused" if recording() else "eager"


@contextlib.contextmanager
def fused(enabled: bool = True, *, capture: bool | None = None):
    """Fused eager mode in this thread for the block (``enabled=False``: plain eager).

    Ops are recorded and run as one compiled program per segment (Note [Fused eager]
    in torchjax/ops/fused.py); results are the same as in eager. A tpu module called
    again with the same signature runs as one captured program (Note [Captured module
    calls] in torchjax/compile/_captured.py); ``capture=False`` records such calls op by
    op too (the default, None, keeps the enclosing setting: on, unless
    ``TORCHJAX_CAPTURE=0``). Nestable; on exit the previous mode is back and, if that is
    eager, the recorded ops run."""
    prev = _local.mode
    prev_capture = _local.capture
    if capture is not None:
        _local.capture = bool(capture)
    enabled = bool(enabled)
    if not enabled:
        flush_current()
    with _open_lock:
        _open[0] += 1
        _update_active()
    _local.mode = enabled
    # backward() on this thread, so that it records into this thread's segments.
    threads = torch.autograd.set_multithreading_enabled(not enabled)
    try:
        with threads:
            yield
    finally:
        _local.mode = prev
        _local.capture = prev_capture
        with _open_lock:
            _open[0] -= 1
            _update_active()
        if not recording():
            flush_current()


class Pending:
    """An output of an op recorded in ``segment``, not computed yet (the value of the
    storages in ``storages`` whose ``lazy`` is this object). ``ref``: ``-1 - j`` for the
    segment's ``j``-th output; ``out``: its ``fused_replay.Out`` (aval, shape, dtype);
    ``replaces``: the position among the segment's inputs of the array it replaced in a
    storage (Note [Fused segments donate their dead inputs])."""

    __slots__ = ("segment", "ref", "out", "aval", "shape", "dtype", "storages", "value", "error")
    __slots__ += ("replaces",)

    def __init__(self, segment, ref, out):
        self.segment, self.ref, self.out = segment, ref, out
        self.aval, self.shape, self.dtype = out.aval, out.shape, out.dtype
        self.storages: list = []
        self.value = None
        self.error = None  # why its segment failed (Note [A segment that fails as one ...])
        self.replaces = None

    @property
    def weak_type(self) -> bool:
        return self.out.weak_type

    def live(self) -> bool:
        for ref in self.storages:
            s = ref()
            if s is not None and s.lazy is self:
                return True
        return False

    def resolve(self):
        """The array (flushing the segment first)."""
        if self.value is None:
            if self.segment is not None:
                flush(self.segment)
            if self.error is not None:
                raise run_segment.lost_error(self.error) from self.error
            if self.value is None:
                raise AssertionError(
                    "torchjax fused eager: a pending value was not kept by its segment"
                )
        return self.value

    def fill(self, value) -> None:
        self.value = value
        self.segment = None
        for ref in self.storages:
            s = ref()
            if s is not None and s.lazy is self:
                s.arr = value
                s.lazy = None
        self.storages = []


class _Segment:
    __slots__ = (
        "step",
        "outs",
        "runs",
        "inputs",
        "input_ids",
        "lock",
        "closed",
        "task_flush",
        "keep",
    )

    def __init__(self):
        # Values recorded for an op still being recorded (record_read's view reads),
        # held by no storage yet: a flush meanwhile (MAX_NODES) must compute them.
        self.keep: list = []
        # The ops recorded so far (Note [Replaying a recorded sequence]).
        self.step = replay.ROOT
        self.outs: list = []  # every recorded output, in order (Pending.ref)
        # The executables recorded: steps hold their functions weakly (Note [Replaying a
        # recorded sequence]), the segment keeps them until it runs.
        self.runs: list = []
        self.inputs: list = []
        self.input_ids: dict = {}
        self.lock = threading.RLock()
        self.closed = False
        self.task_flush = False


def _segment() -> _Segment:
    seg = _local.segment
    if seg is None or seg.closed:
        seg = _local.segment = _Segment()
    return seg


def current_segment():
    """This thread's segment if it is open (recording), else None."""
    seg = _local.segment
    return None if seg is None or seg.closed else seg


def flush_current() -> None:
    """Run this thread's segment, if it holds recorded ops."""
    seg = _local.segment
    if seg is not None and not seg.closed:
        flush(seg)


def _shapes(run, dyn):
    """The outputs (``fused_replay.Out``) of ``run`` on ``dyn``, their pytree, check codes
    and how the op fuses (cached per executable and weak types)."""
    weak = tuple([getattr(d, "weak_type", False) for d in dyn])
    cache = getattr(run, "fused_shapes", None)
    if cache is None:
        cache = run.fused_shapes = {}
    hit = cache.get(weak)
    if hit is None:
        specs = [d.aval if d.__class__ is Pending else d for d in dyn]
        jaxpr, (out, checks) = jax.make_jaxpr(run.__wrapped__, return_shape=True)(*specs)
        leaves, tree = tree_util.tree_flatten(out)
        isolated = not (FUSE_ELEMENTWISE and elementwise(jaxpr.jaxpr))
        cuts = () if isolated else cut_outputs(jaxpr.jaxpr, len(leaves))
        codes = _CHECKLESS if checks is None else checks.codes
        outs = tuple(replay.Out(aval) for aval in leaves)
        single = tree_util.treedef_is_leaf(tree) and len(outs) == 1
        hit = cache[weak] = (outs, None if single else tree, codes, isolated, cuts)
    return hit


# Whether elementwise nodes fuse with each other (Note [Fusion keeps eager's numbers]);
# every other node is isolated. A tiny Llama forward and a train step once differed from
# eager in the last bit with fusion on: segments then ran under compile-time evaluation,
# where lax.platform_dependent took its default branch, so the CPU lowerings that keep
# their rounding exact (a division by a broadcast divisor, Adam's update) did not run.
# Since a segment runs as a plain call, the op-family subset, the architectures and the
# train step give eager's bits with it on.
FUSE_ELEMENTWISE = True

NOT_RECORDED = object()
# Argument classes seen that are not tracers (jax's array class, numpy scalars): one set
# lookup per argument instead of an isinstance check.
_PLAIN: set = set()

# Note [Nothing is recorded under a trace]
# A lowering may trace torch ops into its executable (bfloat16 SDPA runs torch's own
# decomposition on wrapped tracers, Note [Fused SDPA in eager]); the trace is made when
# the op is recorded, to learn its output shapes. Ops inside it whose arguments are all
# constants (a causal mask built from factories) carry no tracer, and were recorded into
# the segment: the next op mixing them with a tracer then ran the segment from inside
# the trace, cutting it in two, and the next identical forward (the executable built, no
# trace) recorded one segment: a program compiled again. Under any jax trace an op runs
# in the trace, and a recorded value it reads is resolved.


def record(run, dyn):
    """Record ``run(*dyn)`` (a per-op executable, Note [Compiled lowerings]) in this
    thread's segment and return its outputs as ``Pending`` values; or, under a user's
    trace, resolve the pending arguments in ``dyn`` and return ``NOT_RECORDED``.

    The steady state is one pass over ``dyn`` and one lookup of the op's step (Note
    [Replaying a recorded sequence] in torchjax/ops/fused_replay.py)."""
    if not trace_state_clean():
        # Note [Nothing is recorded under a trace]
        _resolve_all(dyn)
        return NOT_RECORDED
    while True:
        seg = _local.segment
        if seg is None or seg.closed:
            seg = _local.segment = _Segment()
        if seg.step.depth >= MAX_NODES:
            flush(seg)
            continue
        with seg.lock:
            if seg.closed:  # flushed by another thread meanwhile: record again
                continue
            # The wiring: 2 * i + weak type for the segment's input i (entered on first
            # sight), Pending.ref for an output recorded before.
            refs = []
            inputs, ids = seg.inputs, seg.input_ids
            for d in dyn:
                cls = d.__class__
                if cls is Pending:
                    if d.segment is not seg:
                        break
                    refs.append(d.ref)
                elif cls in _PLAIN:
                    i = ids.get(id(d))
                    if i is None:
                        i = ids[id(d)] = 2 * len(inputs) + bool(getattr(d, "weak_type", False))
                        inputs.append(d)
                    refs.append(i)
                else:
                    break
            else:
                key = (seg.step, tuple(refs))
                steps = getattr(run, "fused_steps", None)
                step = None if steps is None else steps.get(key)
                if step is None:
                    step = _new_step(run, key, dyn)
                out = _append(seg, run, step)
                if seg.keep:  # consumed by this node now
                    seg.keep = [k for k in seg.keep if all(k is not d for d in dyn)]
                refs = None
        if refs is not None:
            # Outside the lock (resolving flushes another segment): a value of another
            # segment or one already run, an argument class not seen yet, or a tracer.
            if not _prepare(seg, dyn):
                return NOT_RECORDED
            continue
        codes = step.codes
        if codes and _checks.at_op(codes):
            # A check eager makes at the op: the segment runs now (keeping this op's
            # outputs, which no storage holds yet) and raises it here (Note [Device-side
            # checks]).
            seg.keep.extend(tree_util.tree_leaves(out))
            flush(seg)
        return out


def _prepare(seg, dyn) -> bool:
    """Resolve the values in ``dyn`` that are pending in another segment than ``seg`` (or
    were run already) and learn the argument classes that are not tracers; False, and
    every pending value resolved, when one is a tracer (Note [Nothing is recorded under
    a trace])."""
    for i, d in enumerate(dyn):
        cls = d.__class__
        if cls is Pending:
            if d.segment is not seg:
                dyn[i] = d.resolve()  # another thread's segment, or already run
        elif cls not in _PLAIN:
            if isinstance(d, jax.core.Tracer):
                _resolve_all(dyn)
                return False
            _PLAIN.add(cls)
    return True


def _new_step(run, key, dyn):
    """The step of ``run`` wired as in ``key`` after ``key[0]``: its outputs traced (once
    per executable and weak types, ``_shapes``), entered as an edge of ``run``."""
    outs, tree, codes, isolated, cuts = _shapes(run, dyn)
    node = (weakref.ref(run.__wrapped__), key[1], codes, isolated, cuts)
    return replay.add(run, key, replay.Step(key[0], node, outs, tree, codes))


def _append(seg, run, step):
    base = -1 - seg.step.count
    outs = [Pending(seg, base - k, o) for k, o in enumerate(step.outs)]
    seg.outs += outs
    seg.runs.append(run)
    seg.step = step
    _stats.FUSED.ops += 1
    if not seg.task_flush and _graph_task_id() != -1:
        # Recorded inside backward(): the pass flushes at its end.
        seg.task_flush = True
        queue_engine_callback(lambda: flush(seg))
    return outs[0] if step.tree is None else tree_util.tree_unflatten(step.tree, outs)


def _resolve_all(dyn) -> None:
    for i, d in enumerate(dyn):
        if d.__class__ is Pending:
            with jax.ensure_compile_time_eval():
                dyn[i] = d.resolve()


def flush(seg) -> None:
    """Run ``seg`` as one program; fill the storages still holding its outputs and
    queue its device checks (Note [Fused eager])."""
    with seg.lock:
        if seg.closed:
            return
        seg.closed = True
        keep = {id(p) for p in seg.keep}
        live = [p for p in seg.outs if p.live() or id(p) in keep]
        step = seg.step
        if not live and not step.checked:
            for p in seg.outs:
                p.segment = None
            return
        refs = tuple([p.ref for p in live])
        # The segment's list of its inputs is theirs alone from here: the reference
        # counts of the donation read it (Note [Fused segments donate their dead inputs]).
        inputs, runs = seg.inputs, seg.runs
        seg.inputs, seg.input_ids, seg.runs = [], {}, []
        try:
            values, checks = run_segment.run(step, live, refs, inputs, runs)
        except BaseException as e:
            run_segment.lost(seg.outs, e)
            raise
        _stats.FUSED.segments += 1
        for p, v in zip(live, values):
            p.fill(v)
        for p in seg.outs:
            p.segment = None
    for codes, (bads, vals) in zip(step.checked, checks):
        _checks.add_collected(codes, bads, vals)


def is_pending(x) -> bool:
    return x.__class__ is Pending


def wrap(p: Pending, device_index: int = 0):
    """A new tpu tensor whose storage's value is ``p`` (computed at the flush)."""
    out = p.out
    size = out.shape
    s = Storage.made_later(size, p, out.numel)
    p.storages.append(weakref.ref(s))
    dtype = out.torch_dtype
    if dtype is None:
        dtype = dtypes.to_torch_dtype(out.dtype)  # raises its TypeError
    return make(s, size, out.strides, 0, dtype, device_index)


def pending_of(t):
    """The ``Pending`` value of tpu tensor ``t`` if it is one, whole (its storage in its
    own shape, contiguous) and this thread records; else None."""
    lazy = t._storage.lazy
    if lazy.__class__ is Pending and recording() and whole(t):
        return lazy
    return None


def whole(t) -> bool:
    """Whether ``t`` views its whole storage, contiguously, in the storage's shape."""
    return t._storage.covers(t._size, t._stride, t._offset) and t._stride == contiguous_strides(
        t._size
    )


def write(dst, p: Pending) -> bool:
    """Write pending ``p`` into the whole of ``dst`` (same shape and dtype) without
    running it; False when that is not such a write (the caller writes eagerly)."""
    s = dst._storage
    if (
        s.__class__ is not Storage
        or tuple(p.shape) != dst._size
        or not s.covers(dst._size, dst._stride, dst._offset)
        or dst._stride != contiguous_strides(dst._size)
        or p.dtype != dtypes.to_jax_dtype(dst.dtype)
        or p.segment is None
    ):
        return False
    lazy = s.lazy
    if lazy is None:
        if type(getattr(s.arr, "sharding", None)).__name__ == "NamedSharding":
            return False  # Note [Writes keep the placement]: write eagerly
        i = p.segment.input_ids.get(id(s.arr))
        if i is not None and p.replaces is None:
            p.replaces = i >> 1
        s.lazy = p  # before the array goes: a reader in another thread sees one of them
        del s.arr
    elif lazy.__class__ is not Pending:
        return False
    elif lazy.segment is p.segment and p.replaces is None:
        p.replaces = lazy.replaces  # the array a value written before replaced
    s.lazy = p
    p.storages.append(weakref.ref(s))
    s.version += 1
    dst._cache, dst._cache_version = None, -1
    return True


# The before-sync hook of device checks: pending checks of recorded ops join the queue
# before it is read.
_checks.BEFORE_SYNC.append(flush_current)
