"""Tensor-parallel loading of every architecture tests/integrations/tiny_models.py
builds, from checkpoints save_pretrained wrote: with a plan in transformers, CPU's
logits and the planned weights split over "tp"; without one (GPT-2, T5), transformers'
answer, a ValueError naming the model. A load in half precision gives each parameter,
buffer and config the dtype transformers gives it on CPU (Note [The dtypes of a
tensor-parallel load] in torchjax/sharding/_load.py). The cases are in
tests/sharding/_architecture_cases.py, _moe_cases.py and _cases.py."""

import pytest

from tests.integrations import tiny_models as tiny
from tests.sharding._architecture_cases import DTYPES, TINY_CASES


def test_every_tiny_architecture_has_a_case():
    # The builders outside ARCHITECTURES are the module's (Auto class, config, attn) tuples.
    others = {
        name.lower()
        for name, value in vars(tiny).items()
        if name.isupper() and isinstance(value, tuple) and len(value) == 3 and callable(value[1])
    }
    assert others >= {"t5gemma", "qwen3_next"}, others
    assert set(TINY_CASES) == set(tiny.ARCHITECTURES) | others


@pytest.mark.parametrize("name", sorted(TINY_CASES))
def test_tp_load_tiny_architecture(check, name):
    check(TINY_CASES[name])


@pytest.mark.parametrize("case", list(DTYPES))
def test_tp_load_dtypes_as_transformers(check, case):
    check(f"tp_load_{case}_dtype")
