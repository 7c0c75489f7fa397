"""The prefill program of a compiled ``generate``: into an empty static cache it is the
forward alone plus slice writes (Note [The prefill of an empty cache] in
torchjax/integrations/transformers/_cache_state.py), into a cache that holds tokens it
keeps traced positions. Greedy tokens equal CPU's.

The tiny Llama of examples/tiny_llama_generate.py (head dim 16, 4/2 heads) on unpadded
16-token prompts, a length the flash kernel takes; the kernels run in interpret mode.
"""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

from tests._programs import equations  # noqa: E402
from tests.integrations.tiny_models import generate  # noqa: E402
from torchjax.integrations.transformers import compile_generate  # noqa: E402
from torchjax.pallas import use_flash_attention  # noqa: E402

PROMPT = 16
GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")


def _batch(rows: int = 1) -> dict:
    ids = torch.randint(3, 128, (rows, PROMPT), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _compiled(llama_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu")
    compile_generate(model.eval())
    return model


def _kernel_calls(jitted) -> list:
    """(operand shapes) of each flash kernel call in ``jitted``'s programs."""
    return [
        tuple(tuple(v.aval.shape) for v in eqn.invars)
        for eqn in equations(jitted)
        if eqn.primitive.name == "pallas_call"
    ]


def test_the_prefill_of_an_empty_cache_is_the_forward_with_slice_writes(llama_dir, cpu):
    # Before, the prefill's positions were traced (the cache's length is state): a
    # (1, 1, 16, S) mask over the whole cache, keys and values repeated to the 4 query
    # heads, the masked flash kernel over S keys, and every cache write a scatter. Now,
    # as eager torch on CPU: the causal kernel over the prompt's 16 keys, 2 kv heads
    # (GQA), no mask operand, and each layer's two writes a slice.
    model = _compiled(llama_dir)
    kwargs = dict(GREEDY, max_new_tokens=4)
    with use_flash_attention(True):
        tokens = generate(model, _batch(), **kwargs)
    assert torch.equal(tokens, generate(cpu, _batch(), **kwargs))
    jitted = model.forward.jitted
    assert jitted.trace_count == 1
    prims = [eqn.primitive.name for eqn in equations(jitted)]
    assert prims.count("scatter") == 0
    assert prims.count("dynamic_update_slice") == 4  # 2 layers, keys and values
    q, k, v = (1, 4, PROMPT, 16), (1, 2, PROMPT, 16), (1, 2, PROMPT, 16)
    assert _kernel_calls(jitted) == [(q, k, v)] * 2


def test_a_prefill_into_a_cache_that_holds_tokens_keeps_traced_positions(llama_dir, cpu):
    # A chunked prefill: the first chunk fills an empty cache, the second a cache that
    # holds its tokens, whose positions stay traced (scatter writes): two traces, tokens
    # as CPU's, and a second generate runs both programs again without tracing.
    model = _compiled(llama_dir)
    kwargs = dict(GREEDY, max_new_tokens=4, prefill_chunk_size=PROMPT // 2)
    expected = generate(cpu, _batch(), **kwargs)
    assert torch.equal(generate(model, _batch(), **kwargs), expected)
    jitted = model.forward.jitted
    assert jitted.trace_count == 2
    prims = [eqn.primitive.name for eqn in equations(jitted)]
    assert (prims.count("scatter"), prims.count("dynamic_update_slice")) == (4, 4)
    assert torch.equal(generate(model, _batch(), **kwargs), expected)
    assert (jitted.trace_count, jitted.cache_hits) == (2, 2)


def test_a_padded_batch_keeps_its_mask_and_writes_slices(llama_dir, cpu):
    # Padding is read from the attention mask, an input of the program: transformers keeps
    # the mask (and CPU takes its masked path too); the positions are known all the same.
    model = _compiled(llama_dir)
    batch = _batch(2)
    batch["input_ids"][0, :3] = 0
    batch["attention_mask"][0, :3] = 0
    kwargs = dict(GREEDY, max_new_tokens=4)
    assert torch.equal(generate(model, batch, **kwargs), generate(cpu, batch, **kwargs))
    prims = [eqn.primitive.name for eqn in equations(model.forward.jitted)]
    assert (prims.count("scatter"), prims.count("dynamic_update_slice")) == (0, 4)
