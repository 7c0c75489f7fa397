"""Compiled greedy generation against its limit: the same Llama written in JAX.

The model: LlamaConfig hidden 256, 4 layers, 4 heads / 2 kv heads, vocab 1024, seeded
weights; a prompt of 16 tokens (batch 8: left padding of 0-7 tokens per row), 64 new
greedy tokens. Columns, tokens/s (higher is better):

- pure JAX, one jit: bench/jax_llama.py's whole loop (prefill + ``lax.fori_loop`` over a
  static KV cache) in one ``jax.jit`` - the limit;
- JAX step + Python loop: the same step jitted, called once per token from Python;
- torch CPU: ``model.generate`` on CPU (dynamic cache);
- compile_generate: torchjax's compiled generation (a static cache; each token one
  program, Note [Decode steps as one program]);
- generate, auto-compiled: ``generate(cache_implementation="static",
  compile_config=CompileConfig(backend="tpu"))`` with no compile_generate call, which
  transformers auto-compiles and torchjax routes to compile_generate (Note
  [transformers' auto-compile on tpu]);
- transformers' loop: the same call with ``TORCHJAX_AUTO_COMPILE_GENERATE=0``:
  transformers' own loop around the decode step compiled by ``torch.compile`` with
  torchjax's Dynamo backend, its per-token bookkeeping run eagerly;
- eager: ``generate`` on "tpu" with a static cache, no compile.

Each (dtype, batch) runs in a fresh child process with torchjax's persistent compilation
cache off, so "first call" is a cold start: the first 64-token ``generate`` of
compile_generate, compiles included. Steady figures are the median of 3 calls after it.
"per token" counts what compile_generate runs per new token in steady state: eager ATen
ops outside the programs and program calls (the prefill's included). "= CPU" says whether
compile_generate's tokens equal torch CPU's and, after the slash, the pure-JAX model's
(in bfloat16 the orders of rounding of the three may part).

Run:  python bench/generate.py            (float32 and bfloat16, batch 1 and 8)
      python bench/generate.py --quick    (float32, batch 1)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
NEW_TOKENS, PROMPT, RUNS = 64, 16, 3

_CHILD = r"""
import copy, json, os, statistics, sys, time
sys.path.insert(0, ROOT)
import numpy as np, torch, transformers, jax, jax.numpy as jnp
import torchjax
from torchjax.integrations.transformers import compile_generate
from bench import jax_llama

DTYPE, BATCH, NEW, PROMPT, RUNS, EAGER = ARGS
dtype = getattr(torch, DTYPE)
cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0,
    bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
cpu = transformers.LlamaForCausalLM(cfg).eval().to(dtype)
g = torch.Generator().manual_seed(1)
ids = torch.randint(3, 1024, (BATCH, PROMPT), generator=g)
mask = torch.ones_like(ids)
for row in range(BATCH):  # left padding: row r has r % 8 pad tokens
    mask[row, : row % 8] = 0
    ids[row, : row % 8] = 0
GEN = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
out = {}

def timed(fn, runs=RUNS):
    fn_first = time.perf_counter(); first_out = fn(); first = time.perf_counter() - fn_first
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter(); fn(); samples.append(time.perf_counter() - t0)
    return first, NEW / statistics.median(samples), first_out

def gen(model, i, m, **kw):
    with torch.no_grad():
        o = model.generate(i, attention_mask=m, **GEN, **kw)
    return o.cpu()

# compile_generate first: its first call is the cold start.
tpu = copy.deepcopy(cpu).to("tpu")
compile_generate(tpu)
i_t, m_t = ids.to("tpu"), mask.to("tpu")
first, tps, tokens_cg = timed(lambda: gen(tpu, i_t, m_t, cache_implementation="static"))
out["compile_generate"] = tps
out["first call (s)"] = first
torchjax.reset_stats()
step = tpu.forward.decode_step
hits, jhits = step.cache_hits, tpu.forward.jitted.cache_hits
gen(tpu, i_t, m_t, cache_implementation="static")
s = torchjax.stats()
out["eager ops / token"] = s["executions"] / NEW
out["programs / token"] = (step.cache_hits - hits + tpu.forward.jitted.cache_hits - jhits) / NEW

first, out["torch CPU"], tokens_cpu = timed(lambda: gen(cpu, ids, mask))
out["same tokens as CPU"] = bool(torch.equal(tokens_cg, tokens_cpu))

