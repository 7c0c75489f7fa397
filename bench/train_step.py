"""Training-step speed of a Llama on one chip: torchjax.jit, torch.compile, pure JAX.

The 1.1B Llama of bench/tpu.py (``llama_config(small=False)``: hidden 2048, 16 layers,
32/8 heads, MLP 8192, vocab 32768), bfloat16 weights from ``torch.manual_seed(0)``, one
fixed batch of random token ids (B, S) = (4, 2048). Rows:

- train, ``torchjax.jit``: one function doing ``model(ids, labels=ids).loss`` (transformers'
  causal LM loss), ``loss.backward()``, ``opt.step()``, ``opt.zero_grad()`` with
  ``torch.optim.AdamW(lr=1e-4, weight_decay=0.01)`` (its state in bfloat16, the
  parameters' dtype);
- train, ``torch.compile(backend="tpu")``: the same function through Dynamo;
- train, pure JAX: ``jax.value_and_grad`` of bench/jax_llama.py's ``forward`` and
  ``causal_lm_loss`` over the same weights, ``optax.adamw`` with the same hyperparameters
  and bfloat16 moments, params and optimizer state donated, all under one ``jax.jit``;
- prefill, ``torchjax.jit`` and pure JAX: a no-grad forward of (8, S) keeping the last
  position's logits (``logits_to_keep=1``).

``--small``: bench/tpu.py's small config (hidden 256, 2 layers, vocab 1024), (2, 128),
prefill batch 2: a check of the script off the chip, where MFU means nothing.

``--remat`` (on by default; the 1.1B model at (4, 2048) keeps 1 GB of attention
probabilities per layer without it) checkpoints each decoder layer in every training row:
transformers' ``activation_checkpointing_enable()`` (torch's non-reentrant checkpoint) and
``jax.checkpoint`` per layer in jax_llama, so the rows do the same computation. Whether
it took effect shows in peak HBM (compare a row with ``--no-remat``).

Columns: first step (wall time of the first call, trace and XLA compiles included; the
persistent compilation cache is off unless TORCHJAX_COMPILATION_CACHE is set), second step
(torchjax.jit traces again there: the first call created AdamW's state; the JAX row's
``opt.init`` runs before its first step), step (median of ``--steps`` calls after
``--warmup``, at least the first two), tokens/s (B * S / step), MFU, the first and the
median step against pure JAX's, peak HBM (``memory_stats()["peak_bytes_in_use"]`` of the
row's process, setup included; None off TPU), XLA compiles during the row's calls
(``jax.monitoring``), and the losses of the first and last step. Every call is followed
by a full synchronisation (``torch.tpu.synchronize()``, or ``jax.block_until_ready`` of
everything the JAX step returns), so a step's time includes all of its work; losses are
read after timing. Prefill rows compare their last position's mean logit and greedy
tokens instead.

Model FLOPs (MFU = FLOPs / (step * 197e12), the v5e's bfloat16 peak), with N = parameters
without the input embedding (lm_head counted), T = B * S tokens, L layers, H heads of D:
train 6 * N * T + 12 * L * H * D * S^2 * B / 2 (causal: half the scores); prefill
2 * (N - lm_head) * T + 2 * lm_head * B (one position's logits) + 4 * L * H * D * S^2 * B / 2.
Recomputation by remat and the masked half of the scores are not counted.

``--memory`` adds, per row, XLA's memory analysis of the step's program (arguments,
outputs, the part of the outputs aliasing donated arguments, temporaries; compiled once
more from the traced program, so it costs one more compile), for the ``torchjax.jit``
and pure-JAX rows, and the donation counts of the ``torchjax.jit`` row (buffers written,
donated, copied before donation; the first call's program too, when it differs). Every
row reports the distinct warnings its process raised (JAX's "donated buffers were not
usable" among them) and, on TPU, the chip's bytes in use and peak before its first call
and after each of its first three, which places the peak in setup, the first call's
program or the steady state's.

``--profile DIR`` runs two more calls per row under ``jax.profiler`` and prints the
device time per step, per operation kind and of the slowest operations
(bench/op_profile.py); the traces stay under DIR/<row>.

Each row runs in its own process, so peak HBM and compile counts are the row's alone,
memory is freed between rows, and a chip (one holder) is opened by one process at a time.

Run:  python bench/train_step.py [--small] [--rows train-jit,train-jax,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import traceback
import warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

FLOPS_PER_S = 197e12
LR, WEIGHT_DECAY = 1e-4, 0.01
ROWS = {
    "train-jit": "train, torchjax.jit",
    "train-compile": 'train, torch.compile(backend="tpu")',
    "train-jax": "train, pure JAX + optax",
    "prefill-jit": "prefill, torchjax.jit",
    "prefill-jax": "prefill, pure JAX",
}
REFERENCE = {"train-jit": "train-jax", "train-compile": "train-jax", "prefill-jit": "prefill-jax"}
_COMPILES = [0]  # XLA compiles in this process, from jax.monitoring (child())


def model_flops(cfg, batch: int, seq: int, train: bool) -> float:
    """The formulas of the module docstring for a transformers LlamaConfig."""
    d = cfg.hidden_size // cfg.num_attention_heads
    layer = 2 * cfg.hidden_size * d * (cfg.num_attention_heads + cfg.num_key_value_heads)
    layer += 3 * cfg.hidden_size * cfg.intermediate_size + 2 * cfg.hidden_size  # MLP, norms
    head = cfg.hidden_size * cfg.vocab_size
    body = cfg.num_hidden_layers * layer + cfg.hidden_size  # + the final norm
    attn = cfg.num_hidden_layers * cfg.num_attention_heads * d * seq**2 * batch / 2
    if train:
        return 6 * (body + head) * batch * seq + 12 * attn
    return 2 * body * batch * seq + 2 * head * batch + 4 * attn


# -- one row, in a child process -------------------------------------------------------


def _torch_model(small: bool):
    import torch
    import transformers

    from bench.tpu import llama_config

    torch.manual_seed(0)  # seeds the tpu RNG too: every row starts from the same weights
    with torch.device("tpu"):
        return transformers.LlamaForCausalLM(llama_config(small)).to(torch.bfloat16)


def _ids(cfg, batch: int, seq: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(3, cfg.vocab_size, (batch, seq), generator=gen)


def _timed(call, warmup: int, steps: int) -> dict:
    """Wall times of ``call()`` (which must block on all its work): the first, the
    second, and the median of ``steps`` after ``warmup`` calls (the first two included);
    the XLA compiles during the calls; the calls' results."""
    out, times, before = [], [], _COMPILES[0]
    peaks = [_hbm()]  # before the first call, then after each of the first three
    for i in range(max(warmup, 2) + steps):
        t0 = time.perf_counter()
        out.append(call())
        times.append(time.perf_counter() - t0)
        if i < 3:
            peaks.append(_hbm())
    return {"first_s": times[0], "second_s": times[1],
            "step_s": statistics.median(times[-steps:]), "results": out,
            "xla_compiles": _COMPILES[0] - before, "hbm_by_call": peaks}  # fmt: skip


