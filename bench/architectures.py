"""Per-architecture figures: today's transformers architectures, cold and warm, on tpu and CPU.

Each architecture is a tiny config (hidden 32, 2 layers, vocab 128; the builders of
tests/integrations/tiny_models.py where it has one) with seeded weights, written with
``save_pretrained`` to a temporary directory and loaded with ``device_map="tpu"`` (and to
CPU) in a fresh child process of its own with the persistent compilation cache off, so the
first call of each kind really compiles. Per architecture, batch 1, a 16-token prompt,
float32, ``torch.no_grad``:

- eager forward (``use_cache=False``): first and second call on tpu and on CPU;
- ``torchjax.jit`` of the model's forward: first and second call;
- greedy ``generate`` of ``NEW_TOKENS`` tokens: first, second and third call with the tpu
  default (a static cache and compiled generation, docs/huggingface.md; the second call
  traces the prefill once more, so the third is the steady state), and on CPU (second
  call); below the table, why generate ran transformers' loop around the compiled
  forward where it did;
- the XLA compiles of each first tpu call (``torchjax.stats()["compiles"]``), and of
  later calls where they compile again;
- a check: the tpu logits (eager and jit) equal CPU's within rtol = atol = 1e-4 and the
  generated tokens equal CPU's ("ok", else "FAIL" and what differed).

Run:  python bench/architectures.py           (all 10, ~6 min on 2 busy cores)
      python bench/architectures.py --quick   (3 of them, ~2 min)
      python bench/architectures.py qwen3_next llama4   (those only)
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from bench.common import child_pythonpath, fmt_us, header  # noqa: E402

SEQ = 16
NEW_TOKENS = 8
NAMES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "gemma4", "gemma4_moe", "llama4",
         "deepseek_v3", "gpt_oss", "minimax_m2", "t5gemma")  # fmt: skip
# Sliding + shared-KV, chunked + NoPE, sigmoid-routed MoE: three kinds of layer, quick to compile.
QUICK = ("gemma4", "llama4", "minimax_m2")
TIMEOUT_S = 300


# ---- tiny configs (the rest come from tests/integrations/tiny_models.py) ----


def _configs() -> dict:
    """name -> (Auto class, config factory, attn_implementation)."""
    import transformers as tf

    from tests.integrations import tiny_models as tm

    d = tm._DECODER

    def qwen3_5_moe():
        # Qwen3.5's hybrid (linear attention + full attention) with sparse experts and a
        # shared expert in every layer.
        base = tm._qwen3_5().to_dict()
        keep = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "layer_types",
                "rope_parameters", "head_dim")  # fmt: skip
        return tf.Qwen3_5MoeTextConfig(
            **{k: v for k, v in d.items() if k not in ("intermediate_size", "head_dim")},
            **{k: base[k] for k in keep},
            moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2,
        )  # fmt: skip

    def qwen3_next():
        # Gated delta-net and gated full attention, sparse experts with a shared expert.
        return tf.Qwen3NextConfig(
            **{**d, "head_dim": 16}, linear_conv_kernel_dim=4, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention"], moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.5},
        )  # fmt: skip

    def gemma4():
        # Dense: sliding and global layers, per-layer inputs, and a third layer that reads
        # the global layer's keys and values (shared KV: a shared layer needs a layer of
        # its type before the shared ones, hence 3 layers).
        return tf.Gemma4TextConfig(
            **{**d, "num_hidden_layers": 3}, sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "full_attention"],
            global_head_dim=16, vocab_size_per_layer_input=tm.VOCAB,
            hidden_size_per_layer_input=8, num_kv_shared_layers=1,
        )  # fmt: skip

    def llama4():
        # A chunked-attention layer with RoPE, then a global NoPE layer with MoE experts.
        return tf.Llama4TextConfig(
            **d, attention_chunk_size=4, intermediate_size_mlp=64,
            layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0],
            num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
        )  # fmt: skip

    def minimax_m2():
        # Sigmoid-routed sparse experts with a routing bias.
        return tf.MiniMaxM2Config(
            **{**d, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2,
        )  # fmt: skip

    causal = tf.AutoModelForCausalLM
    ours = {
        "qwen3_5_moe": (causal, qwen3_5_moe, "sdpa"),
        "qwen3_next": (causal, qwen3_next, "sdpa"),
        "gemma4": (causal, gemma4, "sdpa"),
        "llama4": (causal, llama4, "sdpa"),
        "minimax_m2": (causal, minimax_m2, "sdpa"),
        "t5gemma": tm.T5GEMMA,
    }
    return {n: ours[n] if n in ours else tm.ARCHITECTURES[n] for n in NAMES}


# ---- the child process: one architecture ----


def _timed(fn):
    """(result, seconds, XLA compiles) of one blocking call."""
    import torchjax

    torchjax.reset_stats()
    t0 = time.perf_counter()
    out = fn().cpu()  # the host copy waits for the device
    seconds = time.perf_counter() - t0
    return out, seconds, torchjax.stats()["compiles"]


def _child(name: str, path: str) -> dict:
    import torch

    import torchjax
    from tests.integrations import tiny_models

    auto, config, attn = _configs()[name]
    tiny_models.save_tiny(name, path, architectures={name: (auto, config, attn)})
    cpu = auto.from_pretrained(path, attn_implementation=attn).eval()
    tpu = auto.from_pretrained(path, attn_implementation=attn, device_map="tpu").eval()
    ids = torch.randint(3, tiny_models.VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    fwd = dict(batch, use_cache=False)
    if cpu.config.is_encoder_decoder:
        fwd["decoder_input_ids"] = ids[:, : SEQ // 2]
    tpu_fwd = {k: v.to("tpu") if isinstance(v, torch.Tensor) else v for k, v in fwd.items()}
    tpu_batch = {k: v.to("tpu") for k, v in batch.items()}
    gen = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
               pad_token_id=0)  # fmt: skip
    r, notes = {}, []
    jitted = torchjax.jit(tpu)
    with torch.no_grad():
        for key, fn in (
            ("eager", lambda: tpu(**tpu_fwd).logits),
            ("cpu", lambda: cpu(**fwd).logits),
            ("jit", lambda: jitted(**tpu_fwd).logits),
            ("generate", lambda: tpu.generate(**tpu_batch, **gen)),
            ("cpu_generate", lambda: cpu.generate(**batch, **gen)),
        ):
            out, r[f"{key}_1"], r[f"{key}_1_compiles"] = _timed(fn)
            _, r[f"{key}_2"], r[f"{key}_2_compiles"] = _timed(fn)
            r[f"{key}_out"] = out
        # The second generate traces the prefill again (it is the first call that finds
        # the static cache the first one made); the third shows the steady state.
        _, r["generate_3"], r["generate_3_compiles"] = _timed(
            lambda: tpu.generate(**tpu_batch, **gen)
        )
    # Why generate ran transformers' loop around the compiled forward, if it did.
    r["fallback"] = getattr(vars(tpu).get("forward"), "last_fallback", "not compiled")
    want = r.pop("cpu_out")
    for key in ("eager", "jit"):
        got = r.pop(f"{key}_out")
        try:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        except AssertionError as e:
            notes.append(f"{key} logits: {str(e).splitlines()[-2].strip()}")
    tokens, cpu_tokens = r.pop("generate_out"), r.pop("cpu_generate_out")
    if not torch.equal(tokens, cpu_tokens):
        notes.append(f"generate tokens {tokens[0, -NEW_TOKENS:].tolist()} "
                     f"vs CPU {cpu_tokens[0, -NEW_TOKENS:].tolist()}")  # fmt: skip
    r["check"] = "ok" if not notes else "FAIL: " + "; ".join(notes)
    return r


def run_one(name: str) -> dict:
    """One fresh process for ``name``: its figures, or {"error": last line of stderr}."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "TORCHJAX_COMPILATION_CACHE": "0"}
    with tempfile.TemporaryDirectory(prefix=f"torchjax-{name}-") as path:
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", name, path],
                capture_output=True, text=True, env=env, cwd=ROOT, timeout=TIMEOUT_S,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": f"over {TIMEOUT_S} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]}


