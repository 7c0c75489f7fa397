"""How a fused segment's program runs: dead inputs donated, op by op where it fails.

Note [Fused segments donate their dead inputs]
A segment's inputs are the arrays its ops read. Many are dead once it runs: the old value
of a storage the segment writes in place (a parameter, an optimizer moment: ``write``
in torchjax/ops/fused.py drops the storage's array when it records the write), a
gradient dropped by ``zero_grad()`` before the flush. Without donation XLA holds the
old and the new value of each at once, so a fused AdamW step over the whole model (one
recorded node per foreach call: Note [Recorded foreach ops]) needs the parameters,
gradients and both moments twice over, which is more than the chip has for a 1.1B
model. So at the flush an input is donated when nothing but the segment holds it
(Python's reference count: a storage, a tensor's read cache, an array taken with
``torchjax.to_jax``, a clone sharing it all count; a spurious holder costs only a
missed donation, never a deleted buffer: Note [Donation never takes the user's copy]
in torchjax/compile/_donate.py) and a live output of the segment has its shape and
dtype (jax aliases a donated buffer only to such an output; others would only warn).
Each donated input must alias its own new value: jax gives each output, in order, the
first donated input of its shape and dtype left, and outputs in the order they were
recorded gave a parameter's buffer another parameter's new value, so XLA copied whole
tensors to keep the old values it still read (a fused AdamW step held three lists of
temporaries so, on CPU as XLA reports it). So a recorded write remembers which input
array it replaced in its storage (``Pending.replaces``, passed on when a later write
replaces a value written before), and the program returns those new values first, in
the order of their inputs, the other outputs after; a dead input no output replaces is
donated only after every replaced one of its shape and dtype, to an output left. Only
single-device arrays are donated (an output's sharding need not match a sharded
input's). The donated positions and the output order are part of the program's key: a
training loop keeps one pattern, so one program. Under a user's trace (a pending value
read there) nothing is donated.

Note [A segment that fails as one program runs op by op]
Fusing a segment must never make a step fail that plain eager runs: a segment program
can need more device memory than its ops one by one (XLA keeps the intermediates of
the nodes it may not fuse through: Note [Fusion keeps eager's numbers] in
torchjax/ops/fusion_cuts.py). When the program fails for device memory
(``RESOURCE_EXHAUSTED``, at its compile or its run) and no donated input was consumed,
the segment runs op by op instead: each node's own executable, as plain eager runs it,
each intermediate dropped after its last reader. Its key is remembered, so later
flushes of the same segment go op by op at once (``torchjax.stats()["fused_op_by_op"]``
counts such segments), and a ``ResourceWarning`` says so once per key. Any other
failure, or one op by op, is raised at the flush; the values the segment did not
compute are lost, and reading one raises a ``RuntimeError`` naming the failure (not a
stale value), while the segment's inputs are released at once.
"""

from __future__ import annotations

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, tree_util

from torchjax import _budget
from torchjax._compat.jax import trace_state_clean, x64
from torchjax.device import _checks, _stats
from torchjax.ops import fused_replay as replay
from torchjax.ops.xla_options import COMPILER_OPTIONS
from torchjax.tensor._shared_arrays import shared

# (last step, live outputs, donated inputs) -> segment program (Note [Replaying a
# recorded sequence] in torchjax/ops/fused_replay.py)
_PROGRAMS: dict = {}

# Keys of segments that run op by op (bounded: cleared when full).
_OP_BY_OP: dict = {}
_MAX_OP_BY_OP = 1024


def _refs(arrays, i) -> int:
    return sys.getrefcount(arrays[i])


def _list_only_refs() -> int:
    # The count of an array held by the segment's input list alone, measured through
    # the same code path (the number an interpreter reports varies by version).
    return _refs([object()], 0)


_LIST_ONLY = _list_only_refs()


def held_only_by(arrays: list, i: int, others: int = 0) -> bool:
    """Whether ``arrays[i]`` is held by the list ``arrays`` and ``others`` more references
    alone (Note [Fused segments donate their dead inputs])."""
    return _refs(arrays, i) == _LIST_ONLY + others


def donatable(arrays: list, i: int, others: int = 0) -> bool:
    """Whether ``arrays[i]`` may be given to XLA: held by the list and ``others`` more
    references alone, a single-device array, and not shared with user JAX code (Notes
    [Fused segments donate their dead inputs], [Arrays shared with JAX code are not
    donated])."""
    if not held_only_by(arrays, i, others):
        return False
    a = arrays[i]
    return isinstance(a, jax.Array) and len(a.sharding.device_set) == 1 and not shared(a)