def _profiled(row: dict, call, args) -> None:
    """With ``--profile DIR``: device time per XLA operation of 2 more calls
    (bench/op_profile.py), the trace kept under DIR/<row>."""
    if args.profile:
        from bench.op_profile import profile

        row["profile"] = profile(call, 2, os.path.join(args.profile, args.child))


def _hbm() -> tuple | None:
    """(bytes in use, peak bytes in use) of the chip in GiB; None off TPU."""
    import jax

    stats = jax.local_devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return (round(stats["bytes_in_use"] / 2**30, 2), round(stats["peak_bytes_in_use"] / 2**30, 2))


def _memory(compiled) -> dict:
    """XLA's memory analysis of a compiled program, in bytes."""
    m = compiled.memory_analysis()
    names = ("argument", "output", "alias", "temp")
    return {n: getattr(m, f"{n}_size_in_bytes", None) for n in names}


def _jit_memory(run) -> dict:
    """``_memory`` of a torchjax.jit function's latest program (the steady state's),
    compiled again from its trace, and its donation counts; ``first``: the same of the
    first call's program when there were two (the first call creates AdamW's state)."""
    import jax

    from torchjax._compat.jax import x64

    def of(entry) -> dict:
        invars = entry.closed.jaxpr.invars
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars]
        with x64(True):  # as the call lowers it
            row = _memory(entry.compiled.lower(*avals).compile())
        row.update(written=len(entry.written), donated=len(entry.donated))
        return row

    entries = list(run._entries.values())
    row = of(entries[-1])
    row["donation_copies"] = run.donation_copies
    if len(entries) > 1:
        row["first"] = of(entries[0])
    return row


