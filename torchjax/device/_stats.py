"""``torchjax.stats()``: what the eager engine did (compiles, executions, host reads).

Note [Eager engine counters]
Tests and benchmarks ask "did this op run as one cached executable?", "how many XLA
programs did this model compile?" and "did this step read device data back to the
host?". The answers come from counters that cost one attribute increment on the hot
path:

- ``compiles``: XLA compilations in this process (every backend compile jax reports
  through ``jax.monitoring``, torchjax's and the user's own jax code alike);
- per overload (``ops``): ``calls`` made through a cached executable, ``traces`` (cache
  misses: a new key or a new shape/dtype signature, each one trace and usually one
  compile), ``keys`` (executables built) and ``op_by_op`` calls (the lowering run
  primitive by primitive: several jax dispatches each);
- ``executions``: calls through cached executables (one XLA execution each) plus
  op-by-op calls (at least one each), fused segments, captured calls and steps;
  ``cache_hits`` = calls - traces, ``cache_misses``
  = traces;
- ``persistent_cache_hits``: executables JAX loaded from its persistent compilation
  cache instead of compiling (Note [Persistent compilation cache]); jax reports each
  as a compile too, ``compiles`` does not count them;
- ``host_reads``: device-to-host transfers torchjax made (``.item()``, ``.cpu()``,
  ``print``, ``.tolist()``, the reads of pending device checks at a sync point);
- ``host_ops``: ops run on the host because their inputs' values were there (Note
  [Integer ops on host values] in torchjax/ops/host_ops.py): no device program ran;
- ``foreach_donations``: old values of in-place foreach calls given to XLA (Note
  [In-place foreach calls donate their old values] in torchjax/ops/foreach_donate.py);
- fused eager mode: ``fused_ops`` recorded, ``fused_segments`` run, ``fused_compiles``
  (Note [Fused eager] in torchjax/ops/fused.py), ``fused_op_by_op`` (segments run op by
  op: Note [A segment that fails as one program runs op by op] in
  torchjax/ops/fused_run.py), ``fused_donations`` (segment inputs donated: Note [Fused
  segments donate their dead inputs]); ``captured_calls`` (module calls run as
  one captured program), ``capture_traces`` and ``capture_refusals`` (signatures that
  could not be captured: Note [Captured module calls] in torchjax/compile/_captured.py),
  with ``capture_refusal_reasons``: per module class name, why its latest refused
  signature was refused (the failed trace's exception, ``"TraceError: ..."``);
  ``captured_steps`` (optimizer steps run as one captured program) and
  ``captured_step_refusals`` (Note [Captured optimizer steps] in
  torchjax/compile/_captured_optim.py);
- ``executables``: the process-wide budget of cached programs and what it holds
  (``entries``, ``bytes``, ``evictions``, ``budget_entries``, ``budget_bytes``: Note
  [Executable cache budget] in torchjax/_budget.py).

Counters are plain integers updated without a lock: exact in one thread; two threads
dispatching at once may lose an increment, never corrupt a cache. The listeners for
``compiles`` and ``persistent_cache_hits`` are registered once at import (they change
nothing in jax's behaviour).
"""

from __future__ import annotations

import dataclasses

import jax

from torchjax import _budget

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_PERSISTENT_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class _Counters:
    __slots__ = ("compiles", "persistent_cache_hits", "host_reads", "host_ops", "donations")

    def __init__(self):
        self.compiles = 0
        self.persistent_cache_hits = 0
        self.host_reads = 0
        self.host_ops = 0
        self.donations = 0


COUNTERS = _Counters()


class _Fused:
    """Fused eager mode (Note [Fused eager] in torchjax/ops/fused.py): ops recorded,
    segments run (one XLA execution each), segment programs traced, segments run op by
    op (Note [A segment that fails as one program runs op by op] in
    torchjax/ops/fused_run.py)."""

    __slots__ = ("ops", "segments", "compiles", "op_by_op", "donations")

    def __init__(self):
        self.ops = self.segments = self.compiles = self.op_by_op = self.donations = 0


FUSED = _Fused()


class _Captured:
    """Captured module calls (Note [Captured module calls] in
    torchjax/compile/_captured.py): calls run as one captured program, signatures
    traced, signatures refused (they run op by op in fused mode); optimizer steps run
    as one captured program and optimizer signatures refused (Note [Captured optimizer
    steps] in torchjax/compile/_captured_optim.py)."""

    __slots__ = ("calls", "traces", "refusals", "reasons", "steps", "step_refusals")

    def __init__(self):
        self.calls = self.traces = self.refusals = 0
        # module class name -> why its latest refused signature was refused
        self.reasons: dict = {}
        self.steps = self.step_refusals = 0

    def refused(self, name: str, reason: str) -> None:
        """Count a signature refused of the calls of a module of class ``name``, keeping
        ``reason``."""
        self.refusals += 1
        self.reasons[name] = reason


