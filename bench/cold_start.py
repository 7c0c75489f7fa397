"""Where a first ``generate`` spends its time: tracing, lowering, XLA compiles, running.

A Llama checkpoint in bfloat16 (the 1.1B of bench/tpu.py: hidden 2048, 16 layers, 32/8
heads, vocab 32768; ``--small``: the tiny one) is written once; then each measurement is
a fresh process that loads it and runs one greedy ``generate`` (a 128-token prompt, 128
new tokens, batch 1), first with an empty persistent compilation cache (cold), then again
with the cache the first one filled (warm). Beside it, the same weights in the pure-JAX
model (bench/jax_llama.py): its one-jit greedy loop compiled and run, cold and warm.

Each child reports the wall time of the first call and, from ``jax.monitoring``'s compile
events, the seconds spent in jax tracing, in lowering to MLIR and in XLA's backend compile
(with the number of each), and the persistent cache's hits; the rest of the wall is
Python (torch dispatch, transformers' loop) and running the programs. torchjax's own
counters add its compiled programs and op-level traces.

Run:  python bench/cold_start.py [--small] [--new N] [--only torchjax|jax]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench.common import child_pythonpath, header  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPT = 128

# The compile events of jax.monitoring, by the phase they time.
_PHASES = """
import jax, collections
PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}
seconds, counts = collections.Counter(), collections.Counter()
by_program = collections.Counter()  # XLA compile seconds by program name
def _on(event, duration, **kw):
    if event in PHASES:
        seconds[PHASES[event]] += duration
        counts[PHASES[event]] += 1
        if PHASES[event] == "compile":
            by_program[kw.get("fun_name", "?")] += duration
jax.monitoring.register_event_duration_secs_listener(_on)
def phases():
    return {k: {"s": round(seconds[k], 2), "n": counts[k]} for k in ("trace", "lower", "compile")}
def top_programs(n=8):
    return [(name, round(s, 2)) for name, s in by_program.most_common(n)]
# gen() twice: its output, and the first call's wall, phases and after_first(), the
# second call's wall.
def first_and_second(gen, after_first=dict):
    before = phases()
    t0 = time.perf_counter()
    out = gen()
    first_s = time.perf_counter() - t0
    first, extra = phases(), after_first()
    t0 = time.perf_counter()
    gen()
    second_s = time.perf_counter() - t0
    diff = {k: {"s": round(first[k]["s"] - before[k]["s"], 2), "n": first[k]["n"] - before[k]["n"]}
            for k in first}
    return out, {"first_s": first_s, "second_s": second_s, "phases": diff,
                 "top_programs": top_programs(), **extra}
"""

_TORCHJAX = (
    """
import json, sys, time
t0 = time.perf_counter()
import torch, transformers, torchjax
"""
    + _PHASES
    + """
from bench.common import block_torch
import_s = time.perf_counter() - t0
t0 = time.perf_counter()
model = transformers.AutoModelForCausalLM.from_pretrained(
    sys.argv[1], device_map="tpu", dtype=torch.bfloat16).eval()
load_s = time.perf_counter() - t0
ids = torch.randint(3, model.config.vocab_size, (1, PROMPT),
                    generator=torch.Generator().manual_seed(0)).to("tpu")
new = int(sys.argv[2])
def gen():
    with torch.no_grad():
        return block_torch(model.generate(ids, attention_mask=torch.ones_like(ids),
            max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0))
def counters():
    s = torchjax.stats()
    return {"programs": s["compiles"], "persistent_hits": s["persistent_cache_hits"]}
torchjax.reset_stats()
out, row = first_and_second(gen, counters)
print("RESULT " + json.dumps({"import_s": import_s, "load_s": load_s, **row,
    "tokens": out[0, PROMPT:].tolist()}))
"""
)

_JAX = (
    """
import json, sys, time
t0 = time.perf_counter()
import jax, jax.numpy as jnp, numpy as np
from safetensors.flax import load_file
"""
    + _PHASES
    + """
import transformers
from bench import jax_llama
import_s = time.perf_counter() - t0
t0 = time.perf_counter()
hf = transformers.AutoConfig.from_pretrained(sys.argv[1])
cfg = jax_llama.Config.of(hf)
import glob
params = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.safetensors")):
    for k, v in load_file(f).items():
        params[k] = jax.device_put(v)
