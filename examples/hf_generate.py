"""Tiny Llama generation on device "tpu", eager and compiled, checked against CPU.

The model (examples/tiny_llama_generate.py: built from a config, seeded weights,
``save_pretrained`` then ``from_pretrained(path, device_map="tpu")``) greedily decodes
a left-padded batch of two prompts with a static KV cache:

- eager: every op runs as its own cached jax executable;
- compiled: ``torchjax.integrations.transformers.compile_generate(model)`` makes the
  prefill one ``torchjax.jit`` program and every new token one call of a decode-step
  program (the forward over the cache, the token choice and the stopping flags), whatever
  the number of new tokens.

Both must give CPU's tokens; the compiled run must trace exactly three times (the
prefill, the first token's choice, the decode step).

Run:  python examples/hf_generate.py
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

try:
    from examples import tiny_llama_generate as tl  # noqa: E402
except ModuleNotFoundError:  # run as a script: examples/ is on sys.path
    import tiny_llama_generate as tl  # noqa: E402

from torchjax.integrations.transformers import compile_generate  # noqa: E402

NEW_TOKENS = 8


def generate(model, new_tokens: int, **kwargs) -> torch.Tensor:
    batch = {k: v.to(model.device) for k, v in tl.prompts().items()}
    with torch.no_grad():
        return model.generate(
            **batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            eos_token_id=None, cache_implementation="static", **kwargs,
        ).cpu()  # fmt: skip


def run(new_tokens: int = NEW_TOKENS) -> dict:
    """Token ids (prompt + ``new_tokens``) from CPU, tpu eager and tpu compiled, and the
    compiled programs' traces."""
    with tempfile.TemporaryDirectory() as path:
        tl.save_tiny_llama(path)
        cpu = AutoModelForCausalLM.from_pretrained(path).eval()
        tpu = AutoModelForCausalLM.from_pretrained(path, device_map="tpu").eval()
    out = {"cpu": generate(cpu, new_tokens)}
    # disable_compile: transformers would compile a static-cache decode step on "tpu"
    # (torchjax runs it as compile_generate's programs); this run is the eager one.
    out["eager"] = generate(tpu, new_tokens, disable_compile=True)
    jitted = compile_generate(tpu)
    out["compiled"] = generate(tpu, new_tokens)
    # the prefill (the compiled forward), the first token's program (Note [The step after
    # the prefill]) and the decode step (Note [Decode steps as one program])
    forward = tpu.forward
    out["traces"] = (
        jitted.trace_count + forward.first_token.trace_count + forward.decode_step.trace_count
    )
    return out


def main() -> int:
    out = run()
    for name in ("cpu", "eager", "compiled"):
        print(f"{name:9s}", out[name][:, -NEW_TOKENS:].tolist())
    print(f"compiled generation of {NEW_TOKENS} tokens traced {out['traces']} times")
    if not (torch.equal(out["eager"], out["cpu"]) and torch.equal(out["compiled"], out["cpu"])):
        print("FAIL: tpu tokens differ from CPU", file=sys.stderr)
        return 1
    if out["traces"] != 3:
        print("FAIL: expected 3 traces (prefill, first token, decode step)", file=sys.stderr)
        return 1
    print(f"OK: eager and compiled tpu generation give CPU's {NEW_TOKENS} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