params = jax_llama.params_of(cpu)
jcfg = jax_llama.Config.of(cfg)
jids, jmask = jnp.asarray(ids.numpy()), jnp.asarray(mask.numpy())
loop = jax_llama.jitted(jcfg, NEW)
_, out["pure JAX, one jit"], got = timed(lambda: np.asarray(loop(params, jids, jmask)))
out["pure JAX = CPU"] = bool((got == tokens_cpu[:, PROMPT:].numpy()).all())
prefill = jax.jit(lambda p, i, m: jax_llama.prefill(p, jcfg, i, m, NEW))
step_fn = jax.jit(
    lambda p, c, t, slot, pos, keep: jax_llama.greedy_step(p, jcfg, c, t, slot, pos, keep)
)
def python_loop():
    tok, cache, position, keep = prefill(params, jids, jmask)
    toks = [tok]
    for k in range(1, NEW):
        tok, cache = step_fn(params, cache, tok, PROMPT + k - 1, position + k - 1, keep)
        toks.append(tok)
    return np.asarray(jnp.stack(toks, 1))
_, out["JAX step + Python loop"], _ = timed(python_loop)

cc = transformers.CompileConfig(backend="tpu", fullgraph=True, dynamic=False)
auto = copy.deepcopy(cpu).to("tpu")
_, out["generate, auto-compiled"], _ = timed(
    lambda: gen(auto, i_t, m_t, cache_implementation="static", compile_config=cc))
plain = copy.deepcopy(cpu).to("tpu")
os.environ["TORCHJAX_AUTO_COMPILE_GENERATE"] = "0"  # transformers' loop, as written
_, out["transformers' loop"], _ = timed(
    lambda: gen(plain, i_t, m_t, cache_implementation="static", compile_config=cc))
if EAGER:
    _, out["eager"], _ = timed(lambda: gen(plain, i_t, m_t, cache_implementation="static",
                                            disable_compile=True), runs=1)
else:
    out["eager"] = "not run (--quick)"
print(json.dumps(out))
"""

CASES = [(d, b) for d in ("float32", "bfloat16") for b in (1, 8)]
COLUMNS = (
    "pure JAX, one jit",
    "JAX step + Python loop",
    "torch CPU",
    "compile_generate",
    "generate, auto-compiled",
    "transformers' loop",
    "eager",
)


def run_one(dtype: str, batch: int, eager: bool = True) -> dict:
    args = (dtype, batch, NEW_TOKENS, PROMPT, RUNS, eager)
    code = _CHILD.replace("ROOT", repr(str(ROOT))).replace("ARGS", repr(args))
    env = {**os.environ, "TORCHJAX_COMPILATION_CACHE": "0", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT
    )
    if done.returncode != 0:
        raise RuntimeError(f"bench child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(rows) -> str:
    def f(v):
        return v if isinstance(v, str) else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"

    head = " | ".join(COLUMNS)
    lines = [
        f"| batch, dtype (tokens/s) | {head} | compile_generate / one jit | first call (s) "
        "| eager ops / token | programs / token | = CPU (tj / JAX) |",
        "|---|" + "---:|" * (len(COLUMNS) + 4) + "---|",
    ]
    for (dtype, batch), r in rows:
        limit = r["pure JAX, one jit"]
        share = "n/a" if isinstance(limit, str) else f"{r['compile_generate'] / limit:.2f}x"
        cells = " | ".join(f(r[c]) for c in COLUMNS)
        lines.append(
            f"| {batch}, {dtype} | {cells} | {share} | {r['first call (s)']:.1f} | "
            f"{r['eager ops / token']:.2f} | {r['programs / token']:.2f} | "
            f"{'yes' if r['same tokens as CPU'] else 'no'} / "
            f"{'yes' if r['pure JAX = CPU'] else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from bench.common import header

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="float32, batch 1, no eager column")
    args = p.parse_args()
    print(header("compiled generation vs the same model in JAX"))
    cases = (
        [("float32", 1)]
        if args.quick
        else [(d, b) for d in ("float32", "bfloat16") for b in (1, 8)]
    )
    rows = [((d, b), run_one(d, b, eager=not args.quick)) for d, b in cases]
    print(report(rows))


if __name__ == "__main__":
    main()
