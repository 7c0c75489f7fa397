"""Device checks of compiled programs: what carrying them out of the program costs.

torchjax.jit returns the device checks of its ops (an embedding's index range, Note
[Device checks of compiled programs] in torchjax/device/_checks.py) as four more outputs
of the program and queues them after each call. This compares the same programs with the
checks carried (the default) and with the checks dropped at trace time (what torchjax.jit
did before it carried them; patched in here only, for the comparison):

- tiny Llama forward: transformers LlamaConfig, 4 layers, hidden 256, 4 heads (2 KV
  heads), vocab 1024, over (1, 128) token ids (bench/compiled.py's model), and over
  (1, 1) (a decode-sized call, where per-call costs show most);
- tiny Llama train step: forward, cross-entropy, backward and SGD in one program;
- a step holding a check made at the op (``ids % divisor`` with a tensor divisor): its
  call reads the flags when it returns, so back-to-back calls no longer overlap;
- ``x[i]`` on 8 floats: next to no compute, so the figure is the per-call cost of
  torchjax.jit itself, where the checks' outputs and their queueing show most.

Each figure: median wall time per call, over calls issued back to back (``BATCH`` calls,
then one block on the last result), after warm-up, the two variants' samples
alternating; the first call of a fresh torchjax.jit (trace and compile, the ops' own
executables already compiled; median of 3, JAX's persistent cache off) is reported apart.

Run:  python bench/checks.py
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every first call compiles: no program loaded from JAX's persistent cache.
os.environ["TORCHJAX_COMPILATION_CACHE"] = "0"

import torch  # noqa: E402

from bench.common import block_torch, fmt_us, header, ratio  # noqa: E402
from bench.compiled import llama  # noqa: E402

RUNS = 30
BATCH = 10


@contextlib.contextmanager
def checks_dropped():
    """torchjax.jit tracing programs whose checks are dropped (the comparison's base)."""
    from torchjax.device import _checks

    class Dropping(_checks.Carried):
        def take(self, entries, at_op):
            pass

    original = _checks.carried
    _checks.carried = Dropping
    try:
        yield
    finally:
        _checks.carried = original


def _batch_us(call) -> float:
    """Wall time per call of ``BATCH`` calls issued back to back, one block at the end."""
    t0 = time.perf_counter()
    for _ in range(BATCH):
        out = call()
    block_torch(out)
    elapsed = (time.perf_counter() - t0) / BATCH
    torch.tpu.synchronize()  # the queued checks are read between samples, not timed
    return elapsed * 1e6


def _cases():
    import torchjax

    model = llama().to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    long_ids = torch.randint(0, 1024, (1, 128), generator=gen).to("tpu")
    short_ids = torch.randint(0, 1024, (1, 1), generator=gen).to("tpu")
    divisor = torch.tensor(7, device="tpu")
    x, i = torch.arange(8.0, device="tpu"), torch.tensor([3], device="tpu")

    def forward(ids):
        with torch.no_grad():
            return model(ids).logits

    def train(ids):
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def wrapped(ids):
        with torch.no_grad():
            return model(ids % divisor).logits

    return [
        ("tiny Llama forward, (1, 128)", lambda: torchjax.jit(forward), long_ids),
        ("tiny Llama forward, (1, 1)", lambda: torchjax.jit(forward), short_ids),
        ("tiny Llama train step, (1, 128)", lambda: torchjax.jit(train), long_ids),
        ("forward of ids % tensor (a check at the op)", lambda: torchjax.jit(wrapped), long_ids),
        ("x[i], 8 floats (per-call overhead)", lambda: torchjax.jit(lambda i: x[i]), i),
    ]


def _first_call_us(make, ids, ctx) -> float:
    """Trace and compile: the first call of a fresh torchjax.jit of the function."""
    with ctx():
        fn = make()
        t0 = time.perf_counter()
        block_torch(fn(ids))
        return (time.perf_counter() - t0) * 1e6


def run() -> list:
    variants = (("dropped", checks_dropped), ("carried", contextlib.nullcontext))
    rows = []
    for title, make, ids in _cases():
        row, calls = {"title": title}, {}
        for label, ctx in variants:
            with ctx():
                fn = make()
                block_torch(fn(ids))  # the ops' own executables compile here
            calls[label] = lambda fn=fn: fn(ids)
            _batch_us(calls[label])  # warm-up
        # The two variants alternate, so that drift in the machine's load hits both.
        samples = {label: [] for label, _ in variants}
        for _ in range(RUNS):
            for label, call in calls.items():
                samples[label].append(_batch_us(call))
        firsts = {label: [] for label, _ in variants}
        for _ in range(3):
            for label, ctx in variants:
                firsts[label].append(_first_call_us(make, ids, ctx))
        for label, _ in variants:
            row[label] = statistics.median(samples[label])
            row[f"{label} first"] = statistics.median(firsts[label])
        rows.append(row)
    return rows


def report(rows) -> str:
    lines = [
        header("Device checks of compiled programs: cost per call"),
        "",
        f"Per call: median of {RUNS} x ({BATCH} calls back to back, one block). First call:"
        " trace and compile of a fresh torchjax.jit (median of 3).",
        "",
        "| program | checks dropped | checks carried | ratio | first call, dropped | "
        "first call, carried |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['title']} | {fmt_us(r['dropped'])} | {fmt_us(r['carried'])} | "
            f"{ratio(r['carried'], r['dropped'])} | {fmt_us(r['dropped first'])} | "
            f"{fmt_us(r['carried first'])} |"
        )
    return "\n".join(lines)


def main() -> str:
    table = report(run())
    print(table)
    return table


if __name__ == "__main__":
    main()
