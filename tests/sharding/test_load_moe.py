"""Tensor-parallel loading from the Hub's checkpoint layouts (torchjax/sharding/
_conversions.py): per-expert MoE weights and older names through transformers' conversion
mapping, fused ones as stored; TP=4, logits equal CPU's, experts split over "tp" as each
model's plan says (cases in tests/sharding/_moe_cases.py)."""

import pytest

from tests.sharding._moe_cases import ARCHITECTURES


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_tp_load_hub_layout(check, name):
    check(f"tp_load_{name}_hub")


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_tp_load_fused_layout(check, name):
    check(f"tp_load_{name}_fused")


def test_tp_load_saves_the_hub_layout_back(check):
    check("tp_load_saves_the_hub_layout_back")
