"""transformers' auto-compiled generate on "tpu" runs torchjax's decode programs
(torchjax/integrations/transformers/_auto_compile.py): a static-cache ``generate`` with no
``compile_generate`` call, and one that asks for no cache, against CPU; the calls
transformers would not compile run as written.

The tiny Llama of examples/tiny_llama_generate.py and its left-padded batch of two
prompts, compared with the same checkpoint on CPU.
"""

import functools
import os
import threading

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

import torchjax  # noqa: E402
from examples import tiny_llama_generate as tl  # noqa: E402
from tests._models import KERNEL_IDS, tiny_llama  # noqa: E402
from tests.integrations import tiny_models  # noqa: E402
from tests.integrations.tiny_models import generate  # noqa: E402
from torchjax import pallas as tp  # noqa: E402
from torchjax.integrations.transformers import compile_generate  # noqa: E402
from torchjax.ops import executables  # noqa: E402
from torchjax.pallas import _decode_sdpa, _sdpa_math  # noqa: E402

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
STATIC = dict(GREEDY, cache_implementation="static")


def _load(llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu").eval()


@pytest.fixture(scope="module")
def auto(llama_dir):
    """A tpu model that only ever had transformers' generate called on it."""
    return _load(llama_dir)


def _generate(model, **kwargs):
    return generate(model, tl.prompts(), **kwargs)


def _decode_calls(model) -> int:
    """Calls of the decode programs: the first token's and the decode step's."""
    forward = vars(model)["forward"]
    programs = (forward.first_token, forward.decode_step)
    return sum(p.trace_count + p.cache_hits for p in programs)


@pytest.mark.parametrize(
    "setting",
    [{}, {"compile_config": transformers.CompileConfig(backend="tpu", dynamic=False)}],
    ids=["default", "compile_config"],
)
def test_static_generate_runs_the_decode_programs(cpu, llama_dir, setting):
    model = _load(llama_dir)
    kwargs = dict(STATIC, max_new_tokens=8, **setting)
    assert torch.equal(_generate(model, **kwargs), _generate(cpu, **kwargs))
    assert "forward" in vars(model) and model.forward.last_fallback is None
    assert _decode_calls(model) > 0
    # Where transformers keeps its compiled call (its own tests check that generate
    # compiled by looking for it): the compiled forward.
    assert model._compiled_call == model.__call__
    # The same per-call work whatever the number of tokens: the decode loop is one
    # program, the rest is setup, compiled by the calls before (a longer cache is a new
    # layout, whose prefill traces again on its first reuse).
    for _ in range(2):
        _generate(model, **dict(kwargs, max_new_tokens=40))
    counts = {}
    for n in (8, 40):
        torchjax.reset_stats()
        out = _generate(model, **dict(kwargs, max_new_tokens=n))
        assert torch.equal(out, _generate(cpu, **dict(kwargs, max_new_tokens=n)))
        stats = torchjax.stats()
        counts[n] = (stats["executions"], stats["compiles"])
    assert counts[8][0] == counts[40][0] and counts[40][1] == 0


def test_calls_transformers_would_not_compile_run_as_written(cpu, auto):
    kwargs = dict(GREEDY, max_new_tokens=4)
    eager = transformers.CompileConfig(backend="eager")
    settings = (
        {"disable_compile": True},  # eager, with a static cache (tested below)
        {"use_cache": False},
        {"cache_implementation": "dynamic"},
        {"cache_implementation": "static", "disable_compile": True},
        {"cache_implementation": "static", "compile_config": eager},
    )
    for setting in settings:
        assert torch.equal(_generate(auto, **kwargs, **setting), _generate(cpu, **kwargs))
        assert "forward" not in vars(auto), setting  # nothing was applied
    # Once compiled, the same calls still run transformers' generate as written: no
    # decode program, the forward eager.
    _generate(auto, **STATIC, max_new_tokens=4)
    calls, jitted = _decode_calls(auto), auto.forward.jitted
    runs = jitted.trace_count + jitted.cache_hits
    for setting in settings:
        assert torch.equal(_generate(auto, **kwargs, **setting), _generate(cpu, **kwargs))
        assert auto.forward.last_fallback == "not auto-compiled"
    assert _decode_calls(auto) == calls
    assert jitted.trace_count + jitted.cache_hits == runs
    # The "eager" backend's call compiled with transformers' own get_compiled_call.
    assert type(auto._compiled_call).__name__ != "method"


def test_no_cache_asked_for_gets_a_static_cache(cpu, llama_dir):
    model = _load(llama_dir)
    kwargs = dict(GREEDY, max_new_tokens=64)
    torchjax.reset_stats()
    assert torch.equal(_generate(model, **kwargs), _generate(cpu, **kwargs))
    # The decode programs ran: a first generate of 64 tokens compiles a few dozen
    # programs (the eager engine with a DynamicCache compiled several hundred).
    assert model.forward.last_fallback is None and _decode_calls(model) > 0
    assert torchjax.stats()["compiles"] <= 100
    # Where the cache would reach the caller, transformers' DynamicCache is kept.
    batch = {k: v.to("tpu") for k, v in tl.prompts().items()}
    with torch.no_grad():
        out = model.generate(
            **batch, **dict(kwargs, max_new_tokens=3), return_dict_in_generate=True
        )
    assert type(out.past_key_values) is transformers.DynamicCache
    assert model.forward.last_fallback == "not auto-compiled"
    assert torch.equal(out.sequences.cpu(), _generate(cpu, **dict(kwargs, max_new_tokens=3)))


def _sdpa_traces() -> int:
    return (
        torchjax.stats()["ops"]
        .get("aten::scaled_dot_product_attention.default", {})
        .get("traces", 0)
    )


def test_eager_generate_asking_for_no_cache_gets_a_static_cache(cpu, llama_dir, monkeypatch):
    # Note [A static cache for eager generate on tpu]: the forward's shapes stay the same
    # from step to step, so a 16-token eager generate traces attention for the prefill
    # and one decode shape, not once per token.
    model = _load(llama_dir)
    kwargs = dict(GREEDY, max_new_tokens=16, disable_compile=True)
    made = []
    original = transformers.StaticCache.__init__

    def init(self, *args, **kw):
        made.append(self)
        original(self, *args, **kw)

    monkeypatch.setattr(transformers.StaticCache, "__init__", init)
    torchjax.reset_stats()
    assert torch.equal(_generate(model, **kwargs), _generate(cpu, **kwargs))
    assert "forward" not in vars(model) and len(made) == 1  # eager, with a static cache
    assert _sdpa_traces() <= 2
    # Where the cache reaches the caller, transformers' DynamicCache is kept.
    batch = {k: v.to("tpu") for k, v in tl.prompts().items()}
    with torch.no_grad():
        out = model.generate(
            **batch, **dict(kwargs, max_new_tokens=3), return_dict_in_generate=True
        )
    assert type(out.past_key_values) is transformers.DynamicCache and len(made) == 1
    assert torch.equal(out.sequences.cpu(), _generate(cpu, **dict(kwargs, max_new_tokens=3)))
    # So is it with the rules off.
    monkeypatch.setenv("TORCHJAX_AUTO_COMPILE_GENERATE", "0")
    assert torch.equal(_generate(model, **kwargs), _generate(cpu, **kwargs))
    assert len(made) == 1


def test_eager_generates_static_cache_takes_the_decode_kernel(monkeypatch):
    # Note [A static cache for eager generate on tpu]: transformers sizes the cache 47
    # (32-token prompt, 16 new), which the decode kernel refuses; the automatic cache is
    # made 48 long, so with the attention a TPU chooses (forced here) every decode step
    # takes the kernel, not SDPA's math path. The extra position is masked: the tokens
    # are CPU's and those of transformers' own 47-long static cache.
    executables.clear_caches()  # the spies see traces: none left from earlier tests
    traced = []
    for module, name in ((_decode_sdpa, "_decode_attention"), (_sdpa_math, "exact_attention")):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, functools.partial(_spied, traced, name, fn))
    kwargs = dict(max_new_tokens=16, do_sample=False, disable_compile=True)
    want = tiny_llama(hidden_size=64).generate(KERNEL_IDS, **kwargs)
    model = tiny_llama(hidden_size=64).to("tpu")
    with tp.use_flash_attention(True), tp.use_math_attention("exact"), torch.no_grad():
        got = model.generate(KERNEL_IDS.to("tpu"), **kwargs).cpu()
        assert traced == ["_decode_attention"]
        asked = model.generate(KERNEL_IDS.to("tpu"), cache_implementation="static", **kwargs)
    assert "exact_attention" in traced  # transformers' own cache: the math path
    assert model._previous_max_cache_length == 47  # transformers' record, unrounded
    assert want.shape == (1, 48) and torch.equal(got, want) and torch.equal(asked.cpu(), want)


