"""Tests for torchjax/ops/embedding.py: OpInfo sweep plus what OpInfo misses."""

import pytest
import torch
import torch.nn.functional as F

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests
from tests.ops.value_checks import MODES, assert_computes_as_cpu, assert_refused_as_cpu
from torchjax.testing.opinfo import grads_match

OPS = ["nn.functional.embedding", "nn.functional.embedding_bag"]
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


_G = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_modes_padding_and_empty_bags(mode):
    w = torch.randn(10, 4, generator=_G, dtype=torch.float64)
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0])
    offsets = torch.tensor([0, 3, 3, 6])  # bag 1 is empty
    grads_match(
        lambda w: F.embedding_bag(
            idx.to(w.device), w, offsets.to(w.device), mode=mode, padding_idx=4
        ),
        w,
    )
    grads_match(
        lambda w: F.embedding_bag(
            idx.to(w.device), w, offsets.to(w.device), mode=mode, include_last_offset=True
        ),
        w,
    )
    grads_match(lambda w: F.embedding_bag(idx.reshape(3, 3).to(w.device), w, mode=mode), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 7])
def test_embedding_bag_last_offset_short_of_the_indices(dtype, mode, padding_idx):
    # Note [The last offset of embedding_bag]: CPU's fast path (float32/half sum or mean,
    # no padding_idx) leaves the indices past offsets[-1] out of the sum, but not out of
    # the mean's divisor; its other paths put them in the last bag.
    w = torch.arange(40.0, dtype=dtype).reshape(10, 4)
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 2, 2])
    offsets = torch.tensor([0, 2, 2, 5, 9])
    kw = dict(mode=mode, include_last_offset=True, padding_idx=padding_idx)
    want = F.embedding_bag(idx, w, offsets, **kw)
    got = F.embedding_bag(idx.to("tpu"), w.to("tpu"), offsets.to("tpu"), **kw)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.cpu(), want)
    if dtype == torch.float32 and mode == "mean":  # CPU's float32 backward is defined here
        grads_match(lambda w: F.embedding_bag(idx.to(w.device), w, offsets.to(w.device), **kw), w)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_scale_grad_by_freq(mode):
    # Each row's gradient is divided by its index's count over the whole input, as CUDA
    # and torch's own embedding backward do. CPU torch 2.13's embedding_bag backward is
    # not the reference: _embedding_bag_dense_backward_cpu_sum_mean divides by
    # counts[indices_data[i]], i the unique-group counter (pytorch/pytorch#190063), so a
    # once-seen index sorted after a repeated one gets the repeated one's count. With
    # equal bags, embedding + sum/mean over the bag is the same function with that
    # (correct) backward, on CPU.
    w = torch.randn(10, 4, generator=_G, dtype=torch.float64)
    idx = torch.tensor([[1, 2, 4], [5, 4, 3], [2, 9, 0]])
    reduce = torch.sum if mode == "sum" else torch.mean
    g = torch.rand(3, 4, generator=_G, dtype=torch.float64)
    cpu = w.clone().requires_grad_()
    reduce(F.embedding(idx, cpu, scale_grad_by_freq=True), 1).backward(g)
    tpu = w.to("tpu").requires_grad_()
    out = F.embedding_bag(idx.to("tpu"), tpu, mode=mode, scale_grad_by_freq=True)
    out.backward(g.to("tpu"))
    torch.testing.assert_close(out.detach().cpu(), reduce(F.embedding(idx, w), 1))
    torch.testing.assert_close(tpu.grad.cpu(), cpu.grad, rtol=1e-12, atol=1e-12)
    # Index 3 is seen once and sorts after index 2 (seen twice): its row is unscaled.
    torch.testing.assert_close(tpu.grad.cpu()[3], g[1] / (3 if mode == "mean" else 1))


def test_embedding_bag_per_sample_weights():
    w = torch.randn(10, 4, generator=_G, dtype=torch.float64)
    psw = torch.rand(9, generator=_G, dtype=torch.float64)
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0])
    offsets = torch.tensor([0, 3, 3, 6])
    grads_match(
        lambda w, p: F.embedding_bag(
            idx.to(w.device),
            w,
            offsets.to(w.device),
            per_sample_weights=p,
            mode="sum",
            padding_idx=2,
        ),
        w,
        psw,
    )