def _torch_train(args, compiler: str) -> dict:
    import torch

    import torchjax
    from bench.common import lm_train_step

    model = _torch_model(args.small)
    if args.remat:
        model.activation_checkpointing_enable()  # non-reentrant torch.utils.checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    ids = _ids(model.config, args.batch, args.seq).to("tpu")

    step = lm_train_step(model, opt)
    run = torchjax.jit(step) if compiler == "jit" else torch.compile(step, backend="tpu")

    def call():
        loss = run(ids)
        torch.tpu.synchronize()  # all live arrays: the loss and every update
        return loss

    row = _timed(call, args.warmup, args.steps)
    row["losses"] = [t.item() for t in row.pop("results")]
    _profiled(row, call, args)
    if compiler == "jit":
        row["traces"] = run.trace_count
        if args.memory:
            row["memory"] = _jit_memory(run)
    else:
        row["traces"] = torchjax.compile.dynamo_stats()["traces"]
    return row


def _jax_params(small: bool):
    import gc

    from bench import jax_llama

    model = _torch_model(small)
    cfg, params = model.config, jax_llama.params_of(model)
    del model  # only its weights were wanted
    gc.collect()
    return cfg, params


def _jax_train(args) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    from bench import jax_llama

    cfg, params = _jax_params(args.small)
    jcfg = jax_llama.Config.of(cfg)
    ids = jnp.asarray(_ids(cfg, args.batch, args.seq).numpy())
    # mu_dtype: torch keeps both moments in the parameters' dtype; optax's nu already is.
    opt = optax.adamw(LR, weight_decay=WEIGHT_DECAY, mu_dtype=jnp.bfloat16)

    def loss_of(params, ids):
        logits = jax_llama.forward(params, jcfg, ids, remat=args.remat)
        return jax_llama.causal_lm_loss(logits, ids)

    @jax.jit
    def init(params):
        return opt.init(params)

    def train(params, state, ids):
        loss, grads = jax.value_and_grad(loss_of)(params, ids)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    step = jax.jit(train, donate_argnums=(0, 1))
    box = {"params": params, "state": init(params)}
    del params

    def call():
        box["params"], box["state"], loss = jax.block_until_ready(
            step(box["params"], box["state"], ids)
        )
        return loss

    row = _timed(call, args.warmup, args.steps)
    row["losses"] = [float(x) for x in row.pop("results")]
    _profiled(row, call, args)
    if args.memory:
        row["memory"] = _memory(step.lower(box["params"], box["state"], ids).compile())
    return row


def _prefill(args, engine: str) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    import torchjax
    from bench import jax_llama

    if engine == "jax":
        cfg, params = _jax_params(args.small)
        jcfg = jax_llama.Config.of(cfg)
        ids = jnp.asarray(_ids(cfg, args.prefill_batch, args.seq).numpy())
        fwd = jax.jit(lambda p, i: jax_llama.forward(p, jcfg, i, logits_to_keep=1))
        row = _timed(lambda: jax.block_until_ready(fwd(params, ids)), args.warmup, args.steps)
        _profiled(row, lambda: jax.block_until_ready(fwd(params, ids)), args)
        last = row.pop("results")[-1]
    else:
        model = _torch_model(args.small).eval()
        ids = _ids(model.config, args.prefill_batch, args.seq).to("tpu")
        fwd = torchjax.jit(lambda ids: model(ids, use_cache=False, logits_to_keep=1).logits)

        def call():
            with torch.no_grad():
                out = fwd(ids)
            torch.tpu.synchronize()
            return out

        row = _timed(call, args.warmup, args.steps)
        _profiled(row, call, args)
        last = torchjax.to_jax(row.pop("results")[-1])
        row["traces"] = fwd.trace_count
    # what the two rows compare: the last position's mean logit and greedy tokens
    row["mean_logit"] = float(jnp.mean(last.astype(jnp.float32)))
    row["argmax"] = jnp.argmax(last[:, -1], axis=-1).tolist()
    return row