def _spied(seen: list, name: str, fn, *args, **kwargs):
    seen.append(name)
    return fn(*args, **kwargs)


def test_off_switch_keeps_transformers_loop(cpu, llama_dir, monkeypatch):
    monkeypatch.setenv("TORCHJAX_AUTO_COMPILE_GENERATE", "0")
    model = _load(llama_dir)
    before = torchjax.compile.dynamo_stats()
    kwargs = dict(STATIC, max_new_tokens=3)
    assert torch.equal(_generate(model, **kwargs), _generate(cpu, **kwargs))
    assert "forward" not in vars(model)
    # transformers compiled its decode step with the "tpu" Dynamo backend instead.
    assert torchjax.compile.dynamo_stats()["graphs"] - before["graphs"] >= 1
    # No cache asked for: transformers' DynamicCache, eager.
    kwargs = dict(GREEDY, max_new_tokens=3)
    assert torch.equal(_generate(model, **kwargs), _generate(cpu, **kwargs))
    assert "forward" not in vars(model)


def test_a_compiled_model_moved_off_tpu_generates_as_cpu(cpu, llama_dir):
    model = _load(llama_dir)
    kwargs = dict(STATIC, max_new_tokens=5)
    expected = _generate(cpu, **kwargs)
    assert torch.equal(_generate(model, **kwargs), expected)
    model.to("cpu")
    calls = _decode_calls(model)
    assert torch.equal(_generate(model, **kwargs), expected)
    assert _decode_calls(model) == calls
    assert model.forward.last_fallback == "the model is off tpu"


