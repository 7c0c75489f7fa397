"""The ``moe`` section of bench/tpu.py: a MoE model scaled to fit the chip, decoding and
training with transformers' ``grouped_mm`` experts (what a model runs by default:
``aten::_grouped_mm``, lowered to ``jax.lax.ragged_dot``) and with
``experts_implementation="torchjax_ragged_dot"`` (torchjax's ragged dot: on TPU,
``lax.ragged_dot`` forward and rhs gradient, the Pallas kernel for the lhs gradient).

The model: Qwen3-MoE-shaped, hidden 1024, 8 layers, 16/4 heads of 64, 64 experts of
width 512, top 8, vocab 32768 (0.93B parameters, 1.9 GB in bfloat16), seeded random
weights. Rows per implementation, in one process (weights shared):

- ``decode``: greedy ``generate`` of 64 tokens after a 128-token prompt, batch 1 (the
  default compiled path), tokens/s, median of 3 after a first call (its time kept);
- ``train``: a ``torchjax.jit`` step (forward, backward, AdamW) at batch 4, sequence
  512, median of 3 after two calls; its loss (the second implementation trains on from
  the first's weights);
- ``tokens_equal``: whether both implementations gave the same greedy tokens.

``TORCHJAX_BENCH_ROWS`` (``decode``, ``train``, comma-separated) runs only those rows.
"""

from __future__ import annotations

import os
import statistics
import sys
import time


def _config(small: bool):
    import transformers as tf

    dims = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16)
    dims.update(num_key_value_heads=4, head_dim=64, moe_intermediate_size=512)
    dims.update(intermediate_size=2048, num_experts=64, num_experts_per_tok=8)
    dims.update(vocab_size=32768)
    if small:
        dims.update(hidden_size=128, num_hidden_layers=2, num_attention_heads=4)
        dims.update(num_key_value_heads=2, head_dim=32, moe_intermediate_size=64)
        dims.update(num_experts=8, num_experts_per_tok=2, vocab_size=512)
    return tf.Qwen3MoeConfig(
        **dims, max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, norm_topk_prob=True,
    )  # fmt: skip


def _progress(what: str) -> None:
    # On stderr as it happens: a section stopped by its time limit still says how far
    # it got (a first compile can take minutes).
    print(f"moe: {what} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)


def _median_s(call, runs=3):
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _train(model, ids) -> dict:
    import torch

    import torchjax
    from bench.common import lm_train_step

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)

    step = torchjax.jit(lm_train_step(model, opt))

    def train():
        loss = step(ids)
        torch.tpu.synchronize()
        return loss

    row = {}
    try:
        t0 = time.perf_counter()
        train()
        row["first_step_s"] = round(time.perf_counter() - t0, 1)
        train()
        row["train_step_ms"] = round(_median_s(train) * 1e3, 1)
        row["loss"] = round(train().item(), 4)
    except Exception as e:  # noqa: BLE001 - reported, the rest runs
        row["train_error"] = f"{type(e).__name__}: {e}"[:500]
    return row


def _rows() -> list:
    return os.environ.get("TORCHJAX_BENCH_ROWS", "decode,train").split(",")


def moe(ctx) -> dict:
    import torch
    import transformers as tf

    from bench.common import block_torch
    from torchjax.integrations.transformers._moe import NAME, register_experts

    register_experts()
    cfg = _config(ctx.small)
    torch.manual_seed(0)
    with torch.device("tpu"):
        model = tf.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, cfg.vocab_size, (1, 128), generator=gen).to("tpu")
    new = 16 if ctx.small else 64
    batch, seq = (2, 64) if ctx.small else (4, 512)
    ids = torch.randint(3, cfg.vocab_size, (batch, seq), generator=gen).to("tpu")
    out = {"parameters": params, "weights_GB": round(2 * params / 1e9, 2)}
    tokens = {}
    impls = ("grouped_mm", NAME)
    for impl in impls if "decode" in _rows() else ():  # decode first: training changes weights
        model.set_experts_implementation(impl)
        out[impl] = row = {}

        def decode():
            with torch.no_grad():
                got = model.generate(
                    prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                    min_new_tokens=new, do_sample=False, pad_token_id=0,
                )  # fmt: skip
            return block_torch(got)

        try:
            _progress(f"{impl}: first generate")
            t0 = time.perf_counter()
            tokens[impl] = decode().cpu()
            row["first_generate_s"] = round(time.perf_counter() - t0, 1)
            row["decode_tok_s"] = round(new / _median_s(decode), 1)
        except Exception as e:  # noqa: BLE001 - reported, the rest runs
            row["decode_error"] = f"{type(e).__name__}: {e}"[:500]
    for impl in impls if "train" in _rows() else ():
        model.set_experts_implementation(impl)
        _progress(f"{impl}: first train step")
        out[impl].update(_train(model, ids))
    if len(tokens) == 2:
        out["tokens_equal"] = bool(torch.equal(*tokens.values()))
    a, b = out["grouped_mm"], out[NAME]
    for key in ("decode_tok_s", "train_step_ms"):
        if key in a and key in b:
            faster = b[key] / a[key] if key == "decode_tok_s" else a[key] / b[key]
            out[f"{key.split('_')[0]}_speedup_of_{NAME}"] = round(faster, 3)
    return out
