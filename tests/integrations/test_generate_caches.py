"""compile_generate per cache kind: compiled greedy tokens equal CPU's over more new tokens
than the sliding window / attention chunk, and no Python value of the cache is frozen into
the decode program (Note [Nothing frozen in the decode step]).

Tiny configs (hidden 32, 2 layers, window / chunk 4 < prompt 6 + 10 new tokens), one
model per kind, loaded once per module.
"""

import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers as tf  # noqa: E402

import torchjax  # noqa: E402,F401
from tests.integrations import tiny_models  # noqa: E402
from torchjax.compile import RetraceWarning  # noqa: E402
from torchjax.integrations.transformers import compile_generate  # noqa: E402

WINDOW = 4
NEW = 10
IDS = torch.tensor([[0, 0, 1, 17, 42, 99], [1, 5, 6, 7, 8, 9]])  # first row left-padded
BATCH = {"input_ids": IDS, "attention_mask": (IDS != 0).long()}
GREEDY = dict(do_sample=False, pad_token_id=0, max_new_tokens=NEW, min_new_tokens=NEW)


def _chunked():  # Llama 4: a chunked-attention layer (chunk 4) and a global one
    return tf.Llama4TextConfig(
        **tiny_models._DECODER, attention_chunk_size=WINDOW, intermediate_size_mlp=64,
        layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0],
        num_local_experts=1, interleave_moe_layer_step=0, moe_layers=[],
    )  # fmt: skip


def _sliding():  # Gemma 3: a sliding-window layer (window 4) and a global one
    return tf.Gemma3TextConfig(
        **tiny_models._DECODER, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip


def _hybrid():  # Qwen3.5: a linear-attention layer (conv + recurrent state) and a full one
    return tf.Qwen3_5TextConfig(
        **tiny_models._DECODER, layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4,
    )  # fmt: skip


# kind -> (model class, config, cache_implementation)
KINDS = {
    "dynamic": (tf.Qwen3ForCausalLM, tiny_models._qwen3, "dynamic"),
    "static": (tf.Qwen3ForCausalLM, tiny_models._qwen3, "static"),
    "sliding": (tf.Gemma3ForCausalLM, _sliding, "static"),
    "chunked": (tf.Llama4ForCausalLM, _chunked, "static"),
    "hybrid": (tf.Qwen3_5ForCausalLM, _hybrid, "static"),
}


def _load(kind, path):
    cls, config, _ = KINDS[kind]
    torch.manual_seed(0)
    model = cls(config())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)  # decisive greedy choices (see tiny_models)
    model.save_pretrained(path)
    cpu = cls.from_pretrained(path, attn_implementation="eager").eval()
    tpu = cls.from_pretrained(path, attn_implementation="eager", device_map="tpu").eval()
    return cpu, tpu


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    """The chunked-attention model, on CPU and on tpu under compile_generate."""
    cpu, tpu = _load("chunked", str(tmp_path_factory.mktemp("chunked")))
    compile_generate(tpu)
    return cpu, tpu


def _generate(model, **kwargs):
    batch = BATCH
    if model.device.type == "tpu":
        batch = {k: v.to("tpu") for k, v in batch.items()}
    with torch.no_grad():
        return model.generate(**batch, **kwargs).cpu()


