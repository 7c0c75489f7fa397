"""Cold start: the tiny Llama's first greedy ``generate`` in a fresh process.

The tiny Llama of bench/compiled.py (hidden 256, 4 layers, vocab 1024), an 8-token
prompt, ``generate(max_new_tokens=64, do_sample=False)``, in float32 and bfloat16, by
default three ways: as written (on tpu: a static cache and compile_generate's decode
programs, Note [A static cache by default on tpu]), eager (``disable_compile=True``: the
forward op by op, with a static cache, Note [A static cache for eager generate on tpu]),
and eager with transformers' ``DynamicCache`` (the rules off: every op on every new
length is a new program). Each figure
comes from its own child process: the first with an empty persistent compilation cache
(cold), the second with the cache the first one filled (warm). Reported per run: the
wall time of the first ``generate`` call, the XLA compiles it made
(``torchjax.stats()["compiles"]``) and the cache files after it.

More modes on request: ``generate`` with processors that read the growing ids
(``repetition_penalty``, ``no_repeat_ngram_size``), and without a cache, each as written
and eager; eager with a batch of two prompts, right-aligned (``eager-batch2``: every row
the same length, the mask all ones) and left-padded (``eager-left-padded``: the first row
padded by three tokens, its mask zeros there). Each row also gives the same call made
again in that process (its wall time and compiles: none expected), and eager rows the
programs compiled (or, warm, loaded from the cache) per generated token once the first 8
tokens are made, counted at each token by a logits processor that only reads
``torchjax.stats()``: what is left there is the programs of tensors that grow by a token
each step.

Run:  python bench/startup.py [--by-op] [--modes default,eager,eager-dynamic,processors,no-cache,
      eager-processors,eager-no-cache,eager-batch2,eager-left-padded]
      [--dtypes float32,bfloat16]  (--by-op: the traces of each overload, most first)
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench.common import child_pythonpath, header  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
NEW_TOKENS = 64
PROMPT = [[1, 17, 42, 99, 5, 6, 7, 8]]
# Batches of two prompts: right-aligned (no padding) and left-padded (pad id 0).
PROMPTS = {
    "one": PROMPT,
    "two": [[1, 17, 42, 99, 5, 6, 7, 8], [1, 5, 6, 7, 8, 9, 10, 11]],
    "left-padded": [[0, 0, 0, 1, 17, 42, 99, 5], [1, 5, 6, 7, 8, 9, 10, 11]],
}
# Compiles per token are counted from this token on.
PER_TOKEN_FROM = 8
DTYPES = ("float32", "bfloat16")
# mode -> (generate's extra settings, extra environment of the child)
_MODES = {
    "default": ({}, {}),
    "eager": ({"disable_compile": True}, {}),
    # the eager path before it took a static cache: transformers' DynamicCache
    "eager-dynamic": ({"disable_compile": True}, {"TORCHJAX_AUTO_COMPILE_GENERATE": "0"}),
    "processors": ({"repetition_penalty": 1.3, "no_repeat_ngram_size": 3}, {}),
    "no-cache": ({"use_cache": False}, {}),
    "eager-processors": (
        {"disable_compile": True, "repetition_penalty": 1.3, "no_repeat_ngram_size": 3},
        {},
    ),
    "eager-no-cache": ({"disable_compile": True, "use_cache": False}, {}),
    "eager-batch2": ({"disable_compile": True}, {}),
    "eager-left-padded": ({"disable_compile": True}, {}),
}
# mode -> its prompt (PROMPTS); the others take "one"
_MODE_PROMPTS = {"eager-batch2": "two", "eager-left-padded": "left-padded"}
MODES = ("default", "eager", "eager-dynamic")

_CHILD = """
import json, os, sys, time
t_start = time.perf_counter()
import torch
import transformers
import torchjax
t_import = time.perf_counter() - t_start
from bench.compiled import llama

dtype = getattr(torch, sys.argv[1])
extra = dict(MODE_SETTINGS[sys.argv[2]])
model = llama().to(dtype).to("tpu")
ids = torch.tensor(json.loads(sys.argv[3]), device="tpu")
# Prompts with pad id 0 are left-padded: their mask is 0 there.
mask = (ids != 0).long() if bool((ids == 0).any()) else torch.ones_like(ids)
torch.tpu.synchronize()
marks = []
if extra.get("disable_compile"):
    # Programs compiled or loaded by each generated token; reads no tensor.
    class Marks(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            s = torchjax.stats()
            marks.append(s["compiles"] + s["persistent_cache_hits"])
            return scores
    extra["logits_processor"] = transformers.LogitsProcessorList([Marks()])
torchjax.reset_stats()
def generate():
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW,
                             min_new_tokens=NEW, do_sample=False, pad_token_id=0, **extra)
    out.cpu()
    return out, time.perf_counter() - t0
