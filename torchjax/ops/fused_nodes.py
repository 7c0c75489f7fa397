"""Ops traced into a captured module call as fused eager's segment program runs them
(Note [Captured module calls] in torchjax/compile/_captured.py): each op's traceable
function inlined where it is elementwise, behind a conditional XLA cannot see through
where it is not, its rewritable outputs cut out (Note [Fusion keeps eager's numbers] in
torchjax/ops/fusion_cuts.py). Used by ``executables.call`` while this thread traces a
captured call, its forward or its backward (Note [Captured calls that need a graph]).
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
from jax import tree_util

from torchjax.ops import fused as _fused
from torchjax.ops import fused_run


class _Local(threading.local):
    pred = None  # the traced predicate of the captured program being traced


_local = _Local()


def pred():
    """The predicate input of the captured call this thread traces (None: none)."""
    return _local.pred


@contextlib.contextmanager
def tracing(pred):
    """Ops traced in the block become nodes on ``pred`` (a traced boolean input of the
    program, True when it runs)."""
    prev = _local.pred
    _local.pred = pred
    try:
        yield
    finally:
        _local.pred = prev


def node(run, dyn, pred):
    """``run(*dyn)`` (its outputs and checks) traced as fused eager's segment program
    replays the op (``fused_run.build``): the same jaxpr around the same function, its
    equations under the name scope ``SCOPE``."""
    specs = [d.aval if isinstance(d, jax.core.Tracer) else d for d in dyn]
    _, _, _, isolated, cut = _fused._shapes(run, specs)
    fn = run.__wrapped__
    with jax.named_scope(SCOPE):
        out, chk = fused_run.isolated_call(fn, pred, list(dyn)) if isolated else fn(*dyn)
        if cut:
            leaves, tree = tree_util.tree_flatten(out)
            kept = fused_run.isolated_call(fused_run.identity, pred, [leaves[k] for k in cut])
            for k, v in zip(cut, kept):
                leaves[k] = v
            out = tree_util.tree_unflatten(tree, leaves)
    return out, chk


# Note [Captured traces leave the view limits alone]
# An op reads a view inside its executable (a transpose fused into the dot) until its
# overload has seen ``MAX_VIEW_KEYS`` view layouts, or a key ``MAX_VIEW_SIGNATURES``
# input signatures (torchjax/ops/cached_compute.py, view_signatures.py); past that, a new
# key reads its views first. The two give different bits where the consumer is a dot
# (XLA contracts a transposed operand in another order). A captured trace keys some
# views differently from eager (a tracer's storage is whole where eager's pending value
# was a view of it): counted, those keys used up the limit in the middle of a tiny
# Llama's train step, so later ops of the trace read first where eager, and fused eager,
# had read inside, and every gradient after them differed in the last bits. So while a
# captured call traces (``pred()`` set), its new keys are decided by the counts eager
# left and add nothing to them: the trace takes eager's decisions, and leaves the ones
# eager makes later as they would be without it.
SCOPE = "torchjax_node"
# Primitives whose float results do not depend on what XLA fuses them with: they move,
# select or convert elements (a conversion rounds once, the same way everywhere), or
# compute an exact result (no rounding: max, min, abs, neg, floor...).
_EXACT = frozenset(
    "reshape broadcast_in_dim transpose squeeze expand_dims slice dynamic_slice "
    "dynamic_update_slice concatenate stack split pad select_n copy copy_p "
    "convert_element_type reduce_precision bitcast_convert_type gather scatter iota rev "
    "stop_gradient optimization_barrier max min abs neg sign floor ceil round clamp "
    "reduce_max reduce_min sort".split()
)


def float_ops_outside_nodes(jaxpr, top: bool = True) -> list:
    """The primitives of ``jaxpr`` that compute a floating-point result outside every
    node (an op that ran off its cached executable: a handler such as training-mode
    batch norm, a lowering run op by op), which XLA may fuse with their neighbours and
    so compute differently from eager (Note [Captured module calls]). Nested jaxprs
    outside nodes (a view's read) are looked into."""
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _EXACT or (top and SCOPE in str(eqn.source_info.name_stack)):
            continue
        if not any(jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.outvars):
            continue
        inner = eqn.params.get("jaxpr") if name in ("jit", "pjit", "closed_call") else None
        if inner is not None:
            found += float_ops_outside_nodes(getattr(inner, "jaxpr", inner), top=False)
        else:
            found.append(name)
    return found