# CPU reads offsets[0] and offsets[-1] back and raises at the op (EmbeddingBag.cpp's
# check_arguments); CUDA checks neither, so tpu raises at the op, CPU's text.
_BAD_OFFSETS = {
    "first offset not 0": (torch.tensor([0, 1]), torch.tensor([1, 0]), {}),
    "negative first offset": (torch.tensor([0, 1]), torch.tensor([-1, 0]), {}),
    "int32 first offset": (
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([1, 0], dtype=torch.int32),
        {},
    ),
    # Mixed index types print as their common type, Long.
    "int32 offsets, int64 indices": (
        torch.tensor([0, 1]),
        torch.tensor([2, 1], dtype=torch.int32),
        {},
    ),
    "last offset past the input": (torch.tensor([0, 1]), torch.tensor([0, 5]), {}),
    "last offset, max mode": (torch.tensor([0, 1]), torch.tensor([0, 3]), dict(mode="max")),
    "include_last_offset": (
        torch.tensor([0, 1]),
        torch.tensor([0, 1, 3]),
        dict(include_last_offset=True, mode="mean"),
    ),
    # The offsets are checked before the indices, as on CPU.
    "bad offsets and index": (torch.tensor([0, 7]), torch.tensor([1, 0]), {}),
}


@pytest.mark.parametrize("name", sorted(_BAD_OFFSETS))
def test_embedding_bag_refuses_offsets_at_the_op_as_cpu(name):
    idx, offsets, kw = _BAD_OFFSETS[name]
    weight = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    fn = lambda i, w, o: F.embedding_bag(i, w, o, **kw)  # noqa: E731
    assert assert_refused_as_cpu(fn, idx, weight, offsets) == len(MODES)


def test_embedding_bag_valid_offsets_compute_as_cpu():
    weight = torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
    compared = assert_computes_as_cpu(
        lambda i, w, o: F.embedding_bag(i, w, o, include_last_offset=True),
        torch.tensor([0, 1, 3, 2]),
        weight,
        torch.tensor([0, 1, 4]),  # offsets[-1] == len(indices) is valid
    )
    compared += assert_computes_as_cpu(
        lambda i, w, o: F.embedding_bag(i, w, o, mode="max"),
        torch.tensor([0, 1, 3, 2]),
        weight,
        torch.tensor([0, 2, 2]),
    )
    assert compared == 2 * len(MODES)


# Note [Decreasing offsets of embedding_bag]: offsets that go back (a bag "ending" before
# it starts).
_DECREASING = [[0, 3, 2], [0, 3, 1], [0, 1, 0], [0, 4, 2, 5], [0, 2, 2, 1]]


@pytest.mark.parametrize("offsets", _DECREASING, ids=str)
@pytest.mark.parametrize(
    "dtype, mode, padding_idx",
    [
        (torch.float64, "sum", None),
        (torch.float64, "mean", None),
        (torch.float64, "max", None),
        (torch.float32, "max", None),
        (torch.bfloat16, "max", None),
        (torch.float32, "sum", 2),
        (torch.float32, "mean", 2),
        (torch.float64, "mean", 2),
    ],
    ids=str,
)
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag_decreasing_offsets_compute_as_cpu(
    offsets, dtype, mode, padding_idx, include_last_offset
):
    # CPU's max, float64 and padding_idx paths: bags as if the offsets were sorted, sizes
    # the offsets' differences (a mean divides by at least 1, its gradient by the size).
    w = torch.randn(10, 3, generator=torch.Generator().manual_seed(0)).to(dtype)
    idx, off = torch.tensor([1, 2, 3, 4, 5]), torch.tensor(offsets)
    kw = dict(mode=mode, padding_idx=padding_idx, include_last_offset=include_last_offset)
    want = F.embedding_bag(idx, w, off, **kw)
    got = F.embedding_bag(idx.to("tpu"), w.to("tpu"), off.to("tpu"), **kw)
    torch.testing.assert_close(got.cpu(), want)
    if dtype == torch.float64:
        grads_match(lambda w: F.embedding_bag(idx.to(w.device), w, off.to(w.device), **kw), w)


# CPU's fast path (float32/float16/bfloat16 sum or mean, no padding_idx) refuses them.
_DECREASING_REFUSED = {
    "sum": ([0, 3, 2], dict(mode="sum")),
    "mean": ([0, 1, 0], dict(mode="mean")),
    "per_sample_weights": ([0, 2, 2, 1], dict(mode="sum", per_sample_weights=True)),
    "include_last_offset, past the indices": (
        [0, 4, 2, 5],
        dict(mode="sum", include_last_offset=True),
    ),
    "include_last_offset, last offset short": (
        [0, 3, 2],
        dict(mode="mean", include_last_offset=True),
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(_DECREASING_REFUSED))
def test_embedding_bag_decreasing_offsets_refused_as_cpu_fast_path(name, dtype):
    offsets, kw = _DECREASING_REFUSED[name]
    weight = torch.randn(10, 3, generator=torch.Generator().manual_seed(0)).to(dtype)
    psw = torch.ones(5, dtype=dtype) if kw.pop("per_sample_weights", False) else None

    def fn(i, w, o, p=psw):
        return F.embedding_bag(
            i, w, o, per_sample_weights=None if p is None else p.to(w.device), **kw
        )

    idx = torch.tensor([1, 2, 3, 4, 5])
    assert assert_refused_as_cpu(fn, idx, weight, torch.tensor(offsets)) == len(MODES)