@pytest.mark.parametrize("kind", list(KINDS))
def test_compiled_tokens_match_cpu_past_the_window(kind, tmp_path):
    cpu, tpu = _load(kind, str(tmp_path))
    jitted = compile_generate(tpu)
    kwargs = dict(GREEDY, cache_implementation=KINDS[kind][2])
    if kind == "dynamic":  # eager: every step's new shapes compile each op (no window)
        kwargs.update(max_new_tokens=3, min_new_tokens=3)
    expected = _generate(cpu, **kwargs)
    assert torch.equal(_generate(tpu, **kwargs), expected), kind
    # (compiled forward, first-token and decode-step programs) traces. A DynamicCache
    # runs eagerly (its shapes grow every step). Static caches: the prefill, the first
    # token's program, the decode step (Note [Decode steps as one program]); a cache
    # with linear-attention layers runs transformers' loop around the compiled forward:
    # prefill and decode step.
    step = tpu.forward.decode_step
    traces = {"dynamic": (0, 0), "hybrid": (2, 0)}.get(kind, (1, 1))
    assert (jitted.trace_count, step.trace_count) == traces, kind
    assert tpu.forward.first_token.trace_count == (1 if traces[1] else 0), kind
    if kind in ("chunked", "hybrid"):
        # A second call: the cache was made before the first prefill (Note [A static
        # cache initialized before its first step]), so nothing traces again, except
        # the hybrid's prefill: transformers makes linear-attention layers at their
        # first update only (supports_early_init False). The decode step is a cache hit
        # and the Python state the hits left (flags such as the linear layer's
        # has_previous_state) is right.
        assert torch.equal(_generate(tpu, **kwargs), expected), kind
        again = 1 if kind == "hybrid" else 0
        assert (jitted.trace_count, step.trace_count) == (traces[0] + again, traces[1]), kind


def test_user_cache_with_a_moving_python_offset_retraces_not_freezes(chunked):
    # A StaticCache made by the caller keeps its chunked layer, whose position is a
    # Python int (cumulative_length_int) read by the mask: each value is a guard, so the
    # decode step retraces per token (slow, warned) instead of reusing a stale offset.
    cpu, tpu = chunked
    new = 4
    kwargs = dict(GREEDY, max_new_tokens=new, min_new_tokens=new)
    expected = _generate(cpu, cache=tf.StaticCache(cpu.config, max_cache_len=10), **kwargs)
    cache = tf.StaticCache(tpu.config, max_cache_len=10)
    assert type(cache.layers[0]).__name__ == "StaticSlidingWindowLayer"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RetraceWarning)
        assert torch.equal(_generate(tpu, cache=cache, **kwargs), expected)
    # The int the model's Python code updates is right after cache hits too.
    assert cache.layers[0].cumulative_length_int == IDS.shape[1] + new - 1


def test_writing_past_a_static_cache_raises_like_cpu(chunked):
    cpu, tpu = chunked
    # 6 prompt positions + 3 decode steps (the 4th token is the last step's output) > 8
    too_long = dict(GREEDY, max_new_tokens=4, min_new_tokens=4)
    # CPU: index_copy_ raises IndexError; XLA would drop the write and give wrong tokens.
    with pytest.raises(IndexError, match="out of bounds"):
        _generate(cpu, cache=tf.StaticCache(cpu.config, max_cache_len=8), **too_long)
    with pytest.raises(IndexError, match=r"compile_generate: .* holds 8 tokens"):
        _generate(tpu, cache=tf.StaticCache(tpu.config, max_cache_len=8), **too_long)


class _StopAfterToken(tf.StoppingCriteria):
    """Reads the last tokens on the host every step (a Python-side criterion)."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        last = input_ids[:, -1].tolist()
        return torch.tensor([t == self.token for t in last], device=input_ids.device)


def test_python_stopping_criterion_runs_each_token(chunked):
    # Stopping criteria (and streamers) run in Python between compiled steps, each token.
    cpu, tpu = chunked
    kwargs = dict(do_sample=False, pad_token_id=0, max_new_tokens=NEW)
    full = _generate(cpu, cache_implementation="static", **kwargs)
    stop = int(full[0, IDS.shape[1] + 4])  # row 0's 5th new token
    criteria = tf.StoppingCriteriaList([_StopAfterToken(stop)])
    expected = _generate(cpu, cache_implementation="static", stopping_criteria=criteria, **kwargs)
    got = _generate(tpu, cache_implementation="static", stopping_criteria=criteria, **kwargs)
    assert torch.equal(got, expected) and not torch.equal(expected, full)
