"""Where a warm compiled ``generate`` spends its host time.

The 1.1B Llama of bench/tpu.py (``--small``: the tiny one) in bfloat16 with seeded random
weights, greedy ``generate`` of 128 tokens after a 128-token prompt (the default path on
tpu: a static cache, a compiled prefill and one decode loop program), warmed up by two
calls. Then, over ``--runs`` calls, the wall time of a call is split by what the host was
doing, each part exclusive of the parts inside it:

- ``eager ops``: torch ops on tpu tensors run one by one outside any compiled program
  (transformers' setup, the cache reset), each an op-level program call, or run on the
  host when their integer inputs' values are there (counted apart);
- ``host reads``: device-to-host copies (``.item()``, ``.tolist()``, ``bool(t)``), which
  wait for the device to finish the work queued before them;
- ``call setup``: torchjax.jit's per-call work before a program runs (arguments, the
  walk of the state, the cache key);
- ``program calls``: dispatching the compiled programs (prefill, first token, the loop)
  and writing their results back;
- ``other``: everything else: transformers' Python, torchjax's generate glue.

With the main thread's CPU time per call (``time.thread_time``: the host's own work,
the waits for the device left out; steadier than the wall on a busy machine), the
counts of eager ops and host reads per call (where each comes from: the caller outside
torch and torchjax), and cProfile's top functions by own time for one call. Compare the
wall with bench/tpu.py's pure-JAX loop on the same chip.

``--layers N`` gives the model N layers (the 1.1B has 16): with ``--small``, the host's
per-layer work (state walks, the cache's Python state) at the chip model's depth
without its compute, on CPU.

Before those, over as many calls with nothing else timed, the medians of three phases of
a call, in wall and main-thread CPU time: the ``prelude``, from entering
``model.generate`` to the prefill program's dispatch (transformers' setup and
torchjax's glue: host time the device does not overlap), ``between``, from the prefill
program's dispatch to the decode loop's (the prefill's and the first token's program
calls and the loop's call setup: host time the device overlaps only while it runs the
prefill), and ``after the loop``, from the end of the last program call or host read to
``generate``'s return; then cProfile's top functions of one call's prelude, by
cumulative time.

Run:  python bench/generate_host.py [--small] [--layers N] [--batch 1] [--runs 5]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pathlib
import pstats
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers as tf  # noqa: E402

from bench.common import header  # noqa: E402
from bench.tpu import _generate, _prompt, llama_config  # noqa: E402

# Frames skipped when naming a caller: the libraries below the code that calls them
# (torchjax's generate glue in torchjax/integrations is named).
_OWN = (
    "/torch/",
    "/bench/",
    "/jax/",
    "/jaxlib/",
    "/torchjax/ops/",
    "/torchjax/tensor/",
    "/torchjax/compile/",
    "/torchjax/device/",
    "/torchjax/_compat/",
    "/contextlib.py",
)


class Split:
    """Exclusive wall time per label across nested timed calls."""

    def __init__(self):
        self.time = collections.Counter()
        self.count = collections.Counter()
        self.where = collections.defaultdict(collections.Counter)
        self.stack = []
        self.on = False

    def run(self, label, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, its time counted to ``label`` less that of the timed
        calls inside it (which are counted to theirs)."""
        self.stack.append([label, time.perf_counter(), 0.0])
        try:
            return fn(*args, **kwargs)
        finally:
            lab, t0, inner = self.stack.pop()
            took = time.perf_counter() - t0
            self.time[lab] += took - inner
            self.count[lab] += 1
            if self.stack:
                self.stack[-1][2] += took

    def wrap(self, owner, name, label, where=False, outer_only=False):
        fn = getattr(owner, name)
        split = self

        def timed(*args, **kwargs):
            if not split.on or (outer_only and any(f[0] == label for f in split.stack)):
                return fn(*args, **kwargs)
            if where:
                split.where[label][_caller()] += 1
            return split.run(label, fn, *args, **kwargs)

        setattr(owner, name, timed)
        return fn


