"""End to end: Hugging Face models on "tpu" against the same models on CPU."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402  (a test dependency: never skipped)

import torchjax  # noqa: E402,F401
from examples import tiny_llama_generate as tl  # noqa: E402


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tiny_llama_logits_and_greedy_tokens(llama_dir, attn):
    cpu = transformers.AutoModelForCausalLM.from_pretrained(
        llama_dir, attn_implementation=attn
    ).eval()
    tpu = transformers.AutoModelForCausalLM.from_pretrained(
        llama_dir, attn_implementation=attn, device_map="tpu"
    ).eval()
    assert all(p.device.type == "tpu" for p in tpu.parameters())
    batch = tl.prompts()
    tpu_batch = {k: v.to("tpu") for k, v in batch.items()}
    with torch.no_grad():
        cpu_logits = cpu(**batch).logits
        tpu_logits = tpu(**tpu_batch).logits.cpu()
    # Left padding: the pad positions' attention rows are fully masked. They must be
    # finite where CPU is, and equal to CPU everywhere.
    assert torch.isfinite(tpu_logits).all() == torch.isfinite(cpu_logits).all()
    torch.testing.assert_close(tpu_logits, cpu_logits, rtol=1e-4, atol=1e-4)
    # Few tokens: eager decoding with a DynamicCache compiles each op anew for every
    # length. Longer runs: test_generate.py (static cache, compiled).
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        cpu_ids = cpu.generate(**batch, **gen)
        tpu_ids = tpu.generate(**tpu_batch, **gen)
    assert torch.equal(tpu_ids.cpu(), cpu_ids)


def test_tiny_llama_tied_embeddings_load_tied(tmp_path):
    cfg = tl.tiny_llama_config()
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="tpu")
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert m.lm_head.weight.device.type == "tpu"


def test_minilm_real_weights_match_cpu():
    from examples import quickstart

    assert quickstart.main() == 0
