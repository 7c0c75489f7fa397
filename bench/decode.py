"""Greedy decode tokens/s of the tiny Llama in eager: torchjax vs torch CPU vs torchax;
then compiled generation against the same model written in JAX (bench/generate.py).

``model.generate(max_new_tokens=NEW_TOKENS, do_sample=False)`` from an 8-token prompt,
batch 1, KV cache on; tokens/s = NEW_TOKENS / median wall time of ``RUNS`` generations
(after one warm-up generation, which compiles torchjax's per-op executables). torchjax
eager and fused pass ``disable_compile=True`` (transformers' DynamicCache, op by op);
"generate (default)" is the call as written, which on tpu takes a static cache and the
decode programs (Note [A static cache by default on tpu]).

Run:  python bench/decode.py            (eager row, then bench/generate.py's table)
      python bench/decode.py --quick    (eager row, then generate's float32 batch-1 row)
"""

from __future__ import annotations

import copy
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import statistics  # noqa: E402

import torch  # noqa: E402

from bench import _torchax  # noqa: E402
from bench._torchax import TORCHAX_ERRORS as _TORCHAX_ERRORS  # noqa: E402
from bench.common import block_torch, header  # noqa: E402
from bench.models import tiny_llama  # noqa: E402

NEW_TOKENS = 32
RUNS = 3


def tokens_per_s(model, ids, new_tokens: int = NEW_TOKENS, runs: int = RUNS, **kwargs) -> float:
    """Greedy ``generate`` of exactly ``new_tokens`` from ``ids``: tokens/s, the median of
    ``runs`` timed calls after one warm-up call (per-op executables, traces). ``kwargs``
    go to ``generate`` (cache_implementation=, compile_config=, ...)."""

    def gen():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
        block_torch(out)
        return out

    with torch.no_grad():
        gen()
        samples = []
        for _ in range(runs):
            t0 = time.perf_counter()
            gen()
            samples.append(time.perf_counter() - t0)
    return new_tokens / statistics.median(samples)


PROMPT = [[1, 17, 42, 99, 5, 6, 7, 8]]


def run() -> dict:
    import torchjax

    model = tiny_llama()
    ids = torch.tensor(PROMPT)
    out = {"torch CPU": tokens_per_s(model, ids)}
    # disable_compile: eager with transformers' DynamicCache (as written, generate on tpu
    # runs the decode programs: Note [A static cache by default on tpu]).
    eager = dict(disable_compile=True)
    out["torchjax"] = tokens_per_s(copy.deepcopy(model).to("tpu"), ids.to("tpu"), **eager)
    # Fused eager mode (Note [Fused eager] in torchjax/ops/fused.py).
    with torchjax.fused():
        out["torchjax fused"] = tokens_per_s(copy.deepcopy(model).to("tpu"), ids.to("tpu"), **eager)
    out["torchjax generate"] = tokens_per_s(copy.deepcopy(model).to("tpu"), ids.to("tpu"))
    tax = _torchax.measure("decode")
    out["torchax"] = tax.get("decode", tax.get("*", "n/a (not measured)"))
    return out


def torchax_results(tx) -> dict:
    """{"decode": torchax tokens/s or "n/a (why)"} (run by bench/_torchax.py in a
    process without torchjax)."""
    model = tiny_llama()
    try:
        with tx.default_env():
            tps = tokens_per_s(model.to("jax"), torch.tensor(PROMPT).to("jax"))
    except (*_TORCHAX_ERRORS, tx.tensor.OperatorNotFound) as e:
        msg = str(e).splitlines()[0][:80] if str(e) else ""
        return {"decode": f"n/a (torchax: {type(e).__name__}: {msg})"}
    return {"decode": tps}


def report(r) -> str:
    def f(v):
        return v if isinstance(v, str) else f"{v:.1f}"

    return "\n".join(
        [
            "| tiny Llama greedy decode (tokens/s, higher is better) | torchjax eager | "
            "torchjax fused | torchjax generate (default) | torchax | torch CPU |",
            "|---|---:|---:|---:|---:|---:|",
            f"| batch 1, {NEW_TOKENS} new tokens | {f(r['torchjax'])} | "
            f"{f(r.get('torchjax fused', 'n/a'))} | {f(r.get('torchjax generate', 'n/a'))} | "
            f"{f(r['torchax'])} | {f(r['torch CPU'])} |",
        ]
    )


def main() -> None:
    from bench import generate

    quick = "--quick" in sys.argv[1:]
    print(header("eager decode"))
    print(report(run()))
    cases = [("float32", 1)] if quick else generate.CASES
    print("\n" + generate.report([(c, generate.run_one(*c, eager=not quick)) for c in cases]))


if __name__ == "__main__":
    main()