def child(args) -> dict:
    import jax

    import torchjax  # noqa: F401 - the tpu device, before any model is built

    def on_event(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            _COMPILES[0] += 1

    jax.monitoring.register_event_duration_secs_listener(on_event)
    kind, engine = args.child.split("-")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            if kind == "prefill":
                row = _prefill(args, engine)
            elif engine == "jax":
                row = _jax_train(args)
            else:
                row = _torch_train(args, engine)
        except Exception as e:  # noqa: BLE001 - a failed row is reported, the others run
            tail = "".join(traceback.format_exc().splitlines(keepends=True)[-30:])
            return {"error": f"{type(e).__name__}: {e}"[:300], "traceback_tail": tail}
    row["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:300]}" for w in seen})
    stats = jax.local_devices()[0].memory_stats() or {}
    row["peak_hbm_bytes"] = stats.get("peak_bytes_in_use")
    return row


# -- the parent: one child per row, then the table --------------------------------------


def _spawn(name: str, argv: list[str]) -> dict:
    from bench.common import child_pythonpath

    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    env.setdefault("TORCHJAX_COMPILATION_CACHE", "0")  # the first step compiles cold
    cmd = [sys.executable, __file__, *argv, "--child", name]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    except subprocess.TimeoutExpired as e:
        return {"error": "timed out after 3600 s", "traceback_tail": str(e.stderr)[-3000:]}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    # no result: the process died (killed for memory, a crash in XLA)
    return {"error": f"exit status {proc.returncode}", "traceback_tail": proc.stderr[-3000:]}


