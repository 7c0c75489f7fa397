"""model.generate on "tpu": sampling, beam search, static cache, compiled generation.

The tiny Llama of examples/tiny_llama_generate.py (a left-padded batch of two prompts),
compared with the same checkpoint on CPU.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

import torchjax  # noqa: E402
from examples import tiny_llama_generate as tl  # noqa: E402
from tests.integrations.tiny_models import generate  # noqa: E402
from torchjax.integrations.transformers import compile_generate  # noqa: E402

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
# Eager generation with a static cache: after the prefill every step has the same shapes,
# so each op compiles once (a DynamicCache grows: new shapes, new per-op executables, on
# every step). disable_compile: on device "tpu" transformers would otherwise compile the
# decode step (which torchjax runs as compile_generate's programs).
STATIC_EAGER = dict(cache_implementation="static", disable_compile=True)


@pytest.fixture(scope="module")
def tpu(llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu").eval()


def _generate(model, batch=None, **kwargs):
    return generate(model, tl.prompts() if batch is None else batch, **kwargs)


def test_sampling_seeded_is_reproducible(tpu):
    kwargs = dict(
        STATIC_EAGER, do_sample=True, top_k=20, temperature=1.5, max_new_tokens=4, pad_token_id=0
    )
    torch.manual_seed(0)
    first = _generate(tpu, **kwargs)
    torch.manual_seed(0)
    second = _generate(tpu, **kwargs)
    torch.manual_seed(1)
    other = _generate(tpu, **kwargs)
    assert torch.equal(first, second)
    new = first[:, tl.prompts()["input_ids"].shape[1] :]
    assert new.shape == (2, 4) and bool(
        ((new >= 0) & (new < tl.tiny_llama_config().vocab_size)).all()
    )
    # 8 tokens drawn from top-20 at temperature 1.5: equal by chance with tiny probability.
    assert not torch.equal(first, other)


def test_beam_search_matches_cpu(cpu, tpu):
    kwargs = dict(GREEDY, num_beams=3, max_new_tokens=2)
    assert torch.equal(_generate(tpu, **kwargs, **STATIC_EAGER), _generate(cpu, **kwargs))


def test_dynamic_and_static_cache_eager_match_cpu(cpu, tpu):
    expected = _generate(cpu, **GREEDY, max_new_tokens=4)
    assert torch.equal(_generate(tpu, **GREEDY, max_new_tokens=4), expected)
    assert torch.equal(_generate(tpu, **GREEDY, max_new_tokens=4, **STATIC_EAGER), expected)


def test_compile_generate_traces_the_prefill_and_one_decode_step(llama_dir, cpu):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu").eval()
    jitted = compile_generate(model)
    assert model.forward.jitted is jitted
    step, first = model.forward.decode_step, model.forward.first_token
    with pytest.raises(RuntimeError, match="compile_generate called twice"):
        compile_generate(model)
    batch = {"input_ids": tl.prompts()["input_ids"][1:]}
    kwargs = dict(GREEDY, max_new_tokens=16, cache_implementation="static")
    expected = _generate(cpu, batch, **kwargs)
    assert torch.equal(_generate(model, batch, **kwargs), expected)
    # The prefill is the compiled forward; the first token's choice is a program of its
    # own (Note [The step after the prefill]), the 15 steps one loop over the decode step,
    # traced but never run on its own (Note [Decode steps as one program]).
    assert jitted.trace_count == 1
    assert (step.trace_count, step.cache_hits) == (1, 0)
    assert (first.trace_count, first.cache_hits) == (1, 0)
    # A second call reuses the cache (sized for the longest call so far, so a shorter
    # call has the same layout), made before the first prefill (Note [A static cache
    # initialized before its first step]): nothing traces again; the token buffer spans
    # the cache, so the first token's program is a cache hit too (run inside the loop's
    # program: Note [A first call in the loop's program]), and the loop's step is found
    # traced.
    short = dict(kwargs, max_new_tokens=8)
    assert torch.equal(_generate(model, batch, **short), expected[:, :15])
    assert (jitted.trace_count, jitted.cache_hits) == (1, 1)
    assert (step.trace_count, step.cache_hits) == (1, 0)
    assert (first.trace_count, first.cache_hits) == (1, 1)
    # Without a static cache the forward runs eagerly.
    assert torch.equal(_generate(model, batch, **GREEDY, max_new_tokens=1), expected[:, :8])
    assert jitted.trace_count == 1 and step.trace_count == 1
    # Beam search runs transformers' loop around the compiled forward; it reorders the
    # cache after every step (new key/value tensors); still one prefill and one decode
    # trace for the new layout (3 beams). 3 tokens: the second decode step is the first
    # to see a reordered cache it saw before.
    beams = dict(GREEDY, num_beams=3, max_new_tokens=3)
    assert torch.equal(
        _generate(model, batch, cache_implementation="static", **beams),
        _generate(cpu, batch, **beams),
    )
    assert jitted.trace_count == 3 and step.trace_count == 1


def test_torch_compile_backend_tpu_through_compile_config(cpu, tpu, monkeypatch):
    # transformers' own auto-compile of the decode step, with the "tpu" Dynamo backend
    # (with the off switch: otherwise the call runs compile_generate's programs).
    monkeypatch.setenv("TORCHJAX_AUTO_COMPILE_GENERATE", "0")
    config = transformers.CompileConfig(backend="tpu", fullgraph=True, dynamic=False)
    kwargs = dict(GREEDY, max_new_tokens=4, cache_implementation="static")
    before = torchjax.compile.dynamo_stats()
    for _ in range(2):
        assert torch.equal(
            _generate(tpu, compile_config=config, **kwargs), _generate(cpu, **kwargs)
        )
    stats = torchjax.compile.dynamo_stats()
    # One graph, traced once, for both calls' 6 decode steps (the prefill runs eagerly).
    assert stats["graphs"] - before["graphs"] == 1
    assert stats["traces"] - before["traces"] == 1
    assert stats["cache_hits"] - before["cache_hits"] == 5


def test_auto_compile_on_tpu_defaults_to_the_tpu_backend(cpu, tpu, monkeypatch):
    # With no compile_config, transformers compiles a static-cache decode step on a
    # "tpu" model with the "tpu" Dynamo backend (its _default_compile_config), not
    # inductor: torchjax's backend builds the graph (with the off switch: otherwise the
    # call runs compile_generate's programs).
    monkeypatch.setenv("TORCHJAX_AUTO_COMPILE_GENERATE", "0")
    kwargs = dict(GREEDY, max_new_tokens=3, cache_implementation="static")
    # Dynamo's cache is the process's: a Llama compiled the same way by an earlier test
    # in this process (another instance, same shapes) would be reused, no graph built.
    torch._dynamo.reset()
    before = torchjax.compile.dynamo_stats()
    assert torch.equal(_generate(tpu, **kwargs), _generate(cpu, **kwargs))
    assert tpu._last_compile_config.backend == "tpu"
    assert torchjax.compile.dynamo_stats()["graphs"] - before["graphs"] >= 1


def test_bfloat16_load_logits_and_greedy_tokens(llama_dir):
    cpu16 = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16)
    tpu16 = transformers.AutoModelForCausalLM.from_pretrained(
        llama_dir, dtype=torch.bfloat16, device_map="tpu"
    )
    assert {(p.device.type, p.dtype) for p in tpu16.parameters()} == {("tpu", torch.bfloat16)}
    batch = tl.prompts()
    with torch.no_grad():
        cpu_logits = cpu16.eval()(**batch).logits
        tpu_logits = tpu16.eval()(**{k: v.to("tpu") for k, v in batch.items()}).logits.cpu()
    assert tpu_logits.dtype == torch.bfloat16
    # bfloat16 tolerance: a few units in the last place at the logits' magnitude (~5).
    torch.testing.assert_close(tpu_logits.float(), cpu_logits.float(), rtol=0, atol=0.1)
    # One new token (the prefill's argmax): bfloat16 runs op by op, each new shape costs.
    kwargs = dict(GREEDY, max_new_tokens=1)
    assert torch.equal(_generate(tpu16, **kwargs, **STATIC_EAGER), _generate(cpu16, **kwargs))
    # Compiled: the decode program and its loop in bfloat16, 12 tokens as on CPU (the
    # tiny model's argmaxes are decisive enough for bfloat16's rounding here).
    compile_generate(tpu16)
    kwargs = dict(GREEDY, max_new_tokens=12, cache_implementation="static")
    assert torch.equal(_generate(tpu16, **kwargs), _generate(cpu16, **kwargs))
    assert tpu16.forward.decode_step.trace_count == 1
    assert tpu16.forward.first_token.trace_count == 1
