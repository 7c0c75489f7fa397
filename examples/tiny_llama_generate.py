"""A tiny Llama-architecture causal LM loaded with device_map="tpu" generates like CPU.

No model hub is reachable, so the model is built from a config with seeded random
weights, saved with ``save_pretrained`` and loaded back with
``from_pretrained(path, device_map="tpu")``. A left-padded batch of two prompts is
decoded greedily for 20 tokens on "tpu" and on CPU; the token ids must be identical.

Run:  python examples/tiny_llama_generate.py
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

MAX_NEW_TOKENS = 20


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def save_tiny_llama(path: str, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    # Scale weights up so greedy decoding is decisive (random init gives near-ties).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    model.save_pretrained(path)


def prompts() -> dict[str, torch.Tensor]:
    # Two prompts of different lengths, left-padded with pad id 0.
    ids = torch.tensor([[0, 0, 0, 1, 17, 42, 99], [1, 5, 6, 7, 8, 9, 10]])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def generate(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            **batch,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )


def main() -> int:
    # Imported here, not at the top, so bench/models.py can reuse tiny_llama_config() in
    # torchax's process (torchax claims the PrivateUse1 backend there).
    import torchjax  # noqa: F401  (adds the "tpu" device)

    with tempfile.TemporaryDirectory() as path:
        save_tiny_llama(path)
        cpu_model = AutoModelForCausalLM.from_pretrained(path).eval()
        tpu_model = AutoModelForCausalLM.from_pretrained(path, device_map="tpu").eval()
    print(f"model on {next(tpu_model.parameters()).device}")
    batch = prompts()
    cpu_ids = generate(cpu_model, batch)
    tpu_ids = generate(tpu_model, {k: v.to("tpu") for k, v in batch.items()})
    print("tpu tokens:", tpu_ids.cpu().tolist())
    print("cpu tokens:", cpu_ids.tolist())
    with torch.no_grad():
        cpu_logits = cpu_model(**batch).logits
        tpu_logits = tpu_model(**{k: v.to("tpu") for k, v in batch.items()}).logits.cpu()
    mask = batch["attention_mask"].bool()
    diff = (tpu_logits - cpu_logits)[mask].abs().max().item()
    print(f"max abs logit difference vs CPU (non-pad positions): {diff:.2e}")
    if not torch.equal(tpu_ids.cpu(), cpu_ids):
        print("FAIL: generated tokens differ from CPU", file=sys.stderr)
        return 1
    print(f"OK: {MAX_NEW_TOKENS} greedy tokens identical to CPU for both prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