def _table(rows: dict, args, cfg) -> str:
    lines = [
        "| row | first step | second step | step | tokens/s | MFU | vs JAX: first, step "
        "| peak HBM | XLA compiles | loss first -> last |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in rows.items():
        if "error" in r:
            error = r["error"].replace("|", "/").replace("\n", " ")
            lines.append(f"| {ROWS[name]} | failed: {error} |" + " |" * 8)
            continue
        train = name.startswith("train")
        batch = args.batch if train else args.prefill_batch
        ref = rows.get(REFERENCE.get(name, ""), {})
        vs = "-"
        if "step_s" in ref:
            vs = f"{r['first_s'] / ref['first_s']:.2f}x, {r['step_s'] / ref['step_s']:.2f}x"
        hbm = r["peak_hbm_bytes"]
        hbm = "None" if hbm is None else f"{hbm / 2**30:.2f} GiB"
        mfu = model_flops(cfg, batch, args.seq, train) / (r["step_s"] * FLOPS_PER_S)
        if train:
            loss = f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
        else:
            loss = f"mean logit {r['mean_logit']:.4f}"
        lines.append(
            f"| {ROWS[name]} | {r['first_s']:.2f} s | {r['second_s']:.2f} s "
            f"| {r['step_s'] * 1e3:.1f} ms | {batch * args.seq / r['step_s']:,.0f} "
            f"| {mfu:.2%} | {vs} | {hbm} | {r['xla_compiles']} | {loss} |"
        )
    return "\n".join(lines)


def _checks(rows: dict) -> list[str]:
    """The first losses of the training rows agree (same weights, same batch) and fall."""
    out = []
    train = {n: r for n, r in rows.items() if n.startswith("train") and "losses" in r}
    firsts = {n: r["losses"][0] for n, r in train.items()}
    if firsts:
        spread = max(firsts.values()) - min(firsts.values())
        text = ", ".join(f"{n} {v:.5f}" for n, v in firsts.items())
        out.append(f"first-step losses: {text} (spread {spread:.2e})")
    for n, r in train.items():
        fell = r["losses"][-1] < r["losses"][0]
        out.append(f"{n}: loss falls over {len(r['losses'])} steps: {fell}")
    a, b = rows.get("prefill-jit", {}).get("argmax"), rows.get("prefill-jax", {}).get("argmax")
    if a and b:
        same = sum(x == y for x, y in zip(a, b))
        out.append(f"prefill: last-position argmax equal in {same} of {len(a)} rows")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny Llama, seq 128, batch 2")
    parser.add_argument("--rows", default=",".join(ROWS), help="of " + ",".join(ROWS))
    parser.add_argument("--batch", type=int, help="training batch (default 4; small 2)")
    parser.add_argument("--prefill-batch", type=int, help="(default 8; small 2)")
    parser.add_argument("--seq", type=int, help="sequence length (default 2048; small 128)")
    parser.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--memory", action="store_true", help="XLA's memory analysis per row")
    parser.add_argument("--profile", help="profile 2 more steps per row; traces under this dir")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    small = args.small
    args.batch = args.batch or (2 if small else 4)
    args.prefill_batch = args.prefill_batch or (2 if small else 8)
    args.seq = args.seq or (128 if small else 2048)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    names = args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {','.join(ROWS)}")
    argv = ["--batch", str(args.batch), "--prefill-batch", str(args.prefill_batch)]
    argv += ["--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    argv += ["--remat" if args.remat else "--no-remat"] + (["--small"] if small else [])
    argv += ["--memory"] if args.memory else []
    argv += ["--profile", os.path.abspath(args.profile)] if args.profile else []
    t0 = time.perf_counter()
    rows = {}
    for name in names:
        t1 = time.perf_counter()
        rows[name] = _spawn(name, argv)
        done = "failed" if "error" in rows[name] else "done"
        print(f"{name}: {done} in {time.perf_counter() - t1:.0f} s", flush=True)
    # The header after the children: it opens the chip, which has one holder.
    from bench.common import header
    from bench.tpu import llama_config

    cfg = llama_config(small)
    print(header(f"bench/train_step.py: Llama train step, {'small' if small else '1.1B'}"))
    print(
        f"batch {args.batch} (prefill {args.prefill_batch}) x seq {args.seq}, bfloat16, "
        f"AdamW lr {LR} wd {WEIGHT_DECAY}, remat {'on' if args.remat else 'off'}, "
        f"median of {args.steps} steps after {args.warmup}; {time.perf_counter() - t0:.0f} s"
    )
    print(_table(rows, args, cfg))
    for line in _checks(rows):
        print(line)

    def gib(memory: dict) -> str:
        return ", ".join(
            f"{k} {v / 2**30:.2f} GiB" if k in ("argument", "output", "alias", "temp") else
            f"{k} {v}" for k, v in memory.items() if v is not None and k != "first"
        )  # fmt: skip

    for name, r in rows.items():
        if "memory" in r:
            print(f"{name} program memory: {gib(r['memory'])}")
            if "first" in r["memory"]:
                print(f"{name} first call's program memory: {gib(r['memory']['first'])}")
        if r.get("hbm_by_call") and r["hbm_by_call"][0] is not None:
            calls = "; ".join(f"{u} / {p}" for u, p in r["hbm_by_call"])
            print(f"{name} HBM in use / peak (GiB) before the first call, after calls 1-3: {calls}")
    for name, r in rows.items():
        prof = r.get("profile")
        if prof and "error" not in prof:
            print(f"\n{name} device time per step: {prof['device_ms_per_step']} ms; by kind (ms):")
            print("  " + "; ".join(f"{k} {v}" for k, v in prof["by_kind_ms"].items()))
            print(f"{name} slowest operations (ms per step, calls per step, operation):")
            for op, ms, calls in prof["top_ops"]:
                print(f"  {ms} x{calls} {op}")
        elif prof:
            print(f"{name} profile: {prof['error']}")
    for name, r in rows.items():
        for w in r.get("warnings", ()):
            print(f"{name} warned: {w}")
    for name, r in rows.items():
        if "error" in r:
            print(f"\n{name} failed:\n{r['traceback_tail']}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
