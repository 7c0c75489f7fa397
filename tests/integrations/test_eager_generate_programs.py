"""Eager ``generate(..., disable_compile=True)`` on "tpu" of batches of two prompts: the
XLA programs compiled per generated token stay bounded, and the tokens are CPU's.

Each step transformers' loop grows the ids, the mask and the position ids by one token:
an op on a grown tensor is a new program (its shape is new), so a few programs per token
remain (``cat`` and the read of the last token, shared by every tensor of that shape;
for a left-padded batch, the mask's padding to the cache's length). What must not come
back: the ops reading the last token of a batch compiling per length because the row
stride is the length (Note [Views in keys whose shapes vary] in
torchjax/ops/view_signatures.py), programs compiled twice because the loaded weights'
arrays were placed differently from the tensors made on tpu (Note [Uncommitted arrays on
tpu:0] in torchjax/tensor/_fills.py), and the mask's conversion to bool as a program of
its own (Note [Conversions read by their consumers] in torchjax/ops/deferred_casts.py).

The tiny Llama of examples/tiny_llama_generate.py, loaded with ``device_map="tpu"``.
"""

import os

import jax
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

import torchjax  # noqa: E402
from tests.integrations.tiny_models import generate  # noqa: E402
from torchjax.ops import executables  # noqa: E402

# An end-of-sequence id, never reached before min_new_tokens: the stopping check reads
# the last token of the ids every step.
GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=2, disable_compile=True)
NEW = 16
WARM = 8  # tokens before the count starts
RIGHT = torch.tensor([[3, 4, 1, 17, 42, 99, 5], [1, 5, 6, 7, 8, 9, 10]])
LEFT = torch.tensor([[0, 0, 0, 1, 17, 42, 99], [1, 5, 6, 7, 8, 9, 10]])


@pytest.fixture(scope="module")
def tpu(llama_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir, device_map="tpu").eval()


class _Marks(transformers.LogitsProcessor):
    """XLA compiles so far, at each generated token (reads no tensor)."""

    def __init__(self):
        self.compiles = []

    def __call__(self, input_ids, scores):
        self.compiles.append(torchjax.stats()["compiles"])
        return scores


def _per_token_programs(cpu, tpu, ids):
    # From empty caches: programs an earlier test compiled for the same lengths would
    # hide this call's.
    executables.clear_caches()
    jax.clear_caches()
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    kwargs = dict(GREEDY, max_new_tokens=NEW, min_new_tokens=NEW)
    marks = _Marks()
    processors = transformers.LogitsProcessorList([marks])
    got = generate(tpu, batch, **kwargs, logits_processor=processors)
    assert torch.equal(got, generate(cpu, batch, **kwargs))
    assert len(marks.compiles) == NEW
    return marks.compiles[-1] - marks.compiles[WARM - 1]


def test_batch_of_two_compiles_two_programs_per_token(cpu, tpu):
    # The ids' and the position ids' ``cat`` (one program for both) and the read of the
    # last token (one for the model's input, the stopping check and the next position).
    # More came back when each op on the last token compiled per length, or the cat and
    # the read compiled twice, once per placement.
    assert _per_token_programs(cpu, tpu, RIGHT) <= 2 * (NEW - WARM)


def test_left_padded_batch_compiles_three_programs_per_token(cpu, tpu):
    # Beside the two above: the mask padded to the static cache's length (transformers'
    # mask preparation), with its conversion to bool inside. With the conversion a
    # program of its own: 31 in these 8 tokens.
    assert _per_token_programs(cpu, tpu, LEFT) <= 3 * (NEW - WARM)
