"""The ``eager`` section of bench/tpu.py: plain eager, fused eager (every op recorded, and
with repeated module calls captured) and ``torchjax.jit`` on the chip.

Plain eager runs every op as its own cached executable (one device call each); fused
eager (``with torchjax.fused(capture=False):``, Note [Fused eager] in
torchjax/ops/fused.py) records the ops and runs each segment as one program; captured
(``with torchjax.fused():``, Note [Captured module calls] in
torchjax/compile/_captured.py) runs a module call that repeats its signature as one
program traced from the module (the first call of a signature records op by op, the
second traces); ``torchjax.jit`` traces the whole function into one program. On an
accelerator a device call costs host latency that CPU JAX hides, so these rows say what
each mode is worth where it matters. Rows:

- ``forward 1.1B``: the Llama of bench/tpu.py (``llama_config``) in bfloat16, prefill
  forward of (1, 128) token ids under ``torch.no_grad()``, the logits;
- ``forward tiny``: bench/models.py's tiny Llama, forward of (1, 32);
- ``train tiny``, ``train 1.1B``: one AdamW step (forward with ``labels``, backward,
  ``opt.step()``, ``opt.zero_grad()``; lr 1e-4) of each model in bfloat16 on (1, 128)
  token ids, plain, fused, captured (from the second step the forward is one captured
  program and ``backward()`` one more: Note [Captured calls that need a graph]; from the
  second step ``opt.step()`` is one more: Note [Captured optimizer steps]) and jitted;
  every mode starts from the same weights and a new optimizer;
- ``generate``: greedy ``generate(..., disable_compile=True)`` of the 1.1B model (the
  forward eager, op by op) with the cache torchjax gives that call (static: Note [A
  static cache for eager generate on tpu]) and with transformers' ``DynamicCache``
  (``cache_implementation="dynamic"``: shapes grow every step), plain, fused and
  captured (each static-cache decode step repeats the previous one's signature; timed
  after a second warm-up generate, which runs every decode step captured); and the
  default compiled ``generate`` for scale. Tokens/s over ``new`` tokens, timed once after
  a warm-up generate of the same length; both stop at ``max_time`` seconds (a fused
  generate may compile a program per step), ``tokens`` says how far each got, and a
  warm-up that stopped short is not followed by a timed run;
- ``chain``: 400 small ops (``x = x * w; x = x + b``, 200 times, (64, 64) float32), us
  per op.

Per mode: ``first_s`` (the first call: traces and compiles), ``median_ms`` (steady state:
median of at least ``RUNS`` calls after a second warm-up call; every call blocks on its
outputs, a train step on every live array with ``torch.tpu.synchronize()``), and
``per_run``: ``torchjax.stats()`` over the timed calls divided by their number (XLA
``compiles``, programs loaded from the persistent compilation cache instead
(``cache_loads``: a compile in a process without that cache), ``executions`` of cached
programs, ``host_reads``, fused ``segments``, ``fused_compiles``, ``fused_ops``
recorded, ``fused_op_by_op`` segments, ``captured_calls``, ``capture_traces``,
``capture_refusals``, ``captured_steps``, ``captured_step_refusals``,
``foreach_donations``), train rows' ``device_GiB`` (the chip's memory in use after the
mode's steps and the process's peak so far), and ``warm_up``: the same counters over the
warm-up calls together (a captured call traces, or is refused, at its second call, so
the timed calls show only what came of it); ``capture_refusal_reasons``, where a
signature was refused, says why (``torchjax.stats()``'s, per module class).
``fused_equal_eager`` and ``captured_equal_eager``: whether those modes' outputs
(forward: the logits; train: the first step's loss and every updated weight; generate:
the tokens) are bit for bit plain eager's, with the largest absolute difference;
``jit_max_abs_diff`` the same for ``torchjax.jit`` (not expected to be 0: XLA fuses
across ops). A row that
fails records its error and the rest run; a row is skipped once the section's time
budget (``BUDGET_S``) is spent. Each mode's JSON is printed to stderr as soon as that
mode finishes, and each row's (with its comparisons and ratios) when the row does, so a
run stopped by an outer time limit keeps the modes and rows it measured.
``TORCHJAX_BENCH_ROWS`` (comma-separated row names) runs only those rows;
``TORCHJAX_BENCH_MODES`` (comma-separated: ``eager``, ``fused``, ``captured``, ``jit``, and
for generate ``static``/``dynamic``, ``jit`` meaning its compiled run) only those modes;
``TORCHJAX_BENCH_MAX_TIME`` sets generate's ``max_time`` (20 s; the chip's first fused or
captured generate compiles for longer) and ``TORCHJAX_BENCH_BUDGET_S`` the section's.

Run:  python -m bench.tpu --sections eager   (``--small``: small models, off the chip)
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time

RUNS = 5
# no row or mode starts after this (one in flight finishes)
BUDGET_S = float(os.environ.get("TORCHJAX_BENCH_BUDGET_S", 330))
MAX_TIME = float(os.environ.get("TORCHJAX_BENCH_MAX_TIME", 20))
_MODES = {m.strip() for m in os.environ.get("TORCHJAX_BENCH_MODES", "").split(",") if m.strip()}
_DEADLINE = [float("inf")]
_STAT_KEYS = {
    "compiles": "compiles", "cache_loads": "persistent_cache_hits",
    "executions": "executions", "host_reads": "host_reads",
    "segments": "fused_segments", "fused_compiles": "fused_compiles",
    "captured_calls": "captured_calls", "capture_traces": "capture_traces",
    "capture_refusals": "capture_refusals", "captured_steps": "captured_steps",
    "captured_step_refusals": "captured_step_refusals",
    "fused_ops": "fused_ops", "fused_op_by_op": "fused_op_by_op",
    "foreach_donations": "foreach_donations",
}  # fmt: skip


def _device_memory() -> dict | None:
    """The chip's memory in use now and the process's peak so far, GiB (None where the
    backend does not report it: CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if not stats:
        return None
    return {
        k: round(stats.get(key, 0) / 2**30, 2)
        for k, key in (("in_use", "bytes_in_use"), ("peak", "peak_bytes_in_use"))
    }


def _progress(what: str) -> None:
    print(f"eager: {what} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)


def _done(name: str, mode: str, result: dict) -> None:
    """Print ``mode``'s result of row ``name`` now: a row stopped mid-way by an outer
    time limit keeps its finished modes."""
    _progress(f"{name}: {mode} done: {json.dumps(result)}")


def _skipped() -> dict | None:
    left = _DEADLINE[0] - time.perf_counter()
    return {"skipped": f"section budget ({BUDGET_S} s) spent"} if left < 0 else None


def _wanted(*modes: str) -> bool:
    """Whether ``TORCHJAX_BENCH_MODES`` (unset: all) asks for a mode: each of ``modes``
    that belongs to a family named there (``static``/``dynamic`` caches; the rest) must
    be named."""
    caches = {"static", "dynamic"}
    for m in modes:
        family = caches if m in caches else _MODES - caches
        if _MODES & family and m not in _MODES:
            return False
    return True


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def _per_run(before: dict, after: dict, runs: int) -> dict:
    return {k: round((after[v] - before[v]) / runs, 1) for k, v in _STAT_KEYS.items()}


def _timed(call, runs: int = RUNS, warm: bool = True) -> tuple[dict, object]:
    """``call()`` (blocking on its outputs) once cold, once more (``warm``), then ``runs``
    times: first seconds, median ms, stats per timed run; and the last output."""
    import torchjax

    start = torchjax.stats()
    t0 = time.perf_counter()
    out = call()
    row = {"first_s": round(time.perf_counter() - t0, 2)}
    if warm:
        out = call()
    before = torchjax.stats()
    row["warm_up"] = _per_run(start, before, 1)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - t0)
    row["median_ms"] = round(statistics.median(times) * 1e3, 3)
    after = torchjax.stats()
    row["per_run"] = _per_run(before, after, runs)
    reasons = _new_reasons(start, after)
    if reasons:
        row["capture_refusal_reasons"] = reasons
    return row, out


def _new_reasons(before: dict, after: dict) -> dict:
    """Why signatures were refused between two ``torchjax.stats()`` (per module class
    name, the latest reason; Note [Captured module calls])."""
    old = before["capture_refusal_reasons"]
    return {k: v[:600] for k, v in after["capture_refusal_reasons"].items() if old.get(k) != v}


def _flat(x) -> list:
    import torch

    if isinstance(x, torch.Tensor):
        return [x.detach().cpu()]
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in _flat(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat(v)]
    raise TypeError(f"cannot compare {type(x).__name__}")


def _diff(a, b) -> dict:
    """Bit-for-bit equality of two outputs (tensors, or lists/dicts of them) and the
    largest absolute difference."""
    import torch

    xs, ys = _flat(a), _flat(b)
    if len(xs) != len(ys) or any(x.shape != y.shape for x, y in zip(xs, ys)):
        return {"equal": False, "max_abs_diff": None, "why": "shapes differ"}
    equal = all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(xs, ys))
    worst = max(((x.double() - y.double()).abs().max().item() for x, y in zip(xs, ys)), default=0)
    return {"equal": equal, "max_abs_diff": worst}