def dead_inputs(inputs: list, live: list) -> tuple:
    """(donated, order): the positions in ``inputs`` (the segment's only list of them)
    of the arrays to donate, and the order of the program's outputs (positions in
    ``live``) that aliases each with the value replacing it (Note [Fused segments donate
    their dead inputs])."""
    paired: dict = {}  # input position -> position in live of the value replacing it
    dead = [i for i in range(len(inputs)) if donatable(inputs, i)]
    if not dead:
        return (), None
    aval = {i: (tuple(inputs[i].shape), inputs[i].dtype) for i in dead}
    for k, p in enumerate(live):
        i = p.replaces
        if i is not None and i not in paired and aval.get(i) == (tuple(p.shape), p.dtype):
            paired[i] = k
    # The other dead inputs alias the unpaired outputs of their shape and dtype; only those
    # after every paired input of it, so jax's matching (each output takes the first
    # donated input of its aval left) still gives every paired output its own.
    last: dict = {}
    for i in paired:
        last[aval[i]] = max(last.get(aval[i], -1), i)
    spare: dict = {}
    taken = set(paired.values())
    for k, p in enumerate(live):
        if k not in taken:
            key = (tuple(p.shape), p.dtype)
            spare[key] = spare.get(key, 0) + 1
    donated = []
    for i in dead:
        if i in paired:
            donated.append(i)
        elif i > last.get(aval[i], -1) and spare.get(aval[i], 0):
            spare[aval[i]] -= 1
            donated.append(i)
    order = [paired[i] for i in sorted(paired)]
    order += [k for k in range(len(live)) if k not in taken]
    return tuple(donated), (None if order == sorted(order) else tuple(order))


def too_big(key) -> bool:
    """Whether segment ``key`` runs op by op (its program did not fit)."""
    return key in _OP_BY_OP


def fits_op_by_op(error: BaseException, inputs: list, donated_at: tuple) -> bool:
    """Whether a segment whose program raised ``error`` may run op by op: a device
    memory failure that consumed none of the donated inputs."""
    if "RESOURCE_EXHAUSTED" not in str(error)[:2000]:
        return False
    return not any(inputs[i].is_deleted() for i in donated_at)


def remember(key, n_nodes: int, error: BaseException) -> None:
    if len(_OP_BY_OP) >= _MAX_OP_BY_OP:
        _OP_BY_OP.clear()
    _OP_BY_OP[key] = True
    warnings.warn(
        f"torchjax fused eager: a recorded segment of {n_nodes} ops does not fit in device "
        f"memory as one program ({str(error).splitlines()[0][:200]}); it runs op by op, "
        "as plain eager does. Fewer ops between host reads, or torchjax.jit with donated "
        "state, fuse such a step.",
        ResourceWarning,
        stacklevel=3,
    )


def op_by_op(runs: list, nodes: list, inputs: list, live_refs: tuple):
    """The segment's nodes run one by one with their own executables (``runs``, in
    recording order), as plain eager runs them: (values of ``live_refs``, the check
    outputs of the nodes that make checks), as the segment program returns them."""
    live = set(live_refs)
    last = {}  # wiring ref -> the last node reading it
    for k, node in enumerate(nodes):
        for r in node[1]:
            last[r if r < 0 else r >> 1 << 1] = k
    values: dict = {}
    checks = []
    ref = -1
    for k, (run, node) in enumerate(zip(runs, nodes)):
        args = [inputs[r >> 1] if r >= 0 else values[r] for r in node[1]]
        # No trace is active here (a flush inside one runs its program concretely).
        out, chk = run(*args)
        del args
        for v in tree_util.tree_leaves(out):
            values[ref] = v
            ref -= 1
        out = None
        if node[2]:
            checks.append((chk.bads, chk.values))
        # As plain eager frees them: an input or intermediate is dropped after its last
        # reader (the list of inputs is the segment's own), so an in-place update's old
        # value goes as its new one is made.
        for r in node[1]:
            if r < 0:
                if last.get(r) == k and r not in live:
                    values.pop(r, None)
            elif last.get(r >> 1 << 1) == k:
                inputs[r >> 1] = None
    return [values[r] for r in live_refs], checks


def lost(outs: list, error: BaseException) -> None:
    """Mark the segment's uncomputed values as lost to ``error``."""
    for p in outs:
        if p.value is None:
            p.error = error
        p.segment = None


def lost_error(error: BaseException) -> RuntimeError:
    return RuntimeError(
        "torchjax fused eager: this tensor's value was never computed: the recorded "
        f"segment that makes it failed ({type(error).__name__}: "
        f"{str(error).splitlines()[0][:300] if str(error) else ''}). Compute it again."
    )


