"""Steps of recorded op sequences: a repeated sequence is recognised op by op.

Note [Replaying a recorded sequence]
A segment of fused eager mode (Note [Fused eager] in torchjax/ops/fused.py) is a path
of *steps*: the empty segment is ``ROOT``, and recording an op moves the segment from its
step to the step "this op, wired so, after that step". A step holds everything the op
needs once its place is known: the node the segment program replays (the traceable
function, its wiring, device-check codes, how it fuses), and the shapes, dtypes, strides
and torch dtypes of its outputs (``Out``), with which the outputs are wrapped as tensors.
So in steady state, when a loop repeats the same ops on the same shapes and aliasing,
recording an op is one dict lookup (its step), one ``Pending`` and one tensor per
output, and no JAX call: the output avals were traced once, on the step's first use.

- The edge key is (previous step, wiring), kept in a dict on the op's executable
  (``run.fused_steps``): the executable already stands for the overload, its static
  arguments and its input shapes and dtypes (Note [Compiled lowerings] in
  torchjax/ops/cached_compute.py). The wiring is one int per argument: ``2 * i + w`` for
  the segment's input ``i`` (``w``: its weak type, which decides the output types) and
  ``-1 - j`` for output ``j`` of the segment so far (outputs numbered in recording
  order). Two steps are the same op sequence with the same wiring exactly when they are
  the same object, so a segment's program is keyed by its last step and the outputs
  still referenced: no key is built per flush from the ops.
- Lifetime: edges live on the executables, so an executable dropped by the budget
  (Note [Executable cache budget]) or by ``clear_caches`` takes the steps after it
  along, unless a segment still on them or a program key holds them. A step holds its
  predecessor, and its op's traceable function only weakly: an edge of a live
  executable whose previous step ran an executable since dropped must not keep that
  function, and with it jax's caches of its trace and compiled code, alive. A segment
  holds the executables it recorded until it runs, so building its program finds every
  function. An executable seen after more than ``MAX_EDGES`` different steps (sequences
  that never repeat) forgets its edges and starts again.
- Threads: edges are added with ``dict.setdefault``, so two threads adding the same edge
  at once both continue on the step that was kept; a segment on the other one still runs
  correctly, under a key of its own (one more program compiled).
"""

from __future__ import annotations

from torchjax.tensor import dtypes
from torchjax.tensor._storage import contiguous_strides

# Edges kept per executable before they are forgotten (sequences that never repeat).
MAX_EDGES = 4096


class Out:
    """One output of a recorded op: its aval and what wrapping it as a tensor needs."""

    __slots__ = ("aval", "shape", "dtype", "weak_type", "numel", "strides", "torch_dtype")

    def __init__(self, aval):
        self.aval = aval
        self.shape = tuple(aval.shape)
        self.dtype = aval.dtype
        self.weak_type = aval.weak_type
        numel = 1
        for n in self.shape:
            numel *= n
        self.numel = numel
        self.strides = contiguous_strides(self.shape)
        try:
            self.torch_dtype = dtypes.to_torch_dtype(aval.dtype)
        except TypeError:
            # No torch dtype (a PRNG key, say): an error only if it is wrapped.
            self.torch_dtype = None


class Step:
    """The segment after one more recorded op (Note [Replaying a recorded sequence]).

    ``node``: (weak reference to the traceable function, wiring, check codes, isolated,
    cuts), what the segment program replays; ``outs``: the op's ``Out`` per output leaf;
    ``tree``: their pytree (None for a single array); ``codes``: its device-check codes;
    ``depth``: ops on the path; ``checked``: the check codes of the path's ops that make
    checks, in order; ``count``: outputs on the path."""

    __slots__ = ("parent", "node", "outs", "tree", "codes", "depth", "checked", "count")

    def __init__(self, parent, node, outs, tree, codes):
        self.parent, self.node, self.outs, self.tree, self.codes = parent, node, outs, tree, codes
        if parent is None:
            self.depth, self.checked, self.count = 0, (), 0
        else:
            self.depth = parent.depth + 1
            self.checked = parent.checked + (codes,) if codes else parent.checked
            self.count = parent.count + len(outs)


ROOT = Step(None, None, (), None, ())


def edges(run) -> dict:
    """The edges of executable ``run``: (step, wiring) -> the step after it."""
    found = getattr(run, "fused_steps", None)
    if found is None or len(found) > MAX_EDGES:
        found = run.fused_steps = {}
    return found


def add(run, key, step) -> Step:
    """Enter ``step`` as the edge ``key`` of ``run``; the step kept there."""
    return edges(run).setdefault(key, step)


def nodes(step) -> list:
    """The nodes of the path ending at ``step``, first op first."""
    out = []
    while step.parent is not None:
        out.append(step.node)
        step = step.parent
    out.reverse()
    return out
