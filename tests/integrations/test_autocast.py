"""torch.autocast("tpu", bfloat16) around a transformers forward, against CPU autocast."""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

import torchjax  # noqa: E402,F401
from examples import tiny_llama_generate as tl  # noqa: E402


def _run(model, batch, device_type):
    """Logits under autocast, and the output dtypes of a projection and a norm layer."""
    dtypes = {}

    def record(name):
        def hook(module, args, output):
            dtypes[name] = output.dtype  # returns None: the output is kept

        return hook

    layer = model.model.layers[0]
    hooks = [
        mod.register_forward_hook(record(name))
        for name, mod in (("q_proj", layer.self_attn.q_proj), ("norm", layer.input_layernorm))
    ]
    with torch.no_grad(), torch.autocast(device_type=device_type, dtype=torch.bfloat16):
        logits = model(**batch).logits
    for h in hooks:
        h.remove()
    return logits, dtypes


def test_autocast_bf16_llama_forward_matches_cpu_autocast(tmp_path):
    tl.save_tiny_llama(str(tmp_path))
    cpu = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tpu = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="tpu").eval()
    batch = tl.prompts()
    cpu_logits, cpu_dtypes = _run(cpu, batch, "cpu")
    tpu_logits, tpu_dtypes = _run(tpu, {k: v.to("tpu") for k, v in batch.items()}, "tpu")
    # Linear layers run in bfloat16; LlamaRMSNorm upcasts to float32 itself and returns
    # its weight's dtype (float32). Parameters stay float32.
    assert tpu_dtypes == cpu_dtypes == {"q_proj": torch.bfloat16, "norm": torch.float32}
    assert tpu.lm_head.weight.dtype == torch.float32
    assert tpu_logits.dtype == cpu_logits.dtype == torch.bfloat16
    # bfloat16 tolerance: a few units in the last place at the logits' magnitude (~5).
    torch.testing.assert_close(tpu_logits.cpu().float(), cpu_logits.float(), rtol=0, atol=0.1)
