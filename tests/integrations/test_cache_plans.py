"""A warm compiled ``generate`` takes its kept static cache without building a new one
(Note [A kept cache found without building one] in
torchjax/integrations/transformers/_cache_plans.py): tokens and transformers'
``_previous_max_cache_length`` as on CPU across calls that change the prompt, its
length, the batch size, ``max_new_tokens`` and the config."""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402
from transformers import cache_utils as cu  # noqa: E402

from examples import tiny_llama_generate as tl  # noqa: E402
from tests.integrations.tiny_models import generate  # noqa: E402
from torchjax.integrations.transformers import compile_generate  # noqa: E402

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
STATIC = dict(cache_implementation="static")


def _builds(monkeypatch) -> list:
    """A list that grows by one per ``StaticCache`` made."""
    made = []
    init = cu.StaticCache.__init__

    def counted(self, *args, **kwargs):
        made.append(kwargs.get("max_cache_len"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(cu.StaticCache, "__init__", counted)
    return made


def _calls():
    two = tl.prompts()
    one = {k: v[1:] for k, v in two.items()}
    short = {k: v[1:, 2:] for k, v in two.items()}
    # (batch, max_new_tokens, builds on tpu); a repeat of a (batch size, cache length)
    # seen before builds nothing; a new prompt length in the same cache length neither.
    return [
        (one, 4, 1),
        (one, 4, 0),
        (short, 4, 0),
        (two, 4, 1),
        (one, 4, 0),
        (two, 4, 0),
        (one, 40, 1),  # longer: a new cache length (and the record grows)
        (one, 4, 0),  # transformers keeps the longest length: the same cache as before
        (two, 40, 1),
        (short, 8, 0),
    ]


def test_a_warm_generate_builds_no_static_cache(llama_dir, monkeypatch):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu").eval()
    cpu = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()  # its own record
    compile_generate(model)
    cpu_static = dict(STATIC, disable_compile=True)
    made = _builds(monkeypatch)
    ran = 0
    for batch, new, builds in _calls():
        before = len(made)
        kwargs = dict(GREEDY, max_new_tokens=new)
        tokens = generate(model, batch, **kwargs, **STATIC)
        assert len(made) - before == builds, (batch["input_ids"].shape, new)
        expected = generate(cpu, batch, **kwargs, **cpu_static)
        assert torch.equal(tokens, expected)
        # As transformers would leave it (the CPU model made the same calls as written).
        assert model._previous_max_cache_length == cpu._previous_max_cache_length
        ran += 1
    assert ran == len(_calls())


def test_a_changed_config_builds_again(llama_dir, cpu, monkeypatch):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu").eval()
    compile_generate(model)
    batch = {k: v[1:] for k, v in tl.prompts().items()}
    kwargs = dict(GREEDY, max_new_tokens=4, **STATIC)
    expected = generate(cpu, batch, **dict(kwargs, disable_compile=True))
    made = _builds(monkeypatch)
    seen = []  # the caches generate ran with
    prepare = model._prepare_static_cache

    def remember(*args, **kwargs):
        seen.append(prepare(*args, **kwargs))
        return seen[-1]

    assert torch.equal(generate(model, batch, **kwargs), expected)
    assert torch.equal(generate(model, batch, **kwargs), expected)
    assert len(made) == 1
    # A value of the config's that the cache does not read: built again (the plan's
    # config differs), and its layout is the kept cache's, which is taken.
    model.config.tjx_marker = 1
    monkeypatch.setattr(model, "_prepare_static_cache", remember)
    assert torch.equal(generate(model, batch, **kwargs), expected)
    assert len(made) == 2 and len(seen) == 1
    assert torch.equal(generate(model, batch, **kwargs), expected)
    assert len(made) == 2 and len(seen) == 2 and seen[0] is seen[1]
    # A nested value changed in place (a dict the cache does not read): built again too,
    # the kept cache taken.
    model.config.rope_parameters["tjx_marker"] = 1
    assert torch.equal(generate(model, batch, **kwargs), expected)
    assert len(made) == 3
    assert torch.equal(generate(model, batch, **kwargs), expected)
    assert len(made) == 3 and len(seen) == 4 and all(c is seen[0] for c in seen)
    # A value without a plain == (a tensor of several elements): every call builds.
    model.config.tjx_marker = torch.ones(2)
    for calls in (1, 2):
        assert torch.equal(generate(model, batch, **kwargs), expected)
        assert len(made) == 3 + calls and all(c is seen[0] for c in seen)