def test_compile_generate_after_auto_compile_keeps_its_programs(cpu, llama_dir):
    model = _load(llama_dir)
    kwargs = dict(STATIC, max_new_tokens=4)
    _generate(model, **kwargs)
    jitted = model.forward.jitted
    assert compile_generate(model, loop=False) is jitted
    assert model.forward.rule is None and model.forward.loop is False
    # Compiled for good: a disable_compile call now runs the decode programs too.
    calls = _decode_calls(model)
    out = _generate(model, **kwargs, disable_compile=True)
    assert torch.equal(out, _generate(cpu, **kwargs)) and _decode_calls(model) > calls
    with pytest.raises(RuntimeError, match="already replaced"):
        compile_generate(model)


def test_the_patch_is_recorded():
    names = [p.name for p in torchjax.patches()]
    assert "transformers GenerationMixin.generate" in names
    assert transformers.GenerationMixin.generate.__wrapped__ is not None


def test_many_calls_with_a_one_token_prompt_and_beams(cpu, llama_dir):
    # The cache is reused (reset) between calls; its length is re-read after anything
    # but the compiled step wrote it, so a call never counts the previous call's tokens.
    model = _load(llama_dir)
    ids = torch.tensor([[5]])
    for kwargs in (dict(GREEDY, max_new_tokens=6), dict(GREEDY, max_new_tokens=4, num_beams=2)):
        want = generate(cpu, {"input_ids": ids}, **kwargs)
        for _ in range(8):
            assert torch.equal(generate(model, {"input_ids": ids}, **kwargs), want), kwargs


