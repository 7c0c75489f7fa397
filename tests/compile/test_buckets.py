"""torchjax.bucketed: a varying dimension padded to buckets (Note [Shape buckets])."""

import pytest
import torch
import torch.nn.functional as F

import torchjax
from torchjax.compile._buckets import bucket_for, pad_to
from torchjax.ops import executables

TPU = "tpu"


def _masked_attention(x, attention_mask=None):
    # Bidirectional attention over (batch, seq, dim), keys masked by attention_mask.
    scores = x @ x.transpose(1, 2) / x.shape[-1] ** 0.5
    if attention_mask is not None:
        keep = attention_mask[:, None, :].bool()
        scores = scores.masked_fill(~keep, float("-inf"))
    return F.softmax(scores, dim=-1) @ x


def test_bucket_for_and_pad_to():
    assert [bucket_for(n, [4, 8]) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    with pytest.raises(ValueError, match="length 9 is above the largest bucket 8"):
        bucket_for(9, [4, 8])
    t = torch.ones(2, 3)
    assert pad_to(t, 1, 5, value=7).tolist() == [[1, 1, 1, 7, 7]] * 2


def test_eager_values_equal_unpadded_cpu_and_ops_compile_once_per_bucket():
    # Tables start empty: earlier tests in the process may have spent an op's float
    # variants (masked_fill's fill values), after which new ones run op by op.
    executables.clear_caches()
    f = torchjax.bucketed(_masked_attention, buckets=(8, 16), dim=1, device=TPU)
    xs = {n: torch.randn(2, n, 4) for n in range(3, 17)}
    for n in (5, 12):  # one call per bucket: their executables exist now
        f(xs[n])
    torchjax.reset_stats()
    for n, x in xs.items():
        got = f(x)  # padded on the host, then moved; no mask given: ones, padded with 0
        assert got.shape == (2, n, 4)
        torch.testing.assert_close(got.cpu(), _masked_attention(x), rtol=1e-5, atol=1e-5)
        mask = torch.ones(2, n, dtype=torch.long)
        mask[1, n - 2 :] = 0  # a row with padding of its own
        got = f(x, attention_mask=mask)
        torch.testing.assert_close(got.cpu(), _masked_attention(x, mask), rtol=1e-5, atol=1e-5)
    ops = torchjax.stats()["ops"]
    # 14 lengths: the function's ops traced nothing new (their bucket's executables).
    for op in ("aten::bmm.default", "aten::_softmax.default", "aten::masked_fill.Scalar"):
        assert ops[op]["traces"] == 0 and ops[op]["calls"] >= 28, (op, ops[op])


def test_tpu_inputs_are_padded_on_the_device():
    f = torchjax.bucketed(_masked_attention, buckets=(8,), dim=1)
    x = torch.randn(1, 5, 4)
    got = f(x.to(TPU))
    assert got.device.type == TPU and got.shape == (1, 5, 4)
    torch.testing.assert_close(got.cpu(), _masked_attention(x), rtol=1e-5, atol=1e-5)


def test_jit_traces_once_per_bucket_with_a_bert_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    cpu = transformers.BertModel(config, add_pooling_layer=False).eval()
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    model.load_state_dict(cpu.state_dict())
    model.to(TPU)
    jitted = torchjax.jit(model, warn_after=100)
    f = torchjax.bucketed(jitted, buckets=(8, 16), dim=1)
    with torch.no_grad():
        for n in (3, 7, 8, 11, 16):
            ids = torch.randint(1, 50, (2, n))
            got = f(input_ids=ids.to(TPU)).last_hidden_state
            want = cpu(input_ids=ids).last_hidden_state
            assert got.shape == want.shape
            torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    assert jitted.trace_count == 2  # one per bucket, for five lengths
