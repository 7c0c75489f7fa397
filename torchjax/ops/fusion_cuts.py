"""Where a fused eager segment keeps an op's output an array (Note [Fusion keeps eager's
numbers]): which recorded ops may fuse with their neighbours (``elementwise``) and which
of their outputs leave through a cut (``cut_outputs``), read from each op's jaxpr.
Used by ops/fused.py.
"""

from __future__ import annotations

# Primitives that only move elements (a fused consumer sees the producer's arithmetic
# through them), and those whose result a fused consumer's arithmetic could be
# rewritten with (Note [Fusion keeps eager's numbers]).
_MOVES = frozenset(
    "reshape broadcast_in_dim transpose squeeze expand_dims slice dynamic_slice "
    "concatenate pad select_n copy copy_p".split()
)
_REWRITABLE = frozenset("mul div sqrt rsqrt exp exp2 log pow integer_pow neg".split())


def cut_outputs(jaxpr, n) -> tuple:
    """Indices of the first ``n`` outputs of ``jaxpr`` computed by a _REWRITABLE
    primitive (looking through _MOVES and nested jaxprs)."""
    return tuple(k for k, v in enumerate(jaxpr.outvars[:n]) if _rewritable(jaxpr, v))


def _rewritable(jaxpr, var) -> bool:
    for eqn in reversed(jaxpr.eqns):
        if not any(o is var for o in eqn.outvars):
            continue
        name = eqn.primitive.name
        if name in _REWRITABLE:
            return True
        if name in _MOVES:
            return any(_rewritable(jaxpr, v) for v in eqn.invars if hasattr(v, "count"))
        k = [i for i, o in enumerate(eqn.outvars) if o is var][0]
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                return _rewritable(inner, inner.outvars[k])
            if name == "cond" and isinstance(p, tuple):  # any branch (a platform's)
                return any(_rewritable(b.jaxpr, b.jaxpr.outvars[k]) for b in p)
        return False
    return False


# Note [Fusion keeps eager's numbers]
# A reduction that XLA:CPU fuses with its producer computes differently from the same
# reduction reading an array: ``jnp.exp(a).sum(1)`` as one program differs in the last
# bit from ``exp`` then ``sum`` as two (measured on float32 (64, 64)...(512, 64), for
# exp, tanh, ``t * t`` and ``t * 1.5 + 0.3`` producers). Two causes, both seen in the
# optimised HLO: the reduce becomes a YNNPACK fusion (``__ynn_fusion``) that evaluates
# the fused producer with YNNPACK's own kernels (its exp, fused multiply-adds); and with
# YNNPACK fusions off, XLA's own reduce loop still contracts ``t * t`` into the sum with
# an FMA. max is order-free and agrees, and elementwise chains agree bit for bit (the
# same code computes each element; excess precision is off: COMPILER_OPTIONS).
# ``lax.optimization_barrier`` does not help: XLA:CPU removes it before fusion. So a
# node whose lowering is not purely elementwise or layout (a reduction, a dot, a
# gather...) runs in the segment program as the taken branch of a ``lax.cond`` on a
# predicate passed in as an argument: XLA cannot fuse across a conditional it cannot
# resolve at compile time, so the node reads and writes arrays exactly as its own
# executable does (checked bit for bit on those producers followed by sum, mean,
# softmax, a dot and a layer norm, 72 of 72 cases), and fusion happens between
# elementwise ops.
# Elementwise ops fused together still change numbers in two ways XLA:CPU takes at its
# default optimisation level: LLVM contracts a multiply feeding an add into one FMA
# (``a * b`` then ``+ c`` as two ops differs from ``a * b + c`` in one program in 951
# of 4096 float32 elements; at ``xla_backend_optimization_level=0``, the suite's
# level, they agree), and XLA's algebraic simplifier rewrites across ops (``a / sqrt(b)``
# into ``a * rsqrt(b)``, products of exps). So an elementwise node's output computed by
# one of those primitives (``_REWRITABLE``: mul, div, sqrt, rsqrt, exp, log, pow, neg,
# looked up through element moves such as reshape and broadcast) leaves it through an
# identity conditional on the same predicate: it is an array when the next op reads it,
# as in eager. XLA:CPU's tanh gives other bits fused with a neighbour (``(x + 1).tanh()``
# and ``x.tanh() + 1`` both differ; exp, sin, logistic do not), so ``_ELEMENTWISE``
# lists only primitives checked or plain arithmetic: tanh, erf, the inverse
# trigonometric and hyperbolic functions, log1p, expm1 and the like are isolated as
# reductions are. Chains of adds, compares, selects, casts and the listed functions
# still fuse (a tiny Llama forward: bit-identical to eager in float32
# and bfloat16 with these cuts; without them 1.2e-7 apart).
# Note [Platform branches fuse]
# A lowering that keeps eager's rounding on one platform (``lax.platform_dependent``:
# lerp's and addcmul's exact CPU forms) is a ``cond`` on ``platform_index``, which
# lowering resolves to the compiling platform's branch: no conditional is left for XLA.
# Such a node is elementwise when every branch is, and its outputs are cut when any
# branch computes them with a rewritable primitive. Isolating it instead ran it as a
# conditional over whole lists: a fused AdamW step's lerp and addcmul nodes each kept a
# list of moments in a buffer of their own, copied into the output after.
_ELEMENTWISE = frozenset(
    (
        "abs add and bitcast_convert_type broadcast_in_dim ceil clamp clz complex "
        "concatenate conj convert_element_type copy copy_p cos div eq exp expand_dims floor "
        "ge gt imag integer_pow is_finite le log logistic lt max min mul ne neg nextafter "
        "not or pad population_count pow real reduce_precision rem reshape round rsqrt "
        "select_n shift_left shift_right_arithmetic shift_right_logical sign sin slice sqrt "
        "square squeeze stop_gradient sub transpose xor iota dynamic_slice pjit jit "
        "closed_call custom_jvp_call custom_vjp_call"
    ).split()
)


def elementwise(jaxpr) -> bool:
    chosen = None  # the variables holding a platform's index
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "platform_index":
            chosen = (chosen or set()) | {id(v) for v in eqn.outvars}
            continue
        if name == "cond" and chosen and id(eqn.invars[0]) in chosen:
            pass  # Note [Platform branches fuse]: its branches are checked below
        elif name not in _ELEMENTWISE:
            return False
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and not elementwise(inner):
                    return False
    return True