def test_threads_generating_with_one_model_get_their_own_tokens(cpu, llama_dir):
    model = _load(llama_dir)
    want = {n: _generate(cpu, **GREEDY, max_new_tokens=n) for n in (3, 7)}
    _generate(model, **GREEDY, max_new_tokens=7)  # compiled before the threads start
    results = []

    def run(start):
        for i in range(start, start + 6):
            n = (3, 7)[i % 2]
            results.append(torch.equal(_generate(model, **GREEDY, max_new_tokens=n), want[n]))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Without the model's lock, the threads' steps interleave on the one static cache:
    # wrong tokens, or an IndexError, in most runs.
    assert results == [True] * 18


def test_a_new_dtype_gets_a_new_cache(llama_dir):
    model = _load(llama_dir)
    kwargs = dict(GREEDY, max_new_tokens=4)
    _generate(model, **kwargs)
    model.to(torch.bfloat16)
    got = _generate(model, **kwargs)
    want = _generate(model, **kwargs, cache_implementation="static", disable_compile=True)
    assert torch.equal(got, want)


def test_a_generation_config_passed_second_is_honoured(cpu, llama_dir):
    model = _load(llama_dir)
    batch = {k: v.to("tpu") for k, v in tl.prompts().items()}
    ids, mask = batch["input_ids"], batch["attention_mask"]
    config = transformers.GenerationConfig(**GREEDY, max_new_tokens=4)
    with torch.no_grad():
        out = model.generate(ids, config, attention_mask=mask)  # compiles the model
        assert model.forward.last_fallback is None
        assert torch.equal(out.cpu(), _generate(cpu, **GREEDY, max_new_tokens=4))
        returned = transformers.GenerationConfig(
            **GREEDY, max_new_tokens=3, return_dict_in_generate=True
        )
        out = model.generate(ids, returned, attention_mask=mask)
        assert type(out.past_key_values) is transformers.DynamicCache
        eager = transformers.GenerationConfig(**GREEDY, max_new_tokens=3, disable_compile=True)
        model.generate(ids, eager, attention_mask=mask)
        assert model.forward.last_fallback == "not auto-compiled"
    assert config.cache_implementation is None  # the caller's config is not changed


def test_input_ids_on_cpu_and_ids_out_of_range(cpu, llama_dir):
    model = _load(llama_dir)
    kwargs = dict(GREEDY, max_new_tokens=4)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        out = model.generate(ids, **kwargs)  # on CPU: moved before each forward
        assert torch.equal(out.cpu(), cpu.generate(ids, **kwargs))
        assert model.forward.last_fallback.startswith("input ids on cpu")
        rows = cpu.get_input_embeddings().num_embeddings
        for bad in (rows, -3):
            with pytest.raises(IndexError, match=f"token id {bad} is out of range"):
                model.generate(torch.tensor([[5, bad, 7]], device="tpu"), **kwargs)
        # The model still generates afterwards.
        assert torch.equal(model.generate(ids.to("tpu"), **kwargs).cpu(), out.cpu())


def test_compile_generate_gives_calls_without_a_cache_a_static_one(cpu, llama_dir):
    model = _load(llama_dir)
    compile_generate(model)
    kwargs = dict(GREEDY, max_new_tokens=5)
    assert torch.equal(_generate(model, **kwargs), _generate(cpu, **kwargs))
    assert model.forward.last_fallback is None and _decode_calls(model) > 0


