"""checkpoint_layout (torchjax/sharding/_conversions.py): checkpoint keys grouped into
the model's parameters by transformers' own conversion mapping. Runs in the pytest
process: no devices, a meta-device model and fake reads."""

import tempfile

import torch
import transformers as tf
from safetensors import safe_open

from tests.integrations import tiny_models as tiny
from torchjax.sharding._conversions import checkpoint_layout, run_converter


def _mixtral(experts: int):
    return tf.MixtralConfig(**tiny._DECODER, num_local_experts=experts, num_experts_per_tok=2)


def _never(key):
    raise AssertionError(f"{key} read while only grouping keys")


def _saved_keys(config) -> list[str]:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as path:
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        with safe_open(f"{path}/model.safetensors", "pt") as f:
            return list(f.keys())


def test_per_expert_keys_fuse_in_expert_order():
    # 12 experts: the stack must put expert 10 after expert 9 (transformers' key order),
    # not after expert 1 (string order).
    config = _mixtral(12)
    keys = _saved_keys(config)
    assert "model.layers.0.block_sparse_moe.experts.11.w1.weight" in keys
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    reads = []

    def read(key):  # every value the number of its expert (0 for non-expert keys)
        reads.append(key)
        parts = key.split(".")
        index = int(parts[parts.index("experts") + 1]) if "experts" in parts else 0
        rows = 64 if key.endswith(("w1.weight", "w3.weight")) else 32
        return torch.full((rows, 64 if rows == 32 else 32), float(index))

    layout = checkpoint_layout(model, keys, read)
    assert layout.direct["model.layers.0.mlp.gate.weight"] == (
        "model.layers.0.block_sparse_moe.gate.weight"
    )
    assert "model.layers.0.self_attn.q_proj.weight" in layout.direct
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert name in layout.converted and name in layout.targets
    assert not reads  # nothing is read until a converter runs
    fused = run_converter(layout.converted[name], name, model)[name]
    assert fused.shape == (12, 128, 32) == layout.shapes[name]
    assert fused[:, :, 0].amax(dim=1).tolist() == [float(e) for e in range(12)]
    assert len(reads) == 24  # w1 and w3 of each expert, read once
    assert {t.__class__.__name__ for t in layout.used} == {"WeightRenaming", "WeightConverter"}


def test_model_names_read_as_they_are():
    config = tiny._qwen3()
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    keys = list(model.state_dict())
    layout = checkpoint_layout(model, keys, read=_never)
    assert layout.direct == {k: k for k in keys} and not layout.converted
    assert layout.targets == set(keys)


def test_key_mapping_renames_first():
    # from_pretrained(key_mapping=...) reaches the layout: the user's renaming applies
    # before the model's own conversions.
    config = tiny._qwen3_moe()
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    keys = [f"backbone.{k}" for k in _saved_keys(config)]
    layout = checkpoint_layout(model, keys, read=_never, key_mapping={r"^backbone\.": ""})
    assert layout.direct["model.norm.weight"] == "backbone.model.norm.weight"
    assert "model.layers.1.mlp.experts.down_proj" in layout.converted
    assert set(layout.shapes) <= layout.targets