def _compare(row: dict, outs: dict) -> None:
    for mode in ("fused", "captured"):
        if "eager" in outs and mode in outs:
            try:
                d = _diff(outs[mode], outs["eager"])
                row[f"{mode}_equal_eager"] = d["equal"]
                row[f"{mode}_max_abs_diff"] = d["max_abs_diff"]
            except Exception as e:  # noqa: BLE001 - reported, the rest runs
                row["compare_error"] = _error(e)
    if "eager" in outs and "jit" in outs:
        try:
            row["jit_max_abs_diff"] = _diff(outs["jit"], outs["eager"])["max_abs_diff"]
        except Exception as e:  # noqa: BLE001 - reported, the rest runs
            row["compare_error"] = _error(e)


def _ratios(row: dict, unit: str = "median_ms") -> None:
    modes = ("eager", "fused", "captured", "jit")
    got = {m: row[m][unit] for m in modes if unit in row.get(m, {})}
    for a, b in (("fused", "jit"), ("eager", "fused"), ("captured", "jit"), ("fused", "captured")):
        if a in got and b in got:
            row[f"{a}/{b}"] = round(got[a] / got[b], 2)


def _modes(name: str, fn, runs: int = RUNS, captured: bool = True) -> dict:
    """Rows of ``fn()`` (blocking on and returning its outputs) plain, fused (every op
    recorded: ``fused(capture=False)``), captured (fused with its repeated module call
    run as one program: Note [Captured module calls]; ``captured``: ``fn`` makes one)
    and ``torchjax.jit(fn)()``; each mode's failure is its own."""
    import torchjax

    jitted = torchjax.jit(fn)

    def fused(capture=False):
        with torchjax.fused(capture=capture):
            out = fn()
        return out

    from bench.common import block_torch

    calls = [("eager", fn), ("fused", fused)]
    if captured:
        calls.append(("captured", lambda: fused(True)))
    calls.append(("jit", lambda: block_torch(jitted())))
    row, outs = {}, {}
    for mode, call in calls:
        if not _wanted(mode):
            continue
        _progress(f"{name}: {mode}")
        if _skipped():
            row[mode] = _skipped()
            continue
        try:
            row[mode], outs[mode] = _timed(call, runs)
        except Exception as e:  # noqa: BLE001 - reported, the rest runs
            row[mode] = {"error": _error(e)}
        _done(name, mode, row[mode])
    _compare(row, outs)
    _ratios(row)
    return row