def test_positions_past_a_learned_position_table_raise_as_on_cpu(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=128, n_embd=32, n_layer=1, n_head=2, n_positions=12, eos_token_id=None
    )
    cpu = transformers.GPT2LMHeadModel(config).eval()
    cpu.save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="tpu")
    ids = torch.randint(3, 100, (1, 7))
    for prompt, n in ((ids, 10), (torch.randint(3, 100, (1, 14)), 2)):
        with pytest.raises(IndexError, match="index out of range"):
            generate(cpu, {"input_ids": prompt}, **GREEDY, max_new_tokens=n)
        with pytest.raises(IndexError, match="out of range for the learned position"):
            generate(model, {"input_ids": prompt}, **GREEDY, max_new_tokens=n)
    # Within the table: the decode programs, tokens as CPU.
    want = generate(cpu, {"input_ids": ids}, **GREEDY, max_new_tokens=5)
    assert torch.equal(generate(model, {"input_ids": ids}, **GREEDY, max_new_tokens=5), want)
    assert model.forward.last_fallback is None


def test_generate_in_and_out_of_inference_mode(cpu, llama_dir):
    # The kept static cache and programs serve calls made in either grad mode.
    kwargs = dict(GREEDY, max_new_tokens=4)
    want = _generate(cpu, **kwargs)
    batch = {k: v.to("tpu") for k, v in tl.prompts().items()}
    for modes in (
        ("no_grad", "inference", "inference", "no_grad", "inference"),
        ("inference", "no_grad", "no_grad", "inference"),  # a cache made in inference mode
    ):
        model = _load(llama_dir)
        for mode in modes:
            context = torch.inference_mode() if mode == "inference" else torch.no_grad()
            with context:
                assert torch.equal(model.generate(**batch, **kwargs).cpu(), want), modes


def test_one_new_token_with_a_mask_matches_cpu(cpu, auto):
    # The prefill's logits give the only token; the mask, grown by one past a cache sized
    # for max_length - 1, was widened by a negative count and crashed.
    for n in (1, 2):
        want = _generate(cpu, max_new_tokens=n, **GREEDY)
        assert torch.equal(_generate(auto, max_new_tokens=n, **GREEDY), want), n


def _where_experts(self, hidden_states, top_k_index, top_k_weights):
    # A user's experts function as written for eager CUDA: value-dependent shapes.
    out = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        token, slot = torch.where(top_k_index == e)
        if token.numel() == 0:
            continue
        gate, up = torch.nn.functional.linear(hidden_states[token], self.gate_up_proj[e]).chunk(
            2, dim=-1
        )
        y = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
        out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
    return out


def test_an_untraceable_model_generates_eagerly_with_one_warning():
    # Note [Auto-compiled generate that cannot be traced]: plain generate compiled on its
    # own and raised DataDependentError for code that runs eagerly.
    import warnings

    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register("test_where_experts", _where_experts)
    cfg = tiny_models.ARCHITECTURES["qwen3_moe"][1]()
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    model.set_experts_implementation("test_where_experts")
    batch = {"input_ids": torch.randint(0, 128, (1, 6))}
    want = generate(model, batch, max_new_tokens=4, do_sample=False)
    model.to("tpu")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = generate(model, batch, max_new_tokens=4, do_sample=False)
        second = generate(model, batch, max_new_tokens=4, do_sample=False)
    told = [str(w.message) for w in seen if "generate compiles on tpu by itself" in str(w.message)]
    assert len(told) == 1, told
    assert "aten::nonzero" in told[0] and "disable_compile=True" in told[0]
    assert "TORCHJAX_AUTO_COMPILE_GENERATE=0" in told[0]
    assert torch.equal(first, want) and torch.equal(second, want)
    assert model.forward.last_fallback == "its trace failed"

    # Compiled on purpose: the refusal is the user's to see.
    fresh = transformers.Qwen3MoeForCausalLM(cfg).eval().to("tpu")
    fresh.set_experts_implementation("test_where_experts")
    compile_generate(fresh)
    with pytest.raises(torchjax.DataDependentError, match="aten::nonzero"):
        generate(fresh, batch, max_new_tokens=4, do_sample=False)