out, wall = generate()
s = torchjax.stats()
counted = marks[FROM:NEW]
per_token = (counted[-1] - counted[0]) / (len(counted) - 1) if len(counted) > 1 else None
_, second = generate()
second_compiles = torchjax.stats()["compiles"] - s["compiles"]
cache = os.environ.get("TORCHJAX_COMPILATION_CACHE", "")
files = sum(len(f) for _, _, f in os.walk(cache)) if os.path.isdir(cache) else 0
ops = sorted(((v["traces"], k) for k, v in s["ops"].items() if v["traces"]), reverse=True)
print("RESULT " + json.dumps({
    "wall_s": wall, "import_s": t_import, "compiles": s["compiles"],
    "second_s": second, "second_compiles": second_compiles,
    "persistent_hits": s["persistent_cache_hits"],
    "traces": sum(t for t, _ in ops), "cache_files": files, "ops": ops,
    "tokens": out.shape[1] - ids.shape[1], "head": out[0, -8:].tolist(),
    "per_token": per_token,
}))
"""


def child(dtype: str, mode: str, cache_dir: str) -> dict:
    """One fresh process: the first ``generate`` of the tiny Llama in ``dtype``, as
    written ("default") or eager, with the persistent compilation cache in ``cache_dir``
    ("0": cache off)."""
    code = _CHILD.replace("NEW", str(NEW_TOKENS)).replace("FROM", str(PER_TOKEN_FROM))
    code = code.replace("MODE_SETTINGS", repr({m: v[0] for m, v in _MODES.items()}))
    prompt = json.dumps(PROMPTS[_MODE_PROMPTS.get(mode, "one")])
    env = {
        **os.environ,
        "PYTHONPATH": child_pythonpath(),
        "TORCHJAX_COMPILATION_CACHE": cache_dir,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        **_MODES[mode][1],
    }
    out = subprocess.run(
        [sys.executable, "-c", code, dtype, mode, prompt],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1200,
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"bench/startup.py: the child process failed:\n{out.stderr[-3000:]}")


def run(dtypes=DTYPES, modes=MODES) -> dict:
    """{(dtype, mode): {"cold": child result, "warm": child result}}, a fresh cache each."""
    results = {}
    for dtype in dtypes:
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix="torchjax-startup-") as cache:
                cold = child(dtype, mode, cache)
                warm = child(dtype, mode, cache)
            results[dtype, mode] = {"cold": cold, "warm": warm}
    return results


def report(r) -> str:
    lines = [
        f"| tiny Llama first generate ({NEW_TOKENS} tokens), fresh process | wall | "
        f"XLA compiles | programs per token after {PER_TOKEN_FROM} | cache files | target | "
        "second call (compiles) |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    names = {
        "default": "generate",
        "eager": "eager (`disable_compile=True`), static cache",
        "eager-dynamic": "eager, DynamicCache (`TORCHJAX_AUTO_COMPILE_GENERATE=0`)",
        "processors": "generate, `repetition_penalty` + `no_repeat_ngram_size`",
        "no-cache": "generate, `use_cache=False`",
        "eager-processors": "eager, `repetition_penalty` + `no_repeat_ngram_size`",
        "eager-no-cache": "eager, `use_cache=False`",
        "eager-batch2": "eager, batch 2 right-aligned",
        "eager-left-padded": "eager, batch 2 left-padded",
    }
    for (dtype, mode), runs in r.items():
        for which, target in (("cold", "<= 5 s, <= 100 compiles"), ("warm", "<= 1 s")):
            x = runs[which]
            per_token = "" if x.get("per_token") is None else f"{x['per_token']:.2f}"
            lines.append(
                f"| {dtype}, {names[mode]}, {which} cache | {x['wall_s']:.2f} s | "
                f"{x['compiles']} | {per_token} | {x['cache_files']} | {target} | "
                f"{x['second_s']:.2f} s ({x['second_compiles']}) |"
            )
    return "\n".join(lines)


def by_op(r, top: int = 25) -> str:
    lines = []
    for (dtype, mode), runs in r.items():
        cold = runs["cold"]
        lines.append(f"\n{dtype} {mode} cold: {cold['traces']} traces")
        lines += [f"  {t:5d}  {name}" for t, name in cold["ops"][:top]]
    return "\n".join(lines)


def main() -> None:
    print(header("cold start"))
    modes = MODES
    if "--modes" in sys.argv:
        modes = tuple(sys.argv[sys.argv.index("--modes") + 1].split(","))
    dtypes = DTYPES
    if "--dtypes" in sys.argv:
        dtypes = tuple(sys.argv[sys.argv.index("--dtypes") + 1].split(","))
    r = run(dtypes, modes)
    print(report(r))
    if "--by-op" in sys.argv:
        print(by_op(r))


if __name__ == "__main__":
    main()