def _ids(vocab: int, seq: int, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, seq), generator=gen).to("tpu")


def _big(small: bool):
    import torch
    import transformers as tf

    from bench.tpu import llama_config

    if small:  # the tiny Llama in bfloat16: its programs are the tiny rows' (CPU time)
        return _tiny().to(torch.bfloat16)
    torch.manual_seed(0)
    with torch.device("tpu"):
        return tf.LlamaForCausalLM(llama_config(small)).to(torch.bfloat16).eval()


def _tiny():
    from bench.models import tiny_llama

    return tiny_llama().to("tpu")


def forward(model, seq: int, name: str) -> dict:
    import torch

    from bench.common import block_torch

    ids = _ids(model.config.vocab_size, seq)

    def fn():
        with torch.no_grad():
            return block_torch(model(ids).logits)

    return {"tokens": list(ids.shape), **_modes(name, fn)}


def train(model, seq: int, name: str, runs: int = RUNS) -> dict:
    """AdamW steps in each mode from the same starting weights; outputs compared: the
    first step's loss and the weights after it."""
    import torch

    import torchjax
    from bench.common import lm_train_step

    model.train()
    start = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    ids = _ids(model.config.vocab_size, seq, seed=1)
    row, outs = {"tokens": list(ids.shape)}, {}
    for mode in ("eager", "fused", "captured", "jit"):
        if not _wanted(mode):
            continue
        _progress(f"{name}: {mode}")
        if _skipped():
            row[mode] = _skipped()
            continue
        model.load_state_dict(start)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

        step = lm_train_step(model, opt)
        run = torchjax.jit(step) if mode == "jit" else step

        def call(run=run, mode=mode):
            with torchjax.fused(mode in ("fused", "captured"), capture=mode == "captured"):
                loss = run(ids)
            torch.tpu.synchronize()  # every live array: the loss and every update
            return loss

        try:
            t0 = time.perf_counter()
            loss = call()
            first = round(time.perf_counter() - t0, 2)
            outs[mode] = {
                "loss": loss,
                **{k: v.detach().cpu() for k, v in model.named_parameters()},
            }
            row[mode], last = _timed(call, runs)
            row[mode]["first_s"] = first  # the step from the starting weights
            row[mode]["loss_first_step"] = round(loss.item(), 5)
            row[mode]["loss_last_step"] = round(last.item(), 5)
            row[mode]["device_GiB"] = _device_memory()
        except Exception as e:  # noqa: BLE001 - reported, the rest runs
            row[mode] = {"error": _error(e)}
        _done(name, mode, row[mode])
        # This mode's optimizer state (the step's closure holds it too), freed before the
        # next mode's: the 1.1B's moments are 4.4 GB.
        opt = run = call = step = None
        gc.collect()
    _compare(row, outs)
    _ratios(row)
    model.load_state_dict(start)
    model.eval()
    return row


