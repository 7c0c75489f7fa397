"""transformers models on the chip: ``from_pretrained(dir, device_map="tpu")`` and greedy
``generate`` give CPU's float32 tokens (the default path: a static cache, compiled decode
steps, the kernels on), and bfloat16 logits stay as close to float32 as CPU's own
bfloat16 run does.

Tiny models from configs with seeded weights (scaled up so greedy decoding is decisive;
tests/integrations/tiny_models.py), saved with ``save_pretrained``: a Llama, Qwen3,
Qwen3-MoE, Gemma 3 (a sliding-window layer and a global one) and Qwen3-Next (a gated
delta-net layer and a gated attention layer, run through transformers' torch fallbacks).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers as tf  # noqa: E402

import torchjax  # noqa: E402
from examples import tiny_llama_generate as tl  # noqa: E402
from tests.integrations import tiny_models  # noqa: E402

MODELS = ["llama", "qwen3", "qwen3_moe", "gemma3"]
# bfloat16 only: the hybrid's padded bfloat16 batch is its question (tests/integrations/
# test_bfloat16_decode.py); one more float32 generate would add its compiles to the
# tier's time for the answer the four above give.
BF16_MODELS = MODELS + ["qwen3_next"]
NEW_TOKENS = 16


def _save(name, path):
    if name == "llama":
        tl.save_tiny_llama(path)
    elif name == "qwen3_next":
        tiny_models.save_tiny(name, path, architectures={name: tiny_models.QWEN3_NEXT})
    else:
        tiny_models.save_tiny(name, path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    paths = {}
    for name in BF16_MODELS:
        paths[name] = str(tmp_path_factory.mktemp(name))
        _save(name, paths[name])
    return paths


def _batch():
    # Two prompts, the first left-padded: the padding mask reaches attention.
    ids = torch.tensor([[0, 0, 0, 1, 17, 42, 99, 5], [1, 5, 6, 7, 8, 9, 10, 11]])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def _generate(model, batch):
    if model.device.type == "tpu":
        batch = {k: v.to("tpu") for k, v in batch.items()}
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
    return out.cpu()


@pytest.mark.parametrize("name", MODELS)
def test_float32_generate_gives_cpus_tokens(saved, name):
    cpu = tf.AutoModelForCausalLM.from_pretrained(saved[name]).eval()
    tpu = tf.AutoModelForCausalLM.from_pretrained(saved[name], device_map="tpu").eval()
    assert next(tpu.parameters()).device.type == "tpu"
    want, got = _generate(cpu, _batch()), _generate(tpu, _batch())
    assert want.shape[1] == _batch()["input_ids"].shape[1] + NEW_TOKENS
    assert torch.equal(got, want), (got, want)


def _logits(model, batch):
    forward = model
    if model.device.type == "tpu":
        batch = {k: v.to("tpu") for k, v in batch.items()}
        # One program, as a user runs a model on the chip; eager would compile each op
        # alone (a hundred programs a model: most of this tier's time).
        forward = torchjax.jit(model)
    with torch.no_grad():
        return forward(**batch).logits.float().cpu()


@pytest.mark.parametrize("name", BF16_MODELS)
def test_bfloat16_logits_as_close_as_cpus_bfloat16(saved, name):
    # torch's own bfloat16 run on CPU is the tolerance: the chip's bfloat16 logits may be
    # no further from the float32 logits than twice CPU's bfloat16 error (plus a floor).
    batch = _batch()
    exact = _logits(tf.AutoModelForCausalLM.from_pretrained(saved[name]).eval(), batch)
    load = dict(dtype=torch.bfloat16)
    cpu = _logits(tf.AutoModelForCausalLM.from_pretrained(saved[name], **load).eval(), batch)
    tpu_model = tf.AutoModelForCausalLM.from_pretrained(saved[name], device_map="tpu", **load)
    assert next(tpu_model.parameters()).dtype == torch.bfloat16
    tpu = _logits(tpu_model.eval(), batch)
    real = batch["attention_mask"].bool()  # padded positions are not compared
    scale = exact[real].abs().max().item()
    cpu_err = (cpu - exact)[real].abs().max().item() / scale
    tpu_err = (tpu - exact)[real].abs().max().item() / scale
    assert tpu_err <= 2 * cpu_err + 2e-3, (name, tpu_err, cpu_err)
