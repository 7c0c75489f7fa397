"""The executables of one ATen overload: the cache every compiled op path shares.

Note [One executable table]
Single ops (``CompiledCompute``, torchjax/ops/cached_compute.py) and ``_foreach_*`` ops
(torchjax/ops/foreach.py) turn a call into a template (torchjax/ops/templates.py) and a
flat list of arrays, and run it through an ``Executables`` table of their overload:

- one ``jax.jit`` function per (key, input signature), built on first use; the key is
  the template (the static part of the call), the signature the arrays' shapes and
  dtypes (``templates.signature``);
- each function is an entry of the process-wide budget (Note [Executable cache budget]
  in torchjax/_budget.py): past the budget the least recently used are evicted and
  compile again when next called;
- keys equal up to their float static values (an ``alpha`` or ``value`` that changes
  every call) compile at most ``MAX_FLOAT_VARIANTS`` times; later variants run op by op;
- a key whose trace needs concrete values (``CONCRETE_ERRORS``) is dropped, and its calls
  run op by op;
- ``cache_info(func)`` counts keys, traces and calls (Note [Eager engine counters]);
  ``clear_caches`` empties every table.

A handler whose computation takes nested arguments (the fused optimizers' lists of
parameters, ``None`` for absent state, Python hyperparameters) uses ``TreeRun``: the
static arguments and the arguments' tree structure are the key, the flattened leaves
the executable's arguments (Python numbers stay Python numbers, weakly typed, as a
plain ``jax.jit`` call passes them).

Built functions carry XLA's options (``COMPILER_OPTIONS``); jax refuses them on a jit
nested in another trace (an op inside ``torchjax.jit``, or ``jax.grad`` over
``torchjax.functional``), so ``call`` retries there with the same function without them,
made on first use and kept on the function (it goes when the function is evicted).

Tables are changed under their lock (two threads dispatching one overload must not both
build, or both delete, an entry); lookups take none (dict reads are atomic under the
GIL).

Note [Values made from constants inside a trace]
Inside a trace (``torchjax.jit``, the Dynamo backend's programs, a traced backward), an op
whose arguments are all concrete arrays (no tracer: ``arange``'s positions and what is
computed from them) is evaluated there and then (``jax.ensure_compile_time_eval``), as a
NumPy computation inside ``jax.jit`` would be, instead of being staged into the program.
Its result is a concrete array, so code that inspects values when they are known keeps
doing so under the trace: transformers' ``is_tracing`` (``x.jax()`` a tracer) is False for
the position ids a model makes itself, so it finds no packed sequences and calls SDPA with
``is_causal=True`` and ``enable_gqa`` as in eager, rather than with a materialised (B, 1,
S, S) mask and key/value heads repeated to the query's (the flash kernel then computes
every block instead of skipping the masked half, and reads the mask). Only small values
fold (``FOLD_ELEMENTS`` in every argument together and in every result): a large result
(a mask built from positions) stays a computation of the program, not a constant baked
into it (XLA keeps a program's constants for the executable's life). Values are the
executable's either way; a result that would be too large is staged as before. Not under
a mesh, where an eager call would place its result by the mesh.

A view of a concrete array read before the op (``Plan.read_array`` in
torchjax/tensor/_view_plans.py) folds by the same rule. An op reads its views inside its
own program, folded with it, until the overload has seen many view layouts or signatures
(``MAX_VIEW_KEYS``, ``MAX_VIEW_SIGNATURES`` in torchjax/ops/cached_compute.py); after that
it reads them first, through the view's read program, which a trace staged: the position
ids' ``diff`` of a model traced after other code had used ``diff`` on enough shapes was a
tracer, and transformers passed SDPA a mask and repeated heads, depending on what ran
before in the process.
"""

from __future__ import annotations

import threading
import weakref

import jax

from torchjax import _budget
from torchjax._compat.jax import trace_state_clean
from torchjax.device._stats import cache_info_entry
from torchjax.ops import fused_nodes
from torchjax.ops.templates import signature
from torchjax.ops.xla_options import COMPILER_OPTIONS
from torchjax.tensor import _errors

# Arguments (together) and each result of an op evaluated inside a trace because its
# arguments are concrete, at most this many elements (Note [Values made from constants
# inside a trace]); defined with the view reads, which fold by the same bound.
from torchjax.tensor._view_plans import FOLD_ELEMENTS

# Keys of one overload that differ only in float static arguments (torch.optim's
# ``addcdiv_(..., value=-step_size)``): after this many, such calls run op by op
# instead of compiling each new value.
MAX_FLOAT_VARIANTS = 4

# Errors a trace raises when a lowering needs concrete values: such keys run op by op.
CONCRETE_ERRORS = (
    # Raised by a nested op's dispatch (Note [One error layer]).
    _errors.DataDependentError,
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
)


# Every owner of a table (anything with ``func`` and ``clear()``), for clear_caches.
_OWNERS: weakref.WeakSet = weakref.WeakSet()


def register(owner) -> None:
    """Make ``owner.clear()`` part of ``clear_caches`` (for ``owner.func`` or all)."""
    _OWNERS.add(owner)


def clear_caches(func=None) -> None:
    """Drop the executables (and the op-by-op decisions) of ``func``'s compiled paths,
    or of every overload: the next calls build them again. Counters restart at zero."""
    for owner in list(_OWNERS):
        if func is None or owner.func == func:
            owner.clear()


