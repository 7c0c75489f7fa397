"""Qwen3-Next in bfloat16 on tpu: a left-padded batch decodes as close to float32 as
CPU's own bfloat16 run does.

The linear-attention layer runs transformers' torch fallbacks: the chunked gated delta
rule and causal conv1d over the padded prompt (the padding zeroed by the mask), then the
recurrent rule and the conv update over the cache at each step, the gated RMSNorm after
both. Its tiny model has dense MLPs (tests/integrations/tiny_models.py says why).
"""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torchjax  # noqa: E402,F401
from tests.integrations import tiny_models  # noqa: E402

NEW_TOKENS = 12
# The first prompt left-padded by two (pad id 0).
IDS = torch.tensor([[0, 0, 1, 17, 42, 99], [1, 5, 6, 7, 8, 9]])


def _decode(model):
    batch = {"input_ids": IDS, "attention_mask": (IDS != 0).long()}
    if model.device.type == "tpu":
        batch = {k: v.to("tpu") for k, v in batch.items()}
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            disable_compile=True,
        )  # fmt: skip
    return out.sequences.cpu(), torch.stack([x.float().cpu() for x in out.logits])


def test_left_padded_bfloat16_decode_tracks_float32_as_cpu_does(tmp_path):
    auto, _, attn = tiny_models.QWEN3_NEXT
    arch = {"qwen3_next": tiny_models.QWEN3_NEXT}
    tiny_models.save_tiny("qwen3_next", str(tmp_path), architectures=arch)

    def load(**kw):
        return auto.from_pretrained(tmp_path, attn_implementation=attn, **kw).eval()

    exact_ids, exact = _decode(load())
    cpu_ids, cpu = _decode(load(dtype=torch.bfloat16))
    tpu_ids, tpu = _decode(load(dtype=torch.bfloat16, device_map="tpu"))
    assert torch.equal(cpu_ids, exact_ids) and torch.equal(tpu_ids, cpu_ids)
    # One bfloat16 step at the logits' magnitude. tpu's logits are CPU's to two steps:
    # float32 internals computed in another order (sums, exp) can flip a rounding.
    step = 2.0 ** (torch.floor(torch.log2(exact.abs().max())).item() - 7)
    torch.testing.assert_close(tpu, cpu, rtol=0, atol=2 * step)
    # Per step and row, the largest logit error against float32: tpu's is no larger than
    # twice CPU's plus one step.
    cpu_err, tpu_err = (cpu - exact).abs().amax(-1), (tpu - exact).abs().amax(-1)
    assert (tpu_err <= 2 * cpu_err + step).all(), (tpu_err, cpu_err)