class Phases:
    """Wraps ``model.generate``, its compiled forward's program call (the prefill), the
    decode loop's program call (``loop``: owner and name) and the program calls and host
    reads, to time a call's prelude, the host time from the prefill's program call to the
    loop's, and what follows its last program call or host read."""

    def __init__(self, model, program_calls, loop):
        self.on = False
        self.prelude, self.between, self.after = [], [], []  # (wall, main-thread CPU) per call
        self.profile = None  # a cProfile.Profile run over the next call's prelude
        self.first = self.last = self.loop = None
        generate, jitted = model.generate, model.forward.jitted

        def prefill(*args, **kwargs):
            if self.profile is not None:
                self.profile.disable()
                self.profile = None
            if self.first is None:
                self.first = _now()
            return type(jitted)._run(jitted, *args, **kwargs)

        def timed(*args, **kwargs):
            if self.profile is not None:
                self.profile.enable()
            if not self.on:
                return generate(*args, **kwargs)
            self.first = self.last = self.loop = None
            enter = _now()
            out = generate(*args, **kwargs)
            self.prelude.append([b - a for a, b in zip(enter, self.first)])
            self.between.append([b - a for a, b in zip(self.first, self.loop)])
            self.after.append([b - a for a, b in zip(self.last, _now())])
            return out

        for owner, name in program_calls:
            setattr(owner, name, self._ends(getattr(owner, name)))
        run_loop = getattr(*loop)

        def loop_call(*args, **kwargs):
            if self.loop is None:
                self.loop = _now()
            return run_loop(*args, **kwargs)

        setattr(*loop, loop_call)
        jitted._run = prefill
        model.generate = timed

    def _ends(self, fn):
        def ends(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            finally:
                self.last = _now()

        return ends

    def report(self) -> None:
        phases = ("prelude", self.prelude), ("between", self.between)
        for name, xs in (*phases, ("after the loop", self.after)):
            wall, cpu = (sorted(x) for x in zip(*xs))
            mid = len(wall) // 2
            print(f"  {name:14s} wall {wall[mid] * 1e3:6.2f} ms (min {wall[0] * 1e3:.2f}), "
                  f"main-thread CPU {cpu[mid] * 1e3:.2f} ms")  # fmt: skip


def _now() -> tuple:
    return time.perf_counter(), time.thread_time()


def _caller() -> str:
    for f in reversed(traceback.extract_stack()[:-2]):
        if not any(p in f.filename for p in _OWN):
            return f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
    return "?"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(header("Host time of a warm compiled generate: bench/generate_host.py"))

    from jax._src import core as jcore

    from torchjax.compile import _call, _jit, _repeat
    from torchjax.tensor._tensor import JaxTensor

    torch.manual_seed(0)
    cfg = llama_config(args.small)
    if args.layers is not None:
        cfg.num_hidden_layers = args.layers
    model = tf.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval().to("tpu")
    ids = _prompt(args.batch, 128, cfg.vocab_size).to("tpu")
    new = 128
    for _ in range(2):
        _generate(model, ids, new)

    # The phases first, with nothing else timed.
    from torchjax.ops import copy as tj_copy

    calls = [(tj_copy, "to_host"), (_jit.Jitted, "_run"), (_repeat, "run")]
    phases = Phases(model, calls, loop=(_repeat, "run"))
    phases.on = True
    for _ in range(args.runs):
        _generate(model, ids, new)
    phases.on = False

    split = Split()
    dispatch = JaxTensor.__dict__["__torch_dispatch__"].__func__

    def top_dispatch(cls, func, types, a=(), kw=None):
        if (
            split.on
            and jcore.trace_state_clean()
            and not any(f[0] == "eager ops" for f in split.stack)
        ):
            split.where["eager ops"][f"{func} @ {_caller()}"] += 1
            return split.run("eager ops", dispatch, cls, func, types, a, kw)
        return dispatch(cls, func, types, a, kw)

    JaxTensor.__torch_dispatch__ = classmethod(top_dispatch)
    split.wrap(tj_copy, "to_host", "host reads", where=True)
    split.wrap(_call.Call, "__init__", "call setup")
    split.wrap(_jit.Jitted, "_run", "program calls")
    split.wrap(_repeat, "run", "program calls", outer_only=True)

    import torchjax

    walls, cpus = [], []
    torchjax.reset_stats()
    for _ in range(args.runs):
        split.on = True
        t0, c0 = time.perf_counter(), time.thread_time()
        _generate(model, ids, new)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
        split.on = False
    runs = args.runs
    wall = sum(walls) / runs * 1e3
    parts = {k: v / runs * 1e3 for k, v in split.time.items()}
    rate = args.batch * new / (sum(walls) / runs)
    print(f"\nbatch {args.batch}, {new} new tokens: wall {wall:.1f} ms per generate "
          f"(min {min(walls) * 1e3:.1f}), {rate:.1f} tok/s")  # fmt: skip
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {k:14s} {v:8.2f} ms  ({split.count[k] / runs:.0f} per call)")
    print(f"  {'other':14s} {wall - sum(parts.values()):8.2f} ms")
    print(f"  main-thread CPU {sum(cpus) / runs * 1e3:.2f} ms per call")
    phases.report()
    # Note [Integer ops on host values]: eager ops run on the host, no device program.
    print(
        f"  of the eager ops, run on the host: {torchjax.stats()['host_ops'] / runs:.0f} per call"
    )
    for label in ("host reads", "eager ops"):
        print(f"\n{label} by caller (per call):")
        for k, v in split.where[label].most_common(30):
            print(f"  {v / runs:5.1f}  {k}")

    prof = cProfile.Profile()
    prof.enable()
    _generate(model, ids, new)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    print("\ncProfile of one call, by own time:\n" + out.getvalue()[-6000:])

    phases.profile = prof = cProfile.Profile()
    _generate(model, ids, new)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(40)
    print("\ncProfile of one call's prelude, by cumulative time:\n" + out.getvalue()[-8000:])


if __name__ == "__main__":
    main()
