"""Host cost per op of fused eager mode: recording, and the flush of a cached segment.

Note [Fused eager] in torchjax/ops/fused.py: in fused mode an op is recorded and each
segment runs later as one cached program. On an accelerator a device call costs about
100 us of host latency, so once segments are few, the Python cost of recording an op is
what eager speed is left with. This bench measures that host cost in steady state (the
same op sequence again, every program compiled):

- ``chain``: 400 small elementwise ops (``x = x * w; x = x + b``, 200 times) on (64, 64)
  float32 tensors;
- ``llama``: one forward of bench/models.py's tiny Llama over (1, 32) token ids
  (``torch.no_grad()``);
- ``mlp``: ``Linear(64, 64) - ReLU - Linear(64, 64)`` on an (8, 64) input
  (``torch.no_grad()``): three ops, one segment, so the per-call cost of entering
  ``torchjax.fused()`` and flushing is what the figure shows.

The per-op table records every op (``torchjax.fused(capture=False)``). A second table
times whole calls of the module workloads (llama, mlp): plain eager, fused with every op
recorded, fused with the repeated call captured as one program (Note [Captured module
calls] in torchjax/compile/_captured.py) and ``torchjax.jit`` of the module, in ms of
host time per call (the same clock).

Columns, per op (the op count is ``fused_ops`` of one run, the ops recorded): ``eager``
the host time of plain eager (no blocking inside the timed region: dispatch is
asynchronous), ``record`` the host time of the ops in ``torchjax.fused()`` minus the
flushes, ``flush`` the host time of the flushes (finding the segment's program and
calling it, not waiting for it), ``fused`` the two together. Times are the calling
thread's CPU time (``time.thread_time_ns``: what the host spends, barely affected by
other processes on a busy machine); ``--clock wall`` takes wall time instead, which on
CPU also holds XLA running the programs. Each figure is the median of ``RUNS`` runs
after ``WARMUP`` runs; the output is blocked on between runs, outside the timed region.
The counts are ``torchjax.stats()`` over the timed runs (per run) and the calls of
``jax.make_jaxpr`` and ``jax.eval_shape`` made meanwhile: 0 compiles and 0 JAX traces
in steady state mean nothing is retraced or relowered. ``dispatches``: the ATen ops
reaching ``__torch_dispatch__`` per run (views and other ops that are not recorded
included). ``floor`` (chain only): the same loop on a tensor subclass whose
``__torch_dispatch__`` only returns a new wrapper tensor, the cost of torch's dispatch
and of making the result tensor, before any torchjax work.

``--profile``: where the recording time goes, for each workload: inclusive wall time per
op of the parts of the recording path (each part timed by a wrapper, which adds about
0.2 us per timed call to it and to the parts around it; a part not called shows 0;
``fused.record`` includes the flush it makes when a segment is full), then cProfile's top
functions.

Run:  python bench/fused_overhead.py [--profile] [--workloads chain,llama,mlp]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pathlib
import pstats
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import jax  # noqa: E402
import torch  # noqa: E402

import torchjax  # noqa: E402
from bench.common import block_torch, header  # noqa: E402
from torchjax.ops import cached_compute  # noqa: E402
from torchjax.ops import fused as F  # noqa: E402
from torchjax.tensor import _storage  # noqa: E402
from torchjax.tensor._tensor import JaxTensor  # noqa: E402

RUNS = 30
WARMUP = 5
CHAIN_PAIRS = 200
# The clock of every figure: the calling thread's CPU time (``--clock wall``: wall time).
CLOCK = [time.thread_time_ns]


def _chain_workload():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g).to("tpu")
    w = (1 + 0.01 * torch.randn(64, 64, generator=g)).to("tpu")
    b = (0.01 * torch.randn(64, 64, generator=g)).to("tpu")

    return lambda: _chain(x, w, b)


def _chain(x, w, b):
    """The measured chain: ``CHAIN_PAIRS`` multiply-add pairs."""
    y = x
    for _ in range(CHAIN_PAIRS):
        y = y * w
        y = y + b
    return y


def _llama_workload():
    from bench.models import tiny_llama

    model = tiny_llama().to("tpu")
    ids = torch.randint(3, 128, (1, 32), generator=torch.Generator().manual_seed(0)).to("tpu")

    def run():
        with torch.no_grad():
            return model(input_ids=ids).logits

    jitted = torchjax.jit(model)

    def run_jit():
        with torch.no_grad():
            return jitted(input_ids=ids).logits

    run.jit = run_jit
    return run


def _mlp_workload():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)
    ).to("tpu")
    x = torch.randn(8, 64, generator=g).to("tpu")

    def run():
        with torch.no_grad():
            return model(x)

    jitted = torchjax.jit(model)

    def run_jit():
        with torch.no_grad():
            return jitted(x)

    run.jit = run_jit
    return run


WORKLOADS = {"chain": _chain_workload, "llama": _llama_workload, "mlp": _mlp_workload}


class _FlushTimer:
    """Wraps ``fused.flush`` (every flush goes through it), summing its host time."""

    def __init__(self):
        self.ns = 0

    @contextlib.contextmanager
    def installed(self):
        inner = F.flush

        def flush(seg):
            t0 = CLOCK[0]()
            try:
                return inner(seg)
            finally:
                self.ns += CLOCK[0]() - t0

        F.flush = flush
        try:
            yield
        finally:
            F.flush = inner


@contextlib.contextmanager
def _jax_traces(counts):
    """Counts calls of ``jax.make_jaxpr`` and ``jax.eval_shape`` (how a recorded op's
    output shapes would be found) while open."""
    saved = {name: getattr(jax, name) for name in ("make_jaxpr", "eval_shape")}

    def counting(name, fn):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return call

    for name, fn in saved.items():
        setattr(jax, name, counting(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(jax, name, fn)


def _dispatches(run) -> int:
    """ATen ops reaching ``JaxTensor.__torch_dispatch__`` in one fused run."""
    raw = JaxTensor.__dict__["__torch_dispatch__"]
    inner = raw.__func__
    count = [0]

    def counting(cls, func, types, args=(), kwargs=None):
        count[0] += 1
        return inner(cls, func, types, args, kwargs)

    JaxTensor.__torch_dispatch__ = classmethod(counting)
    try:
        with torchjax.fused(capture=False):
            out = run()
    finally:
        JaxTensor.__torch_dispatch__ = raw
    block_torch(out)
    return count[0]


def _fused_run(run, timer, capture=False):
    timer.ns = 0
    t0 = CLOCK[0]()
    with torchjax.fused(capture=capture):
        out = run()
    total = CLOCK[0]() - t0
    return out, total - timer.ns, timer.ns


def measure(name: str) -> dict:
    run = WORKLOADS[name]()
    timer = _FlushTimer()
    with timer.installed():
        for _ in range(WARMUP):
            block_torch(run())
            block_torch(_fused_run(run, timer)[0])
        eager, record, flush = [], [], []
        for _ in range(RUNS):
            t0 = CLOCK[0]()
            out = run()
            eager.append(CLOCK[0]() - t0)
            block_torch(out)
        torchjax.reset_stats()
        traces: dict = {}
        with _jax_traces(traces):
            for _ in range(RUNS):
                out, rec, fl = _fused_run(run, timer)
                record.append(rec)
                flush.append(fl)
                block_torch(out)
        stats = torchjax.stats()
        dispatches = _dispatches(run)
    ops = stats["fused_ops"] / RUNS
    med = lambda xs: statistics.median(xs) / 1000 / ops  # noqa: E731  (us per op)
    return {
        "ops": ops,
        "dispatches": dispatches,
        "segments": stats["fused_segments"] / RUNS,
        "fused_compiles": stats["fused_compiles"],
        "compiles": stats["compiles"],
        "jax traces": sum(traces.values()),
        "eager": med(eager),
        "record": med(record),
        "flush": med(flush),
        "fused": med([r + f for r, f in zip(record, flush)]),
    }


def _per_call(call) -> float:
    """Median host time of ``call()`` in ms (warmed up; blocked on outside the timing)."""
    for _ in range(WARMUP):
        block_torch(call())
    samples = []
    for _ in range(RUNS):
        t0 = CLOCK[0]()
        out = call()
        samples.append(CLOCK[0]() - t0)
        block_torch(out)
    return statistics.median(samples) / 1e6


def measure_calls(name: str) -> dict | None:
    """Per call of a module workload: plain eager, fused (ops recorded), captured (Note
    [Captured module calls]) and torchjax.jit, in ms; None for a workload that is no
    module call."""
    run = WORKLOADS[name]()
    if not hasattr(run, "jit"):
        return None
    timer = _FlushTimer()

    def fused(capture):
        return lambda: _fused_run(run, timer, capture)[0]

    out = {"eager": _per_call(run), "fused": _per_call(fused(False))}
    torchjax.reset_stats()
    out["captured"] = _per_call(fused(True))
    stats = torchjax.stats()
    out["captured_calls"] = stats["captured_calls"]
    out["capture_traces"] = stats["capture_traces"]
    out["jit"] = _per_call(run.jit)
    return out


class _Bare(torch.Tensor):
    """A tensor subclass whose ops only make a new wrapper: torch's dispatch alone."""

    @staticmethod
    def __new__(cls, size, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, size, dtype=dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _Bare(args[0].shape, args[0].dtype)


def floor_us() -> float:
    x, w, b = (_Bare((64, 64), torch.float32) for _ in range(3))

    def run():
        return _chain(x, w, b)

    for _ in range(WARMUP):
        run()
    samples = []
    for _ in range(RUNS):
        t0 = CLOCK[0]()
        run()
        samples.append(CLOCK[0]() - t0)
    return statistics.median(samples) / 1000 / (2 * CHAIN_PAIRS)


# The recording path's parts: (label, owner, attribute).
_PARTS = [
    ("CompiledCompute.__call__ (key, lookup, record)", cached_compute.CompiledCompute, "__call__"),
    ("fused.record", F, "record"),
    ("fused._shapes (output avals, cached)", F, "_shapes"),
    ("fused._append (wiring, Pending)", F, "_append"),
    ("fused.wrap (storage, tensor)", F, "wrap"),
    ("Storage.made_later", _storage.Storage, "made_later"),
    ("make (torch wrapper subclass)", F, "make"),
    ("fused.flush", F, "flush"),
]


@contextlib.contextmanager
def _timed_parts(totals):
    saved = []
    for label, owner, attr in _PARTS:
        raw = owner.__dict__.get(attr)
        if raw is None:
            continue
        fn = raw.__func__ if isinstance(raw, classmethod) else raw

        def timed(*args, _fn=fn, _label=label, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                totals[_label] = totals.get(_label, 0) + time.perf_counter_ns() - t0

        setattr(owner, attr, classmethod(timed) if isinstance(raw, classmethod) else timed)
        saved.append((owner, attr, raw))
    try:
        yield
    finally:
        for owner, attr, raw in saved:
            setattr(owner, attr, raw)


def profile(name: str) -> str:
    run = WORKLOADS[name]()
    timer = _FlushTimer()
    for _ in range(WARMUP):
        block_torch(_fused_run(run, timer)[0])
    torchjax.reset_stats()
    totals: dict = {}
    t0 = time.perf_counter_ns()
    with _timed_parts(totals):
        for _ in range(RUNS):
            block_torch(_fused_run(run, timer)[0])
    wall = time.perf_counter_ns() - t0
    n = torchjax.stats()["fused_ops"]
    lines = [f"\n### {name}: parts of fused mode (inclusive wall us per op, timers included)\n"]
    lines.append(f"| everything (blocking included) | {wall / 1000 / n:.2f} |")
    for label, _, _ in _PARTS:
        lines.append(f"| {label} | {totals.get(label, 0) / 1000 / n:.2f} |")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(RUNS):
        block_torch(_fused_run(run, timer)[0])
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(20)
    text = buf.getvalue()
    lines.append(f"\ncProfile, {RUNS} runs, by own time:\n```\n{text[text.find('ncalls') :]}```")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread")
    opts = parser.parse_args()
    if opts.clock == "wall":
        CLOCK[0] = time.perf_counter_ns
    names = opts.workloads.split(",")
    print(header("Fused eager: host time per op (steady state)"))
    print(f"\nmedian of {RUNS} runs after {WARMUP}; us per op ({opts.clock} clock)\n")
    print(
        "| workload | ops | dispatches | segments | fused_compiles | compiles | jax traces "
        "| eager | record | flush | fused | eager/fused |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        r = measure(name)
        print(
            f"| {name} | {r['ops']:.0f} | {r['dispatches']} | {r['segments']:.1f} "
            f"| {r['fused_compiles']} | {r['compiles']} | {r['jax traces']} "
            f"| {r['eager']:.1f} | {r['record']:.1f} "
            f"| {r['flush']:.1f} | {r['fused']:.1f} | {r['eager'] / r['fused']:.2f}x |"
        )
    print(
        "\nPer module call (ms): fused records every op (``fused(capture=False)``), "
        "captured runs the repeated call as one program (Note [Captured module calls])\n"
    )
    print(
        "| workload | eager | fused | captured | torchjax.jit | captured calls / traces "
        "| fused/captured | captured/jit |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        c = measure_calls(name)
        if c is None:
            continue
        print(
            f"| {name} | {c['eager']:.3f} | {c['fused']:.3f} | {c['captured']:.3f} "
            f"| {c['jit']:.3f} | {c['captured_calls']} / {c['capture_traces']} "
            f"| {c['fused'] / c['captured']:.1f}x | {c['captured'] / c['jit']:.2f}x |"
        )
    if "chain" in names:
        print(f"\nfloor (a do-nothing __torch_dispatch__ subclass, chain): {floor_us():.1f} us/op")
    if opts.profile:
        for name in names:
            print(profile(name))


if __name__ == "__main__":
    main()
