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
    from torchjax.ops import copy as tj_copy
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


if __name__ == "__main__":
    main()
