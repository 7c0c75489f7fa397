"""Note [Copies of a compiled model] (torchjax/integrations/transformers/_generate.py): a
model that generate compiled on tpu copies (``copy.deepcopy``) and pickles
(``torch.save``) as on CPU: the copy runs and trains its own weights."""

import copy
import io

import torch
import transformers as tf

import torchjax  # noqa: F401
from examples import tiny_llama_generate as tl

GREEDY = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)


def _models():
    cfg = tl.tiny_llama_config()
    torch.manual_seed(0)
    cpu = tf.LlamaForCausalLM(cfg).eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    return cpu, tpu


def test_a_copy_after_generate_runs_and_trains_its_own_weights():
    cpu, tpu = _models()
    ids = torch.randint(2, 128, (1, 6))
    assert torch.equal(tpu.generate(ids.to("tpu"), **GREEDY).cpu(), cpu.generate(ids, **GREEDY))
    assert "forward" in vars(tpu)  # compiled by its generate
    copies = [copy.deepcopy(cpu), copy.deepcopy(tpu)]
    for m in copies:
        with torch.no_grad():
            m.lm_head.weight.mul_(0.5)
    want = copies[0](input_ids=ids, labels=ids)
    got = copies[1](input_ids=ids.to("tpu"), labels=ids.to("tpu"))
    torch.testing.assert_close(got.logits.cpu(), want.logits, atol=2e-5, rtol=1e-4)
    got.loss.backward()
    want.loss.backward()
    assert tpu.lm_head.weight.grad is None  # the original's weights were not used
    torch.testing.assert_close(
        copies[1].lm_head.weight.grad.cpu(), copies[0].lm_head.weight.grad, atol=2e-5, rtol=1e-4
    )
    # The copy compiles again at its own generate, and gives CPU's copy's tokens.
    copies[1].zero_grad()
    out = copies[1].generate(ids.to("tpu"), **GREEDY)
    assert torch.equal(out.cpu(), copies[0].generate(ids, **GREEDY))
    assert "forward" in vars(copies[1])


def test_a_model_saved_whole_after_generate_loads_and_generates_as_cpu():
    cpu, tpu = _models()
    ids = torch.randint(2, 128, (2, 6))
    first = tpu.generate(ids.to("tpu"), **GREEDY)
    buf = io.BytesIO()
    torch.save(tpu, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded.generate(ids.to("tpu"), **GREEDY).cpu(), cpu.generate(ids, **GREEDY))
    assert torch.equal(first.cpu(), cpu.generate(ids, **GREEDY))
    # The original stays compiled.
    assert "forward" in vars(tpu) and torch.equal(
        tpu.generate(ids.to("tpu"), **GREEDY).cpu(), first.cpu()
    )
