"""Tests for torchjax/ops/nn_misc.py: OpInfo sweep plus what OpInfo misses.

conv3d / conv_transpose3d belong to conv.py; their OpInfo sweep runs here (conv tests
cover them only directly). Random ops (dropout family, rrelu in training,
fractional_max_pool's drawn samples) cannot match CPU torch's generator: they are not in
the sweep; the tests below check shapes, dtypes and statistics (and rrelu in eval mode).
"""

import pytest
import torch
import torch.nn.functional as F

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests
from torchjax.testing.opinfo import grads_match

OPS = [
    "nn.functional.embedding_bag",
    "nn.functional.unfold",
    "nn.functional.pixel_shuffle",
    "nn.functional.pixel_unshuffle",
    "nn.functional.channel_shuffle",
    "nn.functional.one_hot",
    "nn.functional.normalize",
    "nn.functional.local_response_norm",
    "nn.functional.prelu",
    "nn.functional.cosine_similarity",
    "nn.functional.pairwise_distance",
    "nn.functional.pdist",
    "nn.functional.softmin",
    "nn.functional.softmin.with_dtype",
    "nn.functional.conv3d",
    "nn.functional.conv_transpose3d",
]
globals().update(make_tests(OPS))
# Random ops, left out of the sweep: their samples draw from torch's CPU generator on one
# side and torchjax's on the other (see the module docstring), so values cannot match.
RANDOM_OPS = [
    "nn.functional.fractional_max_pool2d",  # test_pooling.py: fixed-sample tests
    "nn.functional.fractional_max_pool3d",
    "nn.functional.rrelu",
    "nn.functional.dropout",
    "nn.functional.dropout2d",
    "nn.functional.dropout3d",
    "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout.with_train",
]

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


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 2.0, 3.0, float("inf")])
def test_pdist_norms_and_duplicate_rows(p):
    x = torch.randn(5, 3, generator=_G, dtype=torch.float64)
    x[3] = x[1]  # a zero distance: ATen's gradient is 0 there, not NaN
    grads_match(lambda x: F.pdist(x, p), x)


def test_rrelu_eval_and_training_noise():
    x = torch.randn(1000, generator=_G)
    grads_match(lambda x: F.rrelu(x, 0.1, 0.3, training=False), x.double())
    t = x.to("tpu")
    out = F.rrelu(t, 0.1, 0.3, training=True).cpu()
    slope = out / x
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out[x > 0], x[x > 0])
    neg = slope[x < 0]
    assert neg.min() >= 0.1 and neg.max() <= 0.3 and neg.std() > 0.03
    torch.testing.assert_close(neg.mean(), torch.tensor(0.2), atol=0.01, rtol=0)


@pytest.mark.parametrize(
    "fn,p",
    [
        (lambda x: F.dropout(x, 0.3, training=True), 0.3),
        (lambda x: F.dropout2d(x, 0.4, training=True), 0.4),
        (lambda x: F.dropout3d(x[..., None], 0.4, training=True)[..., 0], 0.4),
        (lambda x: F.alpha_dropout(x, 0.3, training=True), 0.3),
        (lambda x: F.feature_alpha_dropout(x, 0.3, training=True), 0.3),
    ],
)
def test_dropout_family_shapes_and_rates(fn, p):
    x = torch.randn(64, 32, 8, 8, generator=_G)
    torch.manual_seed(0)
    out = fn(x.to("tpu"))
    assert out.shape == x.shape and out.dtype == x.dtype and out.device.type == "tpu"
    want = fn(x)

    # Dropped entries all take one value (0, or alpha dropout's a'): its frequency is p.
    # Kept ones are transformed as on CPU, so mean and spread match CPU's closely.
    def dropped_fraction(t):
        return t.unique(return_counts=True)[1].max().item() / t.numel()

    got = out.cpu()
    assert abs(dropped_fraction(got) - p) < 0.03
    assert abs(dropped_fraction(want) - p) < 0.03
    torch.testing.assert_close(got.mean(), want.mean(), atol=0.05, rtol=0)
    torch.testing.assert_close(got.std(), want.std(), atol=0.05, rtol=0)