def build(fn, name: str):
    """``fn`` (taking the flat arrays) as a jitted function named ``name``."""
    fn.__name__ = name
    return jax.jit(fn, compiler_options=COMPILER_OPTIONS)


def nested(run):
    """``run`` without compiler options, for calls inside a trace. A ValueError raised
    by the traced function itself is raised again by this second call."""
    inner = getattr(run, "nested", None)
    if inner is None:
        inner = run.nested = jax.jit(run.__wrapped__)
    return inner


def call(run, dyn):
    """``run(*dyn)``; inside an outer trace, its option-free twin (inlined there)."""
    if not trace_state_clean():
        # A tracer argument: the top-level call would trace ``run`` only to refuse its
        # compiler options with a ValueError (Note [Compiled lowerings]), and tracing a
        # model (torchjax.jit, compile_generate) paid that for every op.
        for d in dyn:
            if isinstance(d, jax.core.Tracer):
                pred = fused_nodes.pred()
                if pred is not None:  # Note [Captured module calls]
                    return fused_nodes.node(run, dyn, pred)
                return nested(run)(*dyn)
        out = _folded(run, dyn)
        if out is not None:
            return out
    try:
        return run(*dyn)
    except ValueError:
        return nested(run)(*dyn)


def _folded(run, dyn):
    """``run(*dyn)`` evaluated now though a trace is active, or None where it should be
    staged (Note [Values made from constants inside a trace])."""
    if sum(getattr(d, "size", 1) for d in dyn) > FOLD_ELEMENTS:
        return None
    if not jax.sharding.get_abstract_mesh().empty:
        return None
    with jax.ensure_compile_time_eval():
        out = run(*dyn)
    if any(getattr(x, "size", 1) > FOLD_ELEMENTS for x in jax.tree.leaves(out)):
        return None
    return out


class Executables:
    """The (key, input signature) -> executable table of one overload (Note [One
    executable table])."""

    def __init__(self, func):
        self.func = func
        self.runs: dict = {}
        self.float_variants: dict = {}
        self.info = cache_info_entry(func)
        self.lock = threading.Lock()

    def get(self, run_key):
        """The executable of ``run_key``, counted as a budget hit, or None."""
        run = self.runs.get(run_key)
        if run is not None:
            _budget.hit(run)
        return run

    def new_float_variant(self, masked) -> bool:
        """Count a new key whose float-blanked form is ``masked``; False once that form
        has compiled ``MAX_FLOAT_VARIANTS`` times (the call runs op by op). Called under
        ``self.lock``."""
        seen = self.float_variants.get(masked, 0)
        if seen >= MAX_FLOAT_VARIANTS:
            return False
        self.float_variants[masked] = seen + 1
        return True

    def add(self, run_key, run, on_add=None, on_evict=None):
        """Enter ``run`` under ``run_key`` and in the budget; ``on_add()`` runs under the
        lock when it is entered, ``on_evict()`` (under the lock too) when the budget
        evicts it. Returns the entry that won: another thread's, if it built the same
        key first."""
        with self.lock:
            old = self.runs.get(run_key)
            if old is not None:
                return old
            self.runs[run_key] = run
            if on_add is not None:
                on_add()

        def evict():
            with self.lock:
                if self.runs.get(run_key) is run:
                    del self.runs[run_key]
                if on_evict is not None:
                    on_evict()

        _budget.admit(run, evict)
        return run

    def drop_key(self, key) -> list:
        """Remove every executable of ``key`` (any signature); returns them. Called under
        ``self.lock``."""
        gone = [rk for rk in self.runs if rk[0] == key]
        runs = [self.runs.pop(rk) for rk in gone]
        for run in runs:
            _budget.forget(run)
        return runs

    def clear(self) -> None:
        """Forget every executable and decision; counters restart at zero. Called under
        ``self.lock``."""
        for run in self.runs.values():
            _budget.forget(run)
        self.runs, self.float_variants = {}, {}
        info = self.info
        info.keys = info.traces = info.eager_keys = info.calls = info.op_by_op = 0


class TreeRun:
    """``fn(*args, **kwargs)`` of one overload as one executable per (static keyword
    values, tree structure of the other arguments, input signature) in that overload's
    table (see the module docstring); ``static`` names the keywords that change the
    computation."""

    def __init__(self, func, fn, static: tuple[str, ...]):
        self.func, self.fn, self.static = func, fn, static
        self.table = Executables(func)
        self.info = self.table.info
        self.keys: set = set()
        register(self)

    def clear(self) -> None:
        with self.table.lock:
            self.table.clear()
            self.keys = set()

    def __call__(self, *args, **kwargs):
        static = tuple((k, kwargs.pop(k)) for k in self.static)
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        key = (static, tree)
        run_key = (key, signature(leaves))
        run = self.table.get(run_key)
        if run is None:
            run = self.table.add(run_key, self._build(dict(static), tree), lambda: self._seen(key))
        self.info.calls += 1
        return call(run, leaves)

    def _seen(self, key) -> None:
        if key not in self.keys:
            self.keys.add(key)
            self.info.keys += 1

    def _build(self, static, tree):
        fn, info = self.fn, self.info

        def traced(*leaves):
            info.traces += 1
            args, kwargs = jax.tree_util.tree_unflatten(tree, leaves)
            return fn(*args, **kwargs, **static)

        return build(traced, f"{self.func._opname}_{self.func._overloadname}")
