"""transformers architectures loaded with device_map="tpu": logits and greedy tokens as CPU.

Llama (sdpa and eager attention, float32 and bfloat16) is in test_transformers.py and
test_generate.py; BERT is the real MiniLM in test_transformers.py. Here: Qwen3, Qwen3-MoE
(sparse experts), GPT-2, Gemma 3 (sliding-window + global layers), T5 (encoder-decoder),
Qwen3.5 (linear-attention hybrid), Gemma 4 MoE, DeepSeek-V3 (latent attention) and
GPT-OSS (attention sinks), one model each, loaded once per module; compiled static-cache
generation (the default on tpu) for each, and compile_generate's trace counts for the two
whose cache or layers differ most from Llama's.
"""

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torchjax  # noqa: E402,F401
from tests.integrations import tiny_models  # noqa: E402
from torchjax.integrations.transformers import compile_generate  # noqa: E402

NEW_TOKENS = 3
# Two prompts, the first left-padded (pad id 0): masks and padded positions are exercised.
IDS = torch.tensor([[0, 0, 1, 17, 42, 99], [1, 5, 6, 7, 8, 9]])


@pytest.fixture(scope="module", params=list(tiny_models.ARCHITECTURES))
def models(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp(name)
    tiny_models.save_tiny(name, str(path))
    auto, _, attn = tiny_models.ARCHITECTURES[name]
    cpu = auto.from_pretrained(path, attn_implementation=attn).eval()
    tpu = auto.from_pretrained(path, attn_implementation=attn, device_map="tpu").eval()
    return name, cpu, tpu


def test_logits_and_greedy_tokens_match_cpu(models):
    name, cpu, tpu = models
    assert {p.device.type for p in tpu.parameters()} == {"tpu"}
    batch = {"input_ids": IDS, "attention_mask": (IDS != 0).long()}
    if tpu.config.is_encoder_decoder:
        batch["decoder_input_ids"] = torch.tensor([[0, 5, 9], [0, 7, 3]])
    with torch.no_grad():
        cpu_logits = cpu(**batch).logits
        tpu_logits = tpu(**{k: v.to("tpu") for k, v in batch.items()}).logits
    assert tpu_logits.device.type == "tpu"
    torch.testing.assert_close(tpu_logits.cpu(), cpu_logits, rtol=1e-4, atol=1e-4)

    gen = dict(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )
    batch.pop("decoder_input_ids", None)
    with torch.no_grad():
        cpu_ids = cpu.generate(**batch, **gen)
        # Eager with transformers' DynamicCache; then the default on tpu, a static cache
        # and compile_generate's programs (Note [A static cache by default on tpu]).
        eager = tpu.generate(**{k: v.to("tpu") for k, v in batch.items()}, **gen,
                             disable_compile=True)  # fmt: skip
        assert "forward" not in vars(tpu)
        tpu_ids = tpu.generate(**{k: v.to("tpu") for k, v in batch.items()}, **gen)
    assert tpu_ids.device.type == "tpu"
    assert torch.equal(eager.cpu(), cpu_ids), name
    assert torch.equal(tpu_ids.cpu(), cpu_ids), name
    assert vars(tpu)["forward"].jitted.trace_count > 0, name


@pytest.mark.parametrize("models", ["t5", "qwen3_moe"], indirect=True)
def test_compile_generate_static_cache_matches_cpu(models):
    # Encoder-decoder (an EncoderDecoderCache around the static self-attention cache) and
    # sparse MoE experts under torchjax.jit, on a model of their own (the shared one ran
    # compiled generation in the test above).
    name, cpu, _ = models
    tpu = copy.deepcopy(cpu).to("tpu")
    jitted = compile_generate(tpu)
    batch = {"input_ids": IDS, "attention_mask": (IDS != 0).long()}
    gen = dict(
        max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
        cache_implementation="static",
    )  # fmt: skip
    with torch.no_grad():
        cpu_ids = cpu.generate(**batch, **gen)
        tpu_ids = tpu.generate(**{k: v.to("tpu") for k, v in batch.items()}, **gen)
    assert torch.equal(tpu_ids.cpu(), cpu_ids), name
    # T5 (encoder-decoder) runs transformers' loop around the compiled forward: prefill
    # (the first decoder step) and decode step. Qwen3-MoE: the prefill, the first token's
    # program, the decode step.
    forward = tpu.forward
    traces = (jitted.trace_count, forward.first_token.trace_count, forward.decode_step.trace_count)
    assert traces == ((2, 0, 0) if name == "t5" else (1, 1, 1)), name


@pytest.mark.parametrize("models", ["gemma3", "qwen3_moe"], indirect=True)
def test_torch_compile_forward_with_its_own_cache_matches_cpu(models):
    # torch.compile(backend="tpu") of a forward that builds its DynamicCache: Gemma 3's
    # sliding layers move a Python-made tensor to tpu in the graph, Qwen3-MoE's experts
    # call float32 _grouped_mm (torch's meta kernel allows bfloat16 only).
    name, cpu, _ = models
    tpu = copy.deepcopy(cpu).to("tpu")
    compiled = torch.compile(tpu, backend="tpu")
    batch = {"input_ids": IDS, "attention_mask": (IDS != 0).long()}
    with torch.no_grad():
        want = cpu(**batch, use_cache=True).logits
        got = compiled(**{k: v.to("tpu") for k, v in batch.items()}, use_cache=True).logits
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_t5gemma_compiled_generate_traces_once(tmp_path):
    # T5Gemma gives its cache a new cross-attention sub-cache at every generate; the
    # compiled forward puts back the one it first saw (reset), so from the third call
    # on (the second traces the prefill again: Note [Compiled generation with a static
    # cache]) generate compiles nothing and keeps CPU's tokens.
    auto, _, attn = tiny_models.T5GEMMA
    tiny_models.save_tiny("t5gemma", str(tmp_path), architectures={"t5gemma": tiny_models.T5GEMMA})
    cpu = auto.from_pretrained(tmp_path, attn_implementation=attn).eval()
    tpu = auto.from_pretrained(tmp_path, attn_implementation=attn, device_map="tpu").eval()
    batch = {"input_ids": IDS, "attention_mask": (IDS != 0).long()}
    gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    want = tiny_models.generate(cpu, batch, **gen)
    traces = []
    for _ in range(4):
        assert torch.equal(tiny_models.generate(tpu, batch, **gen), want)
        traces.append(vars(tpu)["forward"].jitted.trace_count)
    assert traces[2] == traces[3] > 0, traces
