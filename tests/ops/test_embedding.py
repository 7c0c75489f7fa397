"""Tests for torchjax/ops/embedding.py: OpInfo sweep plus what OpInfo misses."""

import pytest
import torch
import torch.nn.functional as F

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests

OPS = ["nn.functional.embedding"]
globals().update(make_tests(OPS))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(padding_idx=1),
        dict(scale_grad_by_freq=True),
        dict(padding_idx=0, scale_grad_by_freq=True),
    ],
)
def test_embedding_backward(kw):
    w = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[1, 2, 1], [0, 5, 1]])
    tw = w.detach().to("tpu").requires_grad_()
    F.embedding(idx, w, **kw).mul(torch.arange(18.0).reshape(2, 3, 3)).sum().backward()
    out = F.embedding(idx.to("tpu"), tw, **kw)
    out.mul(torch.arange(18.0).reshape(2, 3, 3).to("tpu")).sum().backward()
    torch.testing.assert_close(tw.grad.cpu(), w.grad)


def test_embedding_out_of_range():
    w = torch.randn(4, 2).to("tpu")
    out = F.embedding(torch.tensor([0, 4]).to("tpu"), w)  # raised at the sync
    with pytest.raises(IndexError, match=r"aten::embedding: index out of range.*index 4, 4 rows"):
        out.cpu()
    torch.tpu.set_sync_checks(True)
    try:
        with pytest.raises(IndexError, match="aten::embedding: index out of range"):
            F.embedding(torch.tensor([-1]).to("tpu"), w)  # immediate mode: at the op
    finally:
        torch.tpu.set_sync_checks(False)


def test_embedding_empty_and_scalar_index():
    w = torch.randn(4, 2)
    for idx in (torch.tensor([], dtype=torch.int64), torch.tensor(3)):
        got = F.embedding(idx.to("tpu"), w.to("tpu"))
        torch.testing.assert_close(got.cpu(), F.embedding(idx, w))


def test_sparse_embedding_gradient_is_a_clear_error():
    e = torch.nn.Embedding(5, 3, sparse=True).to("tpu")
    idx = torch.tensor([1, 2]).to("tpu")
    with pytest.raises(NotImplementedError, match="sparse=False"):
        e(idx)
    with torch.no_grad():  # no gradient needed: the lookup itself works
        torch.testing.assert_close(e(idx).cpu(), e.weight.cpu()[[1, 2]])