def _fmt_s(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 1 else fmt_us(seconds * 1e6)


def report(results: dict) -> str:
    def pair(r, key):
        return f"{_fmt_s(r[f'{key}_1'])} / {_fmt_s(r[f'{key}_2'])}"

    def compiles(r, key):  # later calls that compile again show "(+n, +m)"
        again = [r[k] for k in (f"{key}_2_compiles", f"{key}_3_compiles") if k in r]
        return f"{r[f'{key}_1_compiles']}" + (
            f" (+{', +'.join(map(str, again))})" if any(again) else ""
        )

    lines = [
        "| architecture | eager forward tpu, 1st / 2nd | CPU, 1st / 2nd | torchjax.jit, "
        f"1st / 2nd | generate {NEW_TOKENS} tokens tpu, 1st / 2nd / 3rd | CPU generate | "
        "XLA compiles, 1st eager / jit / generate (+2nd, +3rd) | vs CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | n/a | | | | | | FAIL: {r['error']} |")
            continue
        counts = " / ".join(compiles(r, k) for k in ("eager", "jit", "generate"))
        lines.append(
            f"| {name} | {pair(r, 'eager')} | {pair(r, 'cpu')} | {pair(r, 'jit')} | "
            f"{pair(r, 'generate')} / {_fmt_s(r['generate_3'])} | "
            f"{_fmt_s(r['cpu_generate_2'])} | {counts} | {r['check']} |"
        )
    loops = [f"{n}: {r['fallback']}" for n, r in results.items() if r.get("fallback")]
    if loops:
        lines.append("\ngenerate ran transformers' loop around the compiled forward (why): "
                     + "; ".join(loops))  # fmt: skip
    return "\n".join(lines)


def main(argv) -> None:
    if argv[:1] == ["--child"]:
        print("RESULT " + json.dumps(_child(argv[1], argv[2])))
        return
    names = [a for a in argv if not a.startswith("--")] or (QUICK if "--quick" in argv else NAMES)
    import torchjax  # noqa: F401  (for the header's versions)

    print(header("transformers architectures on tpu: first and second calls"))
    t0 = time.perf_counter()
    results = {}
    for name in names:
        t1 = time.perf_counter()
        results[name] = run_one(name)
        print(f"{name}: {time.perf_counter() - t1:.0f} s", file=sys.stderr, flush=True)
    print(report(results))
    print(f"\n{len(names)} child processes in {time.perf_counter() - t0:.0f} s; first calls "
          "run with the persistent compilation cache off")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
