"""A train step under an LR schedule: how many programs it compiles and how long the run
takes, under ``torch.compile(backend="tpu")``, ``torchjax.jit`` and eager.

The tiny Llama of bench/compiled.py (4 layers, hidden 256) trained with AdamW and
OneCycleLR (which sets lr and betas every step) for 15 steps of a (4, 64) batch; the
whole run's wall time from a fresh model (compiles included, the persistent compilation
cache off) and the programs traced. Each mode runs in its own process.

Run:  python bench/lr_schedule.py
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import child_pythonpath, header  # noqa: E402

STEPS = 15
MODES = ("torch.compile", "torchjax.jit", "eager")

_CHILD = """
import json, sys, time
import torch, torchjax
from bench.compiled import llama

mode, steps = sys.argv[1], int(sys.argv[2])
model = llama().train().to("tpu")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=steps)

def step(ids):
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()

if mode == "torch.compile":
    run = torch.compile(step, backend="tpu")
elif mode == "torchjax.jit":
    run = torchjax.jit(step)
else:
    run = step
gen = torch.Generator().manual_seed(0)
before = torchjax.compile.dynamo_stats()["traces"] if mode == "torch.compile" else 0
t0 = time.perf_counter()
for _ in range(steps):
    loss = run(torch.randint(0, 1024, (4, 64), generator=gen).to("tpu")).item()
    sched.step()
wall = time.perf_counter() - t0
if mode == "torch.compile":
    traces = torchjax.compile.dynamo_stats()["traces"] - before
elif mode == "torchjax.jit":
    traces = run.trace_count
else:
    traces = None
print(json.dumps({"wall_s": round(wall, 2), "traces": traces, "last_loss": round(loss, 5)}))
"""


def run_mode(mode: str) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": child_pythonpath(),
        "TORCHJAX_COMPILATION_CACHE": "0",
        "HF_HUB_OFFLINE": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(STEPS)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1800,
    )
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1][:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    rows = {mode: run_mode(mode) for mode in MODES}
    print(header(f"bench/lr_schedule.py: AdamW + OneCycleLR, {STEPS} steps, tiny Llama"))
    print("| mode | run (s, compiles included) | programs traced | last loss |")
    print("|---|---:|---:|---:|")
    for mode, r in rows.items():
        if "error" in r:
            print(f"| {mode} | error: {r['error']} | | |")
        else:
            traces = "-" if r["traces"] is None else r["traces"]
            print(f"| {mode} | {r['wall_s']} | {traces} | {r['last_loss']} |")


if __name__ == "__main__":
    main()
