"""MoE experts on the ragged-dot kernel through transformers' experts registry: a tiny
Qwen3-MoE generates on tpu (under torchjax.jit) the same greedy tokens with the kernel as
without it (transformers' default "grouped_mm" experts, on tpu and on CPU)."""

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import torchjax
from torchjax import pallas as tp
from torchjax.integrations.transformers import _moe
from torchjax.integrations.transformers._moe import NAME, register_experts


@pytest.fixture(scope="module")
def model():
    cfg = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).eval()


def test_registered_in_transformers_experts_interface():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert register_experts() == NAME == "torchjax_ragged_dot"
    assert NAME in ALL_EXPERTS_FUNCTIONS


def _greedy(model, ids, steps=2):
    # Greedy decoding, each step one torchjax.jit program (eager tpu generate would
    # compile every op for each new shape: ~4x slower for the same check).
    step = torchjax.jit(lambda x: model(input_ids=x, use_cache=False).logits[:, -1].argmax(-1))
    tokens = ids.to("tpu")
    for _ in range(steps):
        tokens = torch.cat([tokens, step(tokens)[:, None]], dim=1)
    return tokens.cpu()


def test_tiny_qwen3_moe_generates_same_tokens_with_and_without_kernel(model, monkeypatch):
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (1, 6))
    expected = model.generate(ids, max_new_tokens=2, do_sample=False)  # CPU, grouped_mm
    model.to("tpu")
    assert model.config._experts_implementation == "grouped_mm"
    assert torch.equal(_greedy(model, ids), expected)  # tpu, without the kernel

    register_experts()
    model.set_experts_implementation(NAME)
    assert model.model.layers[0].mlp.experts.config._experts_implementation == NAME
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return tp.ragged_dot(*args)

    monkeypatch.setattr(_moe, "ragged_dot", counted)
    assert torch.equal(_greedy(model, ids), expected)  # tpu, with the kernel
    assert len(calls) == 4  # 2 steps x (gate_up, down)


def test_compiles_with_fullgraph_as_one_graph(model):
    # torchjax's files are skipped by Dynamo: the registered forward was refused under
    # fullgraph=True ("function marked as skipped") and broke the graph at every layer.
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (2, 5))
    model.cpu()
    model.set_experts_implementation("grouped_mm")
    with torch.no_grad():
        want = model(ids).logits
    model.to("tpu")
    register_experts()
    model.set_experts_implementation(NAME)
    torch._dynamo.reset()
    before = torchjax.compile.dynamo_stats()
    compiled = torch.compile(model, backend="tpu", fullgraph=True)
    with torch.no_grad():
        got = compiled(ids.to("tpu")).logits.cpu()
    assert torchjax.compile.dynamo_stats()["graphs"] - before["graphs"] == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("sentinel", [False, True])
def test_decoding_multiplies_each_pair_by_its_own_expert(model, monkeypatch, sentinel):
    # Note [Grouped products of few rows]: 2 pairs (one token, top 2) against 4 experts
    # take no ragged dot; the values are CPU grouped_mm's. An expert-parallel sentinel
    # (expert id num_experts) contributes 0, as a pair of routing weight 0 does.
    from transformers.integrations.moe import grouped_mm_experts_forward

    experts = model.model.layers[0].mlp.experts
    model.cpu()
    torch.manual_seed(3)
    hidden = torch.randn(1, 32)
    index = torch.tensor([[3, 1]])
    weights = torch.tensor([[0.75, 0.25]])
    ref_index, ref_weights = index, weights
    if sentinel:
        index = torch.tensor([[3, experts.num_experts]])
        ref_index, ref_weights = torch.tensor([[3, 0]]), torch.tensor([[0.75, 0.0]])
    with torch.no_grad():
        want = grouped_mm_experts_forward(experts, hidden, ref_index, ref_weights)
    model.to("tpu")
    calls = []
    monkeypatch.setattr(_moe, "ragged_dot", lambda *args: calls.append(args) or None)
    with torch.no_grad():
        got = _moe.ragged_dot_experts_forward(
            experts, hidden.to("tpu"), index.to("tpu"), weights.to("tpu")
        ).cpu()
    assert calls == []
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