def run(step, live, refs, inputs, runs):
    """The segment's live values and check outputs: its program, with its dead inputs
    donated, or its ops one by one where the program does not fit (Notes [Fused
    segments donate their dead inputs], [A segment that fails as one program runs op by
    op])"""
    clean = trace_state_clean()
    donated, order = dead_inputs(inputs, live) if clean else ((), None)
    out_refs = refs if order is None else tuple([refs[k] for k in order])
    key = (step, out_refs, donated)
    # x64 on, as in dispatch: the nodes were traced so (a flush may come from outside an
    # op: a sync point, a thread).
    with x64(True):
        if clean and too_big(key):
            _stats.FUSED.op_by_op += 1
            return op_by_op(runs, replay.nodes(step), inputs, refs)
        program = _budget.cached(
            _PROGRAMS, key, lambda: build(replay.nodes(step), out_refs, donated)
        )
        if not clean:
            return _concretely(program, inputs)
        try:
            values, checks = program(_TRUE, *inputs)
        except jax.errors.JaxRuntimeError as e:
            if not fits_op_by_op(e, inputs, donated):
                raise
            nodes = replay.nodes(step)
            remember(key, len(nodes), e)
            _stats.FUSED.op_by_op += 1
            return op_by_op(runs, nodes, inputs, refs)
        _stats.FUSED.donations += len(donated)
        if order is not None:
            values = unordered(values, order)
        return values, checks


def unordered(values, order):
    """``values`` made in ``order`` (positions in the live list), back in the list's."""
    out = [None] * len(values)
    for v, k in zip(values, order):
        out[k] = v
    return out


def close_with(seg, live, run) -> bool:
    """Run ``seg`` as ``run(inputs)`` does instead of its own program: given the
    segment's inputs (its only list of them), ``run`` returns the values of ``live`` (its
    ``Pending`` outputs still referenced, every one of them) and the device checks of its
    nodes, as the segment program would (a captured optimizer step: Note [Captured
    optimizer steps] in torchjax/compile/_captured_optim.py). False, and nothing run,
    when the segment has run already."""
    with seg.lock:
        if seg.closed:
            return False
        seg.closed = True
        inputs = seg.inputs
        seg.inputs, seg.input_ids, seg.runs = [], {}, []
        try:
            values, checks = run(inputs)
        except BaseException as e:
            lost(seg.outs, e)
            raise
        for p, v in zip(live, values):
            p.fill(v)
        for p in seg.outs:
            p.segment = None
        # Held by this thread until it records again (a captured step records nothing):
        # its values would stay referenced, and the next step could not donate them.
        seg.outs = []
    for codes, (bads, vals) in zip(seg.step.checked, checks):
        _checks.add_collected(codes, bads, vals)
    return True


def _concretely(program, inputs):
    """``program`` run on ``inputs`` inside a user's trace (a pending value read there):
    its compiled executable, called directly, gives concrete arrays, which the storages
    outlive the trace with. Not ``jax.ensure_compile_time_eval()``: a jitted function
    traced under it takes ``lax.platform_dependent``'s default branch, not the CPU one
    (the CPU division and Adam lowerings would lose their exact rounding)."""
    return program.lower(_TRUE, *inputs).compile()(_TRUE, *inputs)


def build(nodes, live, donated=()):
    body = segment_function(nodes, live)

    def segment(pred, *inputs):
        _stats.FUSED.compiles += 1
        return body(pred, *inputs)

    # Position 0 is the predicate.
    donate = tuple([i + 1 for i in donated])
    return jax.jit(segment, compiler_options=COMPILER_OPTIONS, donate_argnums=donate)


def segment_function(nodes, live):
    """The traceable function of a segment program: ``(pred, *inputs)`` to the outputs
    at ``live`` (``Pending.ref`` values) and the nodes' device checks. Its nodes'
    functions are resolved now: callers hold their executables until this returns."""
    fns = [n[0]() for n in nodes]
    wiring = [n[1] for n in nodes]
    checked = [bool(n[2]) for n in nodes]
    isolated = [n[3] for n in nodes]
    cuts = [n[4] for n in nodes]

    def segment(pred, *inputs):
        outs, checks = [], []  # outs: every node's outputs in order (Pending.ref)
        for fn, refs, has_checks, iso, cut in zip(fns, wiring, checked, isolated, cuts):
            args = [inputs[r >> 1] if r >= 0 else outs[-1 - r] for r in refs]
            out, chk = isolated_call(fn, pred, args) if iso else fn(*args)
            leaves = tree_util.tree_leaves(out)
            if cut:  # Note [Fusion keeps eager's numbers] (ops/fusion_cuts.py)
                kept = isolated_call(identity, pred, [leaves[k] for k in cut])
                for k, v in zip(cut, kept):
                    leaves[k] = v
            outs += leaves
            if has_checks:
                checks.append((chk.bads, chk.values))
        return [outs[-1 - r] for r in live], checks

    return segment


_TRUE = np.bool_(True)
# The predicate argument of a program built of segment nodes (True at run time).
PRED = _TRUE


def identity(*args):
    return list(args)


def isolated_call(fn, pred, args):
    """``fn(*args)`` as the branch of a conditional XLA cannot see through (its
    predicate is an argument of the program): Note [Fusion keeps eager's numbers] in
    torchjax/ops/fusion_cuts.py."""
    shapes = jax.eval_shape(fn, *args)

    def zeros(*_):
        return tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    return lax.cond(pred, fn, zeros, *args)