load_s = time.perf_counter() - t0
import torch
ids = torch.randint(3, hf.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
ids = jnp.asarray(ids.numpy())
new = int(sys.argv[2])
fn = jax_llama.jitted(cfg, new)
out, row = first_and_second(
    lambda: jax.block_until_ready(fn(params, ids, jnp.ones_like(ids))))
print("RESULT " + json.dumps({"import_s": import_s, "load_s": load_s, **row,
    "tokens": np.asarray(out)[0].tolist()}))
"""
)


def _child(code: str, ckpt: str, new, cache: str) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": child_pythonpath(),
        "TORCHJAX_COMPILATION_CACHE": cache,
        # the pure-JAX child's cache: the same directory, through jax's own setting
        "JAX_COMPILATION_CACHE_DIR": cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", code.replace("PROMPT", str(PROMPT)), ckpt, str(new)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
    )  # fmt: skip
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"bench/cold_start.py: the child failed:\n{out.stderr[-3000:]}")


_CHECKPOINT = """
import json, sys, torch
from bench.tpu import llama_config
import transformers as tf
torch.manual_seed(0)
model = tf.LlamaForCausalLM(llama_config(sys.argv[2] == "small")).to(torch.bfloat16)
model.save_pretrained(sys.argv[1])
print("RESULT " + json.dumps({"params": sum(p.numel() for p in model.parameters())}))
"""


def _checkpoint(path: str, small: bool) -> int:
    """Written by a child process: this one never opens the chip, which has one holder."""
    return _child(_CHECKPOINT, path, "small" if small else "full", "0")["params"]


def run(small: bool, new: int, only: tuple = ("torchjax", "jax")) -> dict:
    rows = {}
    with tempfile.TemporaryDirectory(prefix="torchjax-cold-") as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        t0 = time.perf_counter()
        params = _checkpoint(ckpt, small)
        rows["checkpoint"] = {"params": params, "write_s": round(time.perf_counter() - t0, 1)}
        for name, code in (("torchjax", _TORCHJAX), ("jax", _JAX)):
            if name not in only:
                continue
            cache = os.path.join(tmp, f"cache-{name}")
            os.makedirs(cache)
            rows[name] = {which: _child(code, ckpt, new, cache) for which in ("cold", "warm")}
    if len(only) == 2:
        tj, jx = rows["torchjax"]["cold"]["tokens"], rows["jax"]["cold"]["tokens"]
        rows["tokens_equal_jax"] = tj == jx[: len(tj)]
    return rows


def report(rows: dict) -> str:
    lines = [
        "| first generate, fresh process | wall | trace s (n) | lower s (n) | XLA compile s (n) "
        "| rest | torchjax programs | second call |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = [name for name in ("torchjax", "jax") if name in rows]
    for name in names:
        for which in ("cold", "warm"):
            r = rows[name][which]
            p = r["phases"]
            rest = r["first_s"] - sum(p[k]["s"] for k in p)
            lines.append(
                f"| {name}, {which} cache | {r['first_s']:.1f} s | {p['trace']['s']} "
                f"({p['trace']['n']}) | {p['lower']['s']} ({p['lower']['n']}) | "
                f"{p['compile']['s']} ({p['compile']['n']}) | {rest:.1f} s | "
                f"{r.get('programs', '-')} | {r['second_s']:.2f} s |"
            )
    if "tokens_equal_jax" in rows:
        lines.append(f"\ntokens equal to the pure-JAX model's: {rows['tokens_equal_jax']}")
    for name in names:
        top = ", ".join(f"{n} {s} s" for n, s in rows[name]["cold"]["top_programs"])
        lines.append(f"{name}, cold: the longest XLA compiles: {top}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument(
        "--only", choices=("torchjax", "jax"), help="run one side (e.g. to compare a setting)"
    )
    args = parser.parse_args()
    # The header after the children: it asks jax for its devices, which opens the chip,
    # and a chip has one holder.
    rows = run(args.small, args.new, (args.only,) if args.only else ("torchjax", "jax"))
    print(header("cold start of generate: where the time goes"))
    print(report(rows))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
