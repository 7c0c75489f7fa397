"""Host memory: growth over many input shapes, and the peak of new and copied tensors.

Run:  python bench/memory.py            (quick, the default: about 5-10 minutes on 2 cores)
      python bench/memory.py --full     (1 GiB transfers, 200 Llama lengths: about 18 min)

Each measurement runs in a child process of its own. Resident memory (VmRSS, after
``gc.collect()`` and ``malloc_trim``) is taken after the first shape and at each mark;
the table gives the growth since the first shape and the time to reach the mark.
Workloads: ``(x @ x.t()).relu().sum()`` over x of shape (n, 8) for n = 3, 4, ...; a tiny
Llama forward (hidden 64, 2 layers) at sequence lengths 3, 4, ... Backends: torch CPU,
unjitted jax.numpy (for the Llama, the same weights through bench/jax_llama.py) and
torchjax eager with a cache budget of
``--budget`` executables (Note [Executable cache budget] in torchjax/_budget.py).
Peaks (ru_maxrss above the start) of ``torch.ones``, ``.to("tpu")``, ``model.to("tpu")``
and ``load_state_dict`` of a model of the same size, as a multiple of the tensor bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import child_pythonpath  # noqa: E402

_RSS = """
import ctypes, gc, json, sys, time
libc = ctypes.CDLL("libc.so.6")
def rss():
    gc.collect(); libc.malloc_trim(0)
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
"""

_CHAIN = {
    "torch CPU": """
import torch
def step(n):
    x = torch.randn(n, 8)
    return float((x @ x.t()).relu().sum())
""",
    "jnp": """
import numpy as np, jax.numpy as jnp
def step(n):
    x = jnp.asarray(np.random.randn(n, 8).astype(np.float32))
    return float(jnp.maximum(x @ x.T, 0).sum())
""",
    "torchjax": """
import torch, torchjax
torchjax.set_cache_budget(entries=BUDGET)
def step(n):
    x = torch.randn(n, 8).to("tpu")
    return float((x @ x.t()).relu().sum())
""",
}

_LLAMA = """
import torch, transformers
cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).eval()
DEVICE = "cpu"
if BACKEND == "jnp":
    import jax.numpy as jnp
    from bench import jax_llama
    CFG, PARAMS = jax_llama.Config.of(cfg), jax_llama.params_of(model)
if BACKEND == "torchjax":
    import torchjax
    torchjax.set_cache_budget(entries=BUDGET)
    DEVICE = "tpu"
    model.to(DEVICE)
def step(n):
    ids = torch.randint(0, 128, (1, n))
    if BACKEND == "jnp":  # the same model op by op in jax.numpy (bench/jax_llama.py)
        return float(jax_llama.forward(PARAMS, CFG, jnp.asarray(ids.numpy()))[0, -1, 0])
    with torch.no_grad():
        return float(model(input_ids=ids.to(DEVICE)).logits[0, -1, 0])
"""

_LOOP = """
step(2)
base = rss(); t0 = time.perf_counter()
for i in range(max(MARKS)):
    step(3 + i)
    if i + 1 in MARKS:
        print(json.dumps([i + 1, rss() - base, time.perf_counter() - t0]), flush=True)
"""

_PEAK = """
import json, resource, torch, torchjax
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
MIB = SIZE_MIB
n = MIB * 2**18  # float32 elements
(torch.ones(4, device="tpu") + 1).cpu()
def model():
    side = 2048
    layers = max(1, n // (side * side))
    return torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])
if CASE == "torch.ones":
    base = peak(); y = torch.ones(n, device="tpu"); y[-1].item()
elif CASE == ".to":
    x = torch.ones(n); x.add_(1); base = peak(); y = x.to("tpu"); y[-1].item()
elif CASE == "model.to":
    m = model(); base = peak(); m.to("tpu"); m[0].weight[0, 0].item()
elif CASE == "load_state_dict":
    m = model(); sd = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
    m.to("tpu"); base = peak(); m.load_state_dict(sd); m[0].weight[0, 0].item()
print(json.dumps((peak() - base) / MIB))
"""


def _child(code: str, timeout: float = 900) -> list:
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": child_pythonpath()},
        cwd=ROOT,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def _growth(workload: str, backend: str, marks, budget: int) -> dict:
    body = _CHAIN[backend] if workload == "chain" else _LLAMA.replace("BACKEND", repr(backend))
    code = (_RSS + body + _LOOP).replace("BUDGET", str(budget)).replace("MARKS", repr(marks))
    return {m: (mb, s) for m, mb, s in _child(code)}


def _peak(case: str, size_mib: int) -> float:
    code = _PEAK.replace("SIZE_MIB", str(size_mib)).replace("CASE", repr(case))
    return _child(code)[0]


def main() -> None:
    from bench.common import header

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="1 GiB peaks, Llama over 200 lengths")
    p.add_argument("--budget", type=int, default=64, help="torchjax's cache budget (entries)")
    args = p.parse_args()
    chain_marks = (10, 50, 200)
    llama_marks = (10, 50, 200) if args.full else (3, 5)
    size = 1024 if args.full else 256
    t0 = time.perf_counter()
    print(header("Host memory over new shapes, and peaks of new tensors"))
    print(f"torchjax cache budget: {args.budget} executables\n")
    rows = []
    runs = [("chain", b, chain_marks) for b in ("torch CPU", "jnp", "torchjax")]
    runs += [("tiny Llama", b, llama_marks) for b in ("torch CPU", "jnp", "torchjax")]
    for workload, backend, marks in runs:
        if workload == "chain" and backend == "jnp" and not args.full:
            marks = (10, 50)  # each new shape compiles every primitive: slow
        got = _growth("chain" if workload == "chain" else "llama", backend, marks, args.budget)
        rows.append((workload, backend, got))
    all_marks = sorted({m for _, _, g in rows for m in g})
    head = " | ".join(f"{m} shapes: MB (s)" for m in all_marks)
    print(f"| workload | backend | {head} |")
    print("|---|---|" + "---:|" * len(all_marks))
    for workload, backend, got in rows:
        cells = " | ".join(
            f"{got[m][0]:+.0f} ({got[m][1]:.1f})" if m in got else "-" for m in all_marks
        )
        print(f"| {workload} | {backend} | {cells} |")
    print(f"\nPeak host memory above the start, as a multiple of {size} MiB (target <= 1.1x):")
    print("| operation | peak |")
    print("|---|---:|")
    for case in ("torch.ones", ".to", "model.to", "load_state_dict"):
        print(f"| {case} | {_peak(case, size):.2f}x |")
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