CAPTURED = _Captured()
# Per-overload counters, filled by the tables of executables (torchjax/ops/executables.py).
OP_COUNTERS: dict = {}


@dataclasses.dataclass
class CacheInfo:
    """Per overload: ``keys`` executables built, ``traces`` (one per key and input
    shape/dtype signature), ``eager_keys`` keys that run op by op, ``calls`` through a
    cached executable, ``op_by_op`` calls (Note [Eager engine counters])."""

    keys: int = 0
    traces: int = 0
    eager_keys: int = 0
    calls: int = 0
    op_by_op: int = 0


def cache_info_entry(func) -> CacheInfo:
    """The (mutable) ``CacheInfo`` counting ``func``'s executables."""
    return OP_COUNTERS.setdefault(func, CacheInfo())


def cache_info(func=None):
    """The ``CacheInfo`` of ``func`` (an ATen overload), or a dict of all of them."""
    if func is None:
        return dict(OP_COUNTERS)
    return OP_COUNTERS.get(func, CacheInfo())


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event == _COMPILE_EVENT:
        COUNTERS.compiles += 1


def _on_event(event: str, **kwargs) -> None:
    if event == _PERSISTENT_HIT_EVENT:
        COUNTERS.persistent_cache_hits += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def count_host_read() -> None:
    COUNTERS.host_reads += 1


def count_host_op() -> None:
    COUNTERS.host_ops += 1


def stats() -> dict:
    """The eager engine's counters since import or the last ``reset_stats()``
    (Note [Eager engine counters]): ``compiles``, ``persistent_cache_hits``,
    ``executions``, ``cache_hits``, ``cache_misses``, ``host_reads``, ``host_ops``, ``executables``
    (the cache budget: ``entries``, ``bytes``, ``evictions``, ``budget_entries``,
    ``budget_bytes``) and ``ops``
    ({"aten::add.Tensor": {"calls", "traces", "keys", "op_by_op"}}, overloads that ran
    since the reset)."""
    ops = {}
    calls = traces = op_by_op = 0
    for func, c in list(OP_COUNTERS.items()):
        if not (c.calls or c.traces or c.op_by_op):
            continue
        ops[f"aten::{func._opname}.{func._overloadname}"] = {
            "calls": c.calls,
            "traces": c.traces,
            "keys": c.keys,
            "op_by_op": c.op_by_op,
        }
        calls += c.calls
        traces += c.traces
        op_by_op += c.op_by_op
    return {
        # jax reports a load from the persistent cache as a compile too.
        "compiles": max(COUNTERS.compiles - COUNTERS.persistent_cache_hits, 0),
        "persistent_cache_hits": COUNTERS.persistent_cache_hits,
        "executions": calls + op_by_op + FUSED.segments + CAPTURED.calls + CAPTURED.steps,
        "cache_hits": max(calls - traces, 0),
        "cache_misses": traces,
        "host_reads": COUNTERS.host_reads,
        "host_ops": COUNTERS.host_ops,
        "foreach_donations": COUNTERS.donations,
        "executables": _budget.cache_budget(),
        "fused_ops": FUSED.ops,
        "fused_segments": FUSED.segments,
        "fused_compiles": FUSED.compiles,
        "fused_op_by_op": FUSED.op_by_op,
        "fused_donations": FUSED.donations,
        "captured_calls": CAPTURED.calls,
        "capture_traces": CAPTURED.traces,
        "capture_refusals": CAPTURED.refusals,
        "capture_refusal_reasons": dict(CAPTURED.reasons),
        "captured_steps": CAPTURED.steps,
        "captured_step_refusals": CAPTURED.step_refusals,
        "ops": ops,
    }


def reset_stats() -> None:
    """Zero every counter of ``stats()`` (executables stay cached; ``keys`` counts
    executables built since the reset)."""
    COUNTERS.compiles = 0
    COUNTERS.persistent_cache_hits = 0
    COUNTERS.host_reads = 0
    COUNTERS.host_ops = 0
    COUNTERS.donations = 0
    FUSED.ops = FUSED.segments = FUSED.compiles = FUSED.op_by_op = FUSED.donations = 0
    CAPTURED.calls = CAPTURED.traces = CAPTURED.refusals = 0
    CAPTURED.reasons = {}
    CAPTURED.steps = CAPTURED.step_refusals = 0
    _budget.reset_counters()
    for c in list(OP_COUNTERS.values()):
        c.calls = c.traces = c.keys = c.op_by_op = 0