def generate(model, new: int, max_time: float) -> dict:
    import torch

    import torchjax
    from bench.common import block_torch

    ids = _ids(model.config.vocab_size, 32, seed=2)

    def gen(**extra):
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                min_new_tokens=new, do_sample=False, pad_token_id=0, **extra,
            )  # fmt: skip
        return block_torch(out)

    row = {"prompt": int(ids.shape[1]), "new": new}
    caches = {"static": {}, "dynamic": {"cache_implementation": "dynamic"}}
    for cache, extra in caches.items():
        outs = {}
        for mode in ("eager", "fused", "captured"):
            if not _wanted(cache, mode):
                continue
            _progress(f"generate, {cache} cache: {mode}")
            key = f"{cache}, {mode}"
            if _skipped():
                row[key] = _skipped()
                continue
            try:
                with torchjax.fused(mode != "eager", capture=mode == "captured"):
                    start = torchjax.stats()
                    t0 = time.perf_counter()
                    out = gen(disable_compile=True, max_time=max_time, **extra)
                    first = time.perf_counter() - t0
                    got = out.shape[1] - ids.shape[1]
                    row[key] = {"first_s": round(first, 2), "first_tokens": got}
                    if got < new:  # stopped at max_time: a timed run would compile again
                        row[key]["not_timed"] = f"warm-up stopped at max_time={max_time}s"
                        continue
                    if mode == "captured":
                        # The first generate traced its second decode step; the second
                        # captures them all but still compiles a segment or two around
                        # them (its first decode step is no longer recorded).
                        gen(disable_compile=True, max_time=max_time, **extra)
                    before = torchjax.stats()
                    t0 = time.perf_counter()
                    out = gen(disable_compile=True, max_time=max_time, **extra)
                    wall = time.perf_counter() - t0
                got = out.shape[1] - ids.shape[1]
                if got == new:
                    outs[mode] = out
                row[key]["tokens"] = got
                row[key]["tok_s"] = round(got / wall, 2)
                after = torchjax.stats()
                row[key]["per_run"] = _per_run(before, after, 1)
                row[key]["warm_up"] = _per_run(start, before, 1)
                reasons = _new_reasons(start, after)
                if reasons:
                    row[key]["capture_refusal_reasons"] = reasons
            except Exception as e:  # noqa: BLE001 - reported, the rest runs
                row[key] = {"error": _error(e)}
            finally:  # also after a warm-up that stopped short (``continue``)
                if key in row:
                    _done("generate", key, row[key])
        for mode in ("fused", "captured"):
            if "eager" in outs and mode in outs:
                row[f"{cache}: {mode}_tokens_equal_eager"] = bool(
                    torch.equal(outs[mode].cpu(), outs["eager"].cpu())
                )
    if not _wanted("jit"):
        return row
    _progress("generate, compiled")
    if _skipped():
        row["compiled"] = _skipped()
        return row
    try:
        t0 = time.perf_counter()
        gen()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        gen()
        row["compiled"] = {
            "first_s": round(first, 2),
            "tok_s": round(new / (time.perf_counter() - t0), 2),
        }
    except Exception as e:  # noqa: BLE001 - reported, the rest runs
        row["compiled"] = {"error": _error(e)}
    _done("generate", "compiled", row["compiled"])
    return row


