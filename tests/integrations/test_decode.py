"""compile_generate's decode programs (torchjax/integrations/transformers/_decode.py):
greedy and sampled tokens vs CPU, the processors run inside the program, one program
per token or one loop for all, and the calls that fall back to transformers' own loop.

The tiny Llama of examples/tiny_llama_generate.py and its left-padded batch of two
prompts, compared with the same checkpoint on CPU.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

import torchjax  # noqa: E402
from examples import tiny_llama_generate as tl  # noqa: E402
from tests._programs import lowered, scatters  # noqa: E402
from tests.integrations.tiny_models import generate  # noqa: E402
from torchjax.integrations.transformers import compile_generate  # noqa: E402

STATIC = dict(cache_implementation="static", pad_token_id=0)


@pytest.fixture(scope="module")
def compiled(llama_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu")
    compile_generate(model.eval(), warn_after=32)  # one program pair per setting tried
    return model


def _generate(model, batch=None, **kwargs):
    return generate(model, tl.prompts() if batch is None else batch, **kwargs)


def _new(tokens):
    return tokens[:, tl.prompts()["input_ids"].shape[1] :]


@pytest.fixture(params=[True, False], ids=["loop", "per-token"])
def loop(request, compiled):
    """Both decode modes of the one compiled model (compile_generate's ``loop``)."""
    compiled.forward.loop = request.param
    yield request.param
    compiled.forward.loop = True


def _calls(model) -> int:
    """Calls of the decode programs: the first token's and the decode step's."""
    programs = (model.forward.first_token, model.forward.decode_step)
    return sum(p.trace_count + p.cache_hits for p in programs)


def test_greedy_with_eos_and_processors_matches_cpu(cpu, compiled, loop):
    plain = _generate(cpu, **STATIC, do_sample=False, eos_token_id=None, max_new_tokens=24)
    # An EOS that the first row emits at its third new token: that row then pads while
    # the other runs on, as on CPU.
    eos = int(_new(plain)[0, 2])
    runs = [
        dict(eos_token_id=eos, max_new_tokens=24),
        # Both rows finish early, before the first host check of the finish length (every
        # 16 tokens): the steps run past it are cut off.
        dict(eos_token_id=[eos, int(_new(plain)[1, 1])], max_new_tokens=24),
        dict(eos_token_id=eos, max_new_tokens=24, repetition_penalty=1.5),
        dict(eos_token_id=eos, max_new_tokens=12, min_new_tokens=6),
        dict(eos_token_id=eos, max_new_tokens=12, min_length=12),
    ]
    for kwargs in runs:
        kwargs = dict(STATIC, do_sample=False, **kwargs)
        before = _calls(compiled)
        expected = _generate(cpu, **kwargs)
        assert torch.equal(_generate(compiled, **kwargs), expected), kwargs
        assert _calls(compiled) > before  # the decode programs ran
    assert _generate(cpu, **STATIC, eos_token_id=eos, max_new_tokens=24).shape[1] < plain.shape[1]


def test_the_decode_step_writes_the_cache_and_the_token_without_a_scatter(llama_dir, cpu):
    # Each decode step writes one position of every layer's keys and values (transformers'
    # ``index_copy_`` at the traced cache position) and the chosen token into the buffer:
    # each a dynamic-update-slice (Note [Index writes at a run of positions]). As
    # scatters they were three in the step's program (one per write shape). Greedy tokens
    # as CPU's.
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu")
    compile_generate(model.eval())
    kwargs = dict(STATIC, do_sample=False, eos_token_id=None, max_new_tokens=8)
    assert torch.equal(_generate(model, **kwargs), _generate(cpu, **kwargs))
    (step,) = lowered(model.forward.decode_step)
    assert "dynamic_update_slice" in step and scatters(step) == 0


@pytest.mark.parametrize("n", [1, 2, 30])
def test_repeated_ngrams_are_barred_in_the_decode_program(cpu, compiled, loop, n):
    # Note [Repeated n-grams barred on the device]: the tokens equal transformers' own
    # loop on CPU, with and without repetition penalty, and the decode program runs (no
    # fallback). For n = 1 and 2 the rule changes the tokens (the tiny model repeats
    # itself without it); n = 30 is longer than the whole sequence and bars nothing.
    base = dict(STATIC, do_sample=False, eos_token_id=None, max_new_tokens=24)
    changed = not torch.equal(
        _generate(cpu, **base), _generate(cpu, **base, no_repeat_ngram_size=n)
    )
    assert changed == (n < 30)
    for extra in (dict(), dict(repetition_penalty=1.3)):
        kwargs = dict(base, no_repeat_ngram_size=n, **extra)
        before = _calls(compiled)
        assert torch.equal(_generate(compiled, **kwargs), _generate(cpu, **kwargs)), kwargs
        assert compiled.forward.last_fallback is None
        assert _calls(compiled) > before


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_the_ngram_rule_bars_what_transformers_bars(n):
    # The rule against transformers' processor on CPU, over buffers from a small
    # vocabulary (many repeated n-grams), at every position, including those with fewer
    # than n - 1 ids before it. The buffer past ``pos`` holds other ids (the decode
    # buffer holds the vocabulary size there; the rule must not depend on it). Scores
    # equal, -inf included.
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    from torchjax.integrations.transformers._decode import _bar_repeated_ngrams

    gen = torch.Generator().manual_seed(n)
    vocab, size = 5, 14
    ids = torch.randint(0, 3, (3, size), generator=gen)
    scores = torch.randn(3, vocab, generator=gen)
    barred = 0
    for pos in range(size):
        want = NoRepeatNGramLogitsProcessor(n)(ids[:, :pos], scores.clone())
        buffer = torch.cat([ids[:, :pos], ids[:, pos:].flip(1)], dim=1)
        got = _bar_repeated_ngrams(
            buffer.to("tpu"), torch.tensor(pos, device="tpu"), n, scores.to("tpu")
        )
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
        barred += int(want.isinf().sum())
    assert barred > 0


def test_one_program_per_token_or_one_loop(cpu, compiled, loop):
    step = compiled.forward.decode_step
    kwargs = dict(STATIC, do_sample=False, eos_token_id=None, max_new_tokens=40)
    for _ in range(2):  # a new cache layout; the prefill traces again on its reuse
        _generate(compiled, **kwargs)
    counts = {}
    for n in (8, 40):
        torchjax.reset_stats()
        hits = step.cache_hits + compiled.forward.first_token.cache_hits
        out = _generate(compiled, **dict(kwargs, max_new_tokens=n))
        assert torch.equal(out, _generate(cpu, **dict(kwargs, max_new_tokens=n)))
        stats = torchjax.stats()
        # Per token: each token one call of one program (the first token's, then the
        # step's). Loop: the first token's program, every step inside one loop program
        # (the step itself never runs on its own, so its forward compiles once).
        calls = step.cache_hits + compiled.forward.first_token.cache_hits - hits
        assert calls == (1 if loop else n)
        counts[n] = (stats["executions"], stats["compiles"], stats["host_reads"])
    # The eager ops around the programs (setting up the buffers, cutting the result to
    # its length: a new length compiles that slice) do not grow with the number of
    # tokens. Per token, the host reads the finish length every 16 tokens, each read a
    # synchronisation point that first reads the steps' pending device checks (the
    # embedding's index range: Note [Device checks of compiled programs]); the loop
    # reads the length once.
    assert counts[8][0] == counts[40][0] and counts[40][1] == 0
    assert counts[40][2] - counts[8][2] == (0 if loop else 4)


def test_a_warm_generate_runs_no_eager_device_program_and_reads_once(cpu, compiled):
    # What a warm call does on the host besides its programs, for an unpadded prompt:
    # transformers' setup ops run on the host values of the ids, the mask, the special
    # tokens and the reset cache's lengths (Note [A reset cache's length known on the
    # host] in _cache_state.py), so no eager op runs on the device and nothing is read
    # before the loop; after it, one read of the finish length (with the programs'
    # pending device checks), then the result's .cpu(). Before: 3 eager device programs
    # and 7 reads.
    one = {k: v[1:] for k, v in tl.prompts().items()}
    kwargs = dict(STATIC, do_sample=False, eos_token_id=2, max_new_tokens=12)
    for _ in range(2):
        _generate(compiled, one, **kwargs)
    torchjax.reset_stats()
    got = _generate(compiled, one, **kwargs)
    stats = torchjax.stats()
    assert compiled.forward.last_fallback is None
    assert stats["executions"] == 0 and stats["compiles"] == 0
    assert stats["host_reads"] <= 3
    assert stats["host_ops"] > 0  # the setup ran, on the host
    assert torch.equal(got, _generate(cpu, one, **kwargs))


def test_sampling_is_seeded_and_draws_from_the_filtered_distribution(cpu, compiled, loop):
    kwargs = dict(STATIC, do_sample=True, top_k=4, top_p=0.9, temperature=0.8, max_new_tokens=12)
    torch.manual_seed(0)
    first = _generate(compiled, **kwargs)
    for _ in range(2):  # a call that traces the prefill again, then one that does not
        torch.manual_seed(0)
        assert torch.equal(_generate(compiled, **kwargs), first)
    torch.manual_seed(1)
    assert not torch.equal(_generate(compiled, **kwargs), first)  # 24 draws
    # Every drawn token is among CPU's top 4 for the prefix it was drawn after.
    mask = torch.cat([tl.prompts()["attention_mask"], torch.ones_like(_new(first))], dim=1)
    with torch.no_grad():
        logits = cpu(input_ids=first, attention_mask=mask).logits
    start = tl.prompts()["input_ids"].shape[1]
    top = logits[:, start - 1 : -1].topk(4, dim=-1).indices
    # A row that drew its EOS pads after it: those positions were not drawn.
    eos = _new(first) == tl.tiny_llama_config().eos_token_id
    padded = (eos.long().cumsum(-1) - eos.long()) > 0
    assert bool(((top == _new(first)[..., None]).any(-1) | padded).all())
    # The draws differ from step to step (each step draws its own keys).
    assert len(set(_new(first)[0].tolist())) > 1


def test_sampled_tokens_and_rng_state_are_eager_ones(llama_dir, compiled, loop, monkeypatch):
    # Note [Compiled draws are eager's draws] in torchjax/tensor/random.py: the decode
    # programs draw the keys transformers' eager loop draws on tpu, and leave its state.
    eager = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu")
    kwargs = dict(STATIC, do_sample=True, top_k=4, top_p=0.9, temperature=0.8, max_new_tokens=12)
    got = []
    for model in (eager.eval(), compiled):
        with monkeypatch.context() as env:
            if model is eager:  # transformers' own loop, op by op
                env.setenv("TORCHJAX_AUTO_COMPILE_GENERATE", "0")
            torch.manual_seed(0)
            got.append((_generate(model, **kwargs), torch.tpu.get_rng_state()))
    assert torch.equal(got[1][0], got[0][0])
    assert torch.equal(got[1][1], got[0][1])


def test_other_calls_run_transformers_loop(cpu, compiled):
    base = dict(STATIC, do_sample=False, eos_token_id=None, max_new_tokens=4)
    calls = _calls(compiled)
    streamer = transformers.generation.streamers.BaseStreamer()
    streamer.put = streamer.end = lambda *a: None
    for kwargs, why in (
        (
            dict(encoder_no_repeat_ngram_size=2),
            "logits processor EncoderNoRepeatNGramLogitsProcessor",
        ),
        (dict(streamer=streamer), None),  # generate runs as written: no custom_generate
        (dict(num_beams=2), "generation mode beam_search"),
    ):
        compiled.forward.last_fallback = "not reached"
        assert torch.equal(_generate(compiled, **base, **kwargs), _generate(cpu, **base, **kwargs))
        assert compiled.forward.last_fallback == (why or "not reached"), kwargs
    # Assisted decoding needs generate's candidate generator: generate runs as written
    # (one unpadded prompt: it takes batch size 1).
    one = {"input_ids": tl.prompts()["input_ids"][1:]}
    compiled.forward.last_fallback = "not reached"
    lookup = dict(base, prompt_lookup_num_tokens=2)
    assert torch.equal(_generate(compiled, one, **lookup), _generate(cpu, one, **lookup))
    assert compiled.forward.last_fallback == "not reached"
    batch = {k: v.to("tpu") for k, v in tl.prompts().items()}
    with torch.no_grad():
        out = compiled.generate(**batch, **base, return_dict_in_generate=True)
    assert torch.equal(out.sequences.cpu(), _generate(cpu, **base))
    assert compiled.forward.last_fallback == "return_dict_in_generate"
    assert _calls(compiled) == calls  # none reached the decode programs


def test_decode_steps_run_the_pallas_decode_kernel_when_kernels_are_on(cpu, llama_dir, monkeypatch):
    # With the Pallas kernels forced on (the TPU/GPU default; interpret mode here), the
    # attention over the static cache of 16 positions goes to the decode kernel (Note
    # [SDPA dispatch rule]) in both layers of the prefill (7 queries, keys repeated to
    # the 4 query heads) and of the decode step (transformers packs each kv head's 2
    # query heads as 2 query rows, with a (B, 1, 1, 16) mask). The tokens equal CPU's
    # and those of the same model compiled with the kernels off (the jnp path).
    from torchjax.pallas import _sdpa

    calls, decode = [], _sdpa.decode_sdpa
    monkeypatch.setattr(
        _sdpa, "decode_sdpa", lambda *a, **kw: calls.append(tuple(a[1].shape)) or decode(*a, **kw)
    )
    kwargs = dict(STATIC, do_sample=False, eos_token_id=None, max_new_tokens=10)  # cache 16
    tokens, seen = {}, {}
    for kernels in (True, False):
        model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu")
        compile_generate(model.eval())
        with torchjax.pallas.use_flash_attention(kernels):
            tokens[kernels] = _generate(model, **kwargs)
        assert model.forward.last_fallback is None  # the decode program ran
        seen[kernels], calls[:] = list(calls), []
    assert seen[True] == [(2, 4, 16, 16)] * 2 + [(2, 2, 16, 16)] * 2 and seen[False] == []
    assert torch.equal(tokens[True], _generate(cpu, **kwargs))
    assert torch.equal(tokens[True], tokens[False])


def test_a_cache_made_for_generate_is_sized_for_the_kernels(cpu, llama_dir):
    # Note [A static cache sized for the attention kernels]: 12 new tokens after the
    # 7-token prompts, so transformers asks for 18 positions; the cache is made 32 long
    # (the kernels take multiples of 16), the tokens equal CPU's, and transformers' own
    # record keeps 18. A call whose cache reaches the caller (return_dict_in_generate)
    # gets transformers' length.
    from torchjax.pallas._decode_sdpa import kernel_length

    assert [kernel_length(n) for n in (1, 16, 17, 255, 2048, 2049)] == [
        16, 16, 32, 256, 2048, 2176,
    ]  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu")
    compile_generate(model.eval())
    made, prepare = [], model._prepare_static_cache
    model._prepare_static_cache = lambda *a, **kw: made.append(prepare(*a, **kw)) or made[-1]
    kwargs = dict(STATIC, do_sample=False, eos_token_id=None, max_new_tokens=12)
    assert torch.equal(_generate(model, **kwargs), _generate(cpu, **kwargs))
    assert model.forward.last_fallback is None
    assert [layer.max_cache_len for layer in made[0].layers] == [32, 32]
    assert model._previous_max_cache_length == 18
    batch = {k: v.to("tpu") for k, v in tl.prompts().items()}
    with torch.no_grad():
        out = model.generate(**batch, **kwargs, return_dict_in_generate=True)
    assert torch.equal(out.sequences.cpu(), _generate(cpu, **kwargs))
    assert [layer.max_cache_len for layer in made[1].layers] == [18, 18]


def _holds_nothing(cache) -> bool:
    return all(
        int(layer.cumulative_length) == 0
        and not bool(layer.keys.any())
        and not bool(layer.values.any())
        for layer in cache.layers
    )


def test_the_kept_cache_is_zeroed_behind_the_decode_loop(cpu, llama_dir, loop):
    # Note [Work behind the decode loop]: once the decode is dispatched, the kept cache
    # is reset for the next call (Note [A kept cache zeroed behind the decode loop] in
    # _cache_state.py), so the next call's reset has nothing to do; its buffers are still
    # donated, not copied, by the next prefill. A cache the caller passes, or gets back,
    # keeps what the call wrote.
    from transformers import cache_utils as cu

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu")
    compile_generate(model.eval(), loop=loop)
    made, prepare = [], model._prepare_static_cache
    model._prepare_static_cache = lambda *a, **kw: made.append(prepare(*a, **kw)) or made[-1]
    kwargs = dict(STATIC, do_sample=False, eos_token_id=None, max_new_tokens=8)
    expected = _generate(cpu, **kwargs)
    for n in range(3):
        assert torch.equal(_generate(model, **kwargs), expected)
        assert model.forward.last_fallback is None
        assert made[n] is made[0] and _holds_nothing(made[0])
    assert model.forward.jitted.donation_copies == 0
    # Passed in: written by the call, as on CPU, not zeroed after it.
    batch = tl.prompts()
    length = batch["input_ids"].shape[1] + 8 - 1  # the last token is never fed back
    caches = {}
    passed = dict(kwargs)
    del passed["cache_implementation"]
    for m in (cpu, model):
        caches[m] = cu.StaticCache(config=m.config, max_cache_len=32)
        assert torch.equal(_generate(m, **passed, past_key_values=caches[m]), expected)
    assert model.forward.last_fallback is None and len(made) == 3
    for a, b in zip(caches[cpu].layers, caches[model].layers, strict=True):
        assert int(b.cumulative_length) == int(a.cumulative_length) == length
        torch.testing.assert_close(b.keys.cpu(), a.keys, rtol=1e-4, atol=1e-4)
    # Returned (return_dict_in_generate: transformers' loop): kept, as written.
    tpu_batch = {k: v.to("tpu") for k, v in batch.items()}
    with torch.no_grad():
        out = model.generate(**tpu_batch, **kwargs, return_dict_in_generate=True)
    assert torch.equal(out.sequences.cpu(), expected)
    assert int(out.past_key_values.get_seq_length()) == length


def test_the_result_is_a_copy_as_on_cpu(cpu, compiled, loop):
    # The result taken before the finish length is read (Note [Work behind the decode
    # loop]) when every row ran to max_length, cut after the read when they all finished
    # early: CPU's tokens, shape and strides either way, and memory of its own.
    plain = _generate(cpu, **STATIC, do_sample=False, eos_token_id=None, max_new_tokens=24)
    early = [int(_new(plain)[0, 2]), int(_new(plain)[1, 1])]  # both rows stop early
    batch = {k: v.to("tpu") for k, v in tl.prompts().items()}
    checked = 0
    for eos in (None, early):
        kwargs = dict(STATIC, do_sample=False, eos_token_id=eos, max_new_tokens=24)
        expected = _generate(cpu, **kwargs)
        with torch.no_grad():
            first = compiled.generate(**batch, **kwargs)
            second = compiled.generate(**batch, **kwargs)
        assert compiled.forward.last_fallback is None
        for got in (first, second):
            assert torch.equal(got.cpu(), expected)
            assert got.stride() == expected.stride() and got.storage_offset() == 0
        first.fill_(-1)  # its own memory
        assert torch.equal(second.cpu(), expected)
        checked += 1
    assert checked == 2 and early[0] != early[1]


def test_the_model_is_walked_once_per_generate(cpu, llama_dir, monkeypatch):
    # Note [A module walked once within a block] in torchjax/compile/_state.py: a warm
    # generate walks the model's modules for the prefill's call and the decode loop's
    # call takes that walk; with a forward hook on the model (code between the two
    # calls: here one that replaces the head's weight after the prefill, on CPU too) the
    # loop walks the model again and runs with the new weight, as CPU does.
    from torchjax.compile import _state

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu")
    compile_generate(model.eval())
    kwargs = dict(STATIC, do_sample=False, eos_token_id=None, max_new_tokens=8)
    expected = _generate(cpu, **kwargs)
    for _ in range(2):
        assert torch.equal(_generate(model, **kwargs), expected)
    walked, walk = [], _state.StateWalk._add_module
    monkeypatch.setattr(
        _state.StateWalk, "_add_module", lambda w, m: walked.append(m) or walk(w, m)
    )
    assert torch.equal(_generate(model, **kwargs), expected)
    assert model.forward.last_fallback is None
    assert walked == [model]

    def negate_head_once(module, args, out):
        if not getattr(module, "negated", False):
            module.negated = True
            module.lm_head.weight = torch.nn.Parameter(-module.lm_head.weight.detach())

    got = {}
    own_cpu = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()  # changed
    for m in (own_cpu, model):
        handle = m.register_forward_hook(negate_head_once)
        try:
            got[m] = _generate(m, **kwargs)
        finally:
            handle.remove()
    assert model.forward.last_fallback is None
    assert torch.equal(got[model], got[own_cpu]) and not torch.equal(got[own_cpu], expected)


def test_a_warm_generate_is_two_program_calls(cpu, compiled, monkeypatch):
    # Note [The step after the prefill]: on a warm call the first token's bookkeeping runs
    # inside the decode loop's program (Note [A first call in the loop's program] in
    # torchjax/compile/_repeat.py), into the decoding state kept for the layout; the
    # prefill is the only other program call. One new token (no decode step), and a
    # layout whose state is made in inference mode, then used outside it: tokens as CPU's.
    from torchjax.compile import _entry, _repeat

    kwargs = dict(STATIC, do_sample=False, eos_token_id=None, max_new_tokens=10)
    expected = _generate(cpu, **kwargs)
    for _ in range(2):
        assert torch.equal(_generate(compiled, **kwargs), expected)
    runs, loops = [], []
    monkeypatch.setattr(
        _entry.Entry, "run", lambda self, c, run=_entry.Entry.run: runs.append(1) or run(self, c)
    )
    monkeypatch.setattr(_repeat, "run", lambda *a, run=_repeat.run: loops.append(a[-1]) or run(*a))
    first = compiled.forward.first_token
    hits, traces = first.cache_hits, first.trace_count
    assert torch.equal(_generate(compiled, **kwargs), expected)
    assert runs == [1] and len(loops) == 1 and loops[0] is not None  # the prefill; the loop
    assert first.cache_hits == hits + 1 and first.trace_count == traces
    monkeypatch.undo()
    one = dict(kwargs, max_new_tokens=1)
    assert torch.equal(_generate(compiled, **one), _generate(cpu, **one))
    row = {k: v[1:] for k, v in tl.prompts().items()}  # a new layout: made in inference mode
    row_expected = _generate(cpu, row, **kwargs)
    with torch.inference_mode():
        assert torch.equal(_generate(compiled, row, **kwargs), row_expected)
    for _ in range(2):
        assert torch.equal(_generate(compiled, row, **kwargs), row_expected)