def chain() -> dict:
    import torch

    from bench.common import block_torch
    from bench.fused_overhead import CHAIN_PAIRS, _chain

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g).to("tpu")
    w = (1 + 0.01 * torch.randn(64, 64, generator=g)).to("tpu")
    b = (0.01 * torch.randn(64, 64, generator=g)).to("tpu")
    row = _modes("chain", lambda: block_torch(_chain(x, w, b)), runs=20, captured=False)
    ops = 2 * CHAIN_PAIRS
    row["ops"] = ops
    for mode in ("eager", "fused", "captured", "jit"):
        if "median_ms" in row.get(mode, {}):
            row[mode]["us_per_op"] = round(row[mode]["median_ms"] * 1e3 / ops, 2)
    return row


def eager(ctx) -> dict:
    import torch

    _DEADLINE[0] = time.perf_counter() + BUDGET_S
    seq = 32 if ctx.small else 128
    out: dict = {}
    big = [None]

    def model():
        if big[0] is None:
            big[0] = _big(ctx.small)
        return big[0]

    # cheapest first: a run stopped by the budget keeps the most rows
    rows = {
        "chain": chain,
        "forward tiny": lambda: forward(_tiny(), 32, "forward tiny"),
        "forward 1.1B bf16": lambda: forward(model(), seq, "forward 1.1B"),
        "train tiny bf16": lambda: train(_tiny().to(torch.bfloat16), seq, "train tiny"),
        "train 1.1B bf16": lambda: train(model(), seq, "train 1.1B"),
        "generate 1.1B bf16": lambda: generate(model(), 4 if ctx.small else 16, MAX_TIME),
    }
    only = os.environ.get("TORCHJAX_BENCH_ROWS")
    for name, row in rows.items():
        if only and name not in only.split(","):
            continue
        if _skipped():
            out[name] = _skipped()
            continue
        t0 = time.perf_counter()
        try:
            out[name] = row()
        except Exception as e:  # noqa: BLE001 - reported, the rest runs
            out[name] = {"error": _error(e)}
        out[name]["row_s"] = round(time.perf_counter() - t0, 1)
        _progress(f"{name} done in {out[name]['row_s']} s: {json.dumps(out[name])}")
        gc.collect()
    if ctx.small:
        out["note"] = "--small: the 1.1B rows run the tiny Llama in bfloat16"
    return out
