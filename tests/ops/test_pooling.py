"""Tests for torchjax/ops/pooling.py: OpInfo sweep plus what OpInfo misses."""

import functools

import pytest
import torch
import torch.nn.functional as F

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests
from torchjax.testing.opinfo import grads_match, same, same_or_refused

OPS = [
    "nn.functional.adaptive_avg_pool1d",
    "nn.functional.adaptive_avg_pool2d",
    "nn.functional.adaptive_avg_pool3d",
    "nn.functional.adaptive_max_pool1d",
    "nn.functional.adaptive_max_pool2d",
    "nn.functional.adaptive_max_pool3d",
    "nn.functional.avg_pool1d",
    "nn.functional.avg_pool2d",
    "nn.functional.avg_pool3d",
    "nn.functional.max_pool1d",
    "nn.functional.max_pool2d",
    "nn.functional.max_pool3d",
    "max_pool2d_with_indices_backward",
    "nn.functional.max_unpool1d",
    "nn.functional.max_unpool1d.grad",
    "nn.functional.max_unpool2d",
    "nn.functional.max_unpool2d.grad",
    "nn.functional.max_unpool3d",
    "nn.functional.max_unpool3d.grad",
]
globals().update(make_tests(OPS))


# This file's gradient checks keep their own tolerance (grads_match defaults to 1e-7).
_grads_match = functools.partial(grads_match, rtol=1e-4, atol=1e-5)


_X = torch.randn(2, 3, 7, 9, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "kw",
    [
        dict(kernel_size=(2, 3), stride=2, padding=1, ceil_mode=True),
        dict(kernel_size=3, stride=2, ceil_mode=True),
        dict(kernel_size=3, dilation=2, padding=1),
    ],
)
def test_max_pool2d_indices_ceil_mode_dilation(kw):
    same(lambda x: F.max_pool2d(x, return_indices=True, **kw), _X)
    _grads_match(lambda x: F.max_pool2d(x, **kw), _X)


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("divisor_override", [None, 5])
def test_avg_pool2d_ceil_mode_and_divisors(count_include_pad, divisor_override):
    kw = dict(
        kernel_size=(2, 3),
        stride=2,
        padding=1,
        ceil_mode=True,
        count_include_pad=count_include_pad,
        divisor_override=divisor_override,
    )
    _grads_match(lambda x: F.avg_pool2d(x, **kw), _X)


def test_pools_channels_last_and_unbatched():
    x = _X.to(memory_format=torch.channels_last)
    same(lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True), x)
    same(lambda x: F.avg_pool2d(x, 3, 2, 1), x)
    same(lambda x: F.adaptive_avg_pool2d(x, (3, 4)), x)
    same(lambda x: F.max_pool2d(x, 2, return_indices=True), _X[0])
    same(lambda x: F.adaptive_max_pool2d(x, (3, 4), return_indices=True), _X[0])


def test_max_pool_ties_pick_first_index():
    x = torch.zeros(1, 1, 4, 4)
    out, idx = F.max_pool2d(x.to("tpu"), 2, return_indices=True)
    torch.testing.assert_close(idx.cpu(), F.max_pool2d(x, 2, return_indices=True)[1])


def test_avg_pool2d_int64_truncates():
    x = torch.randint(-50, 50, (1, 2, 5, 5))
    same(lambda x: F.avg_pool2d(x, 2, ceil_mode=True), x)


def test_fractional_max_pool_with_fixed_samples():
    # The samples drawn inside F.fractional_max_pool come from torchjax's RNG; with fixed
    # samples the op is deterministic and must match CPU exactly, indices included.
    g = torch.Generator().manual_seed(0)
    s2 = torch.rand(2, 3, 2, generator=g)
    same(
        lambda x, s: F.fractional_max_pool2d(
            x, 2, output_size=(4, 5), _random_samples=s, return_indices=True
        ),
        _X,
        s2,
    )
    _grads_match(
        lambda x: F.fractional_max_pool2d(
            x, (2, 3), output_size=(3, 4), _random_samples=s2.to(x.device)
        ),
        _X,
    )
    x3 = torch.randn(2, 2, 5, 4, 6, generator=g)
    s3 = torch.rand(2, 2, 3, generator=g)
    same(
        lambda x, s: F.fractional_max_pool3d(
            x, 2, output_size=(3, 2, 4), _random_samples=s, return_indices=True
        ),
        x3,
        s3,
    )


def test_fractional_max_pool_window_ending_at_the_edge():
    """ATen's bound is out + k - 1 <= size in 2-d but < size in 3-d: a 2-d last window
    ending at the input's edge computes, a 3-d one is refused with ATen's text."""
    g = torch.Generator().manual_seed(0)
    x2, s2 = torch.randn(1, 2, 9, 9, generator=g), torch.rand(1, 2, 2, generator=g)
    same(
        lambda x, s: F.fractional_max_pool2d(
            x, 6, output_size=4, _random_samples=s, return_indices=True
        ),
        x2,
        s2,
    )
    x3, s3 = torch.randn(1, 1, 9, 9, 9, generator=g), torch.rand(1, 1, 3, generator=g)
    for k, out, x, s in ((6, 5, x2, s2), (6, 4, x3, s3)):
        pool = F.fractional_max_pool2d if x.dim() == 4 else F.fractional_max_pool3d
        error = same_or_refused(
            lambda dev, pool=pool, x=x, k=k, out=out, s=s: pool(
                x.to(dev), k, output_size=out, _random_samples=s.to(dev)
            ),
            "fractional_max_pool",
        )
        assert error is not None and "too large relative to input" in str(error)


def test_fractional_max_pool_empty_batch():
    g = torch.Generator().manual_seed(0)
    same(
        lambda x, s: F.fractional_max_pool3d(
            x, (2, 2, 1), output_size=(2, 2, 2), _random_samples=s, return_indices=True
        ),
        torch.randn(0, 1, 4, 5, 4, generator=g),
        torch.rand(0, 1, 3, generator=g),
    )
    same(
        lambda x, s: F.fractional_max_pool2d(
            x, 2, output_size=(2, 3), _random_samples=s, return_indices=True
        ),
        torch.randn(0, 3, 5, 6, generator=g),
        torch.rand(0, 3, 2, generator=g),
    )


def test_fractional_max_pool_random_samples_shape_and_determinism():
    # output_ratio is a pair: torch 2.13's functional form takes len() of it.
    x = _X.to("tpu")
    torch.manual_seed(3)
    a, ia = F.fractional_max_pool2d(x, 2, output_ratio=(0.5, 0.5), return_indices=True)
    torch.manual_seed(3)
    b, ib = F.fractional_max_pool2d(x, 2, output_ratio=(0.5, 0.5), return_indices=True)
    want = F.fractional_max_pool2d(_X, 2, output_ratio=(0.5, 0.5))
    assert a.shape == want.shape and a.dtype == want.dtype and ia.dtype == torch.int64
    torch.testing.assert_close(a.cpu(), b.cpu())
    torch.testing.assert_close(ia.cpu(), ib.cpu())
    # Every value is the input at its index.
    flat = _X.reshape(2, 3, -1)
    torch.testing.assert_close(a.cpu(), flat.gather(2, ia.cpu().reshape(2, 3, -1)).reshape(a.shape))


def test_pool_errors_name_the_op():
    x = _X.to("tpu")
    with pytest.raises(RuntimeError, match="aten::max_pool2d_with_indices"):
        torch.ops.aten.max_pool2d_with_indices(x, [2, 2], [2, 2], [2, 2])
    with pytest.raises(RuntimeError, match="aten::avg_pool2d"):
        torch.ops.aten.avg_pool2d(x, [3, 3], [1, 1], [0, 0], False, True, 0)
    with pytest.raises(RuntimeError, match="aten::fractional_max_pool2d"):
        torch.ops.aten.fractional_max_pool2d(x, [2, 2], [7, 7], torch.rand(2, 3, 2).to("tpu"))


@pytest.mark.parametrize("special", [float("nan"), float("inf")])
def test_adaptive_avg_pool_keeps_nan_and_inf_in_their_window(special):
    # A window mean must not read outside its window: a 0/1 averaging matrix made
    # 0 * nan = nan in every output along the row.
    cases = [
        (lambda x: F.adaptive_avg_pool1d(x, 3), (1, 1, 6), (0, 0, 1)),
        (lambda x: F.interpolate(x, size=3, mode="area"), (1, 1, 6), (0, 0, 5)),
        (lambda x: F.adaptive_avg_pool2d(x, (2, 3)), (1, 2, 4, 7), (0, 1, 3, 0)),
        (lambda x: F.adaptive_avg_pool3d(x, (1, 2, 2)), (1, 1, 2, 4, 4), (0, 0, 1, 0, 3)),
    ]
    checked = 0
    for fn, shape, where in cases:
        x = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        x[where] = special
        want = fn(x)
        torch.testing.assert_close(fn(x.to("tpu")).cpu(), want, equal_nan=True)
        assert want.isfinite().any()
        checked += 1
    assert checked == 4


def test_adaptive_avg_pool_to_an_empty_output():
    checked = 0
    for fn, shape, out in [
        (F.adaptive_avg_pool1d, (1, 2), 0),
        (F.adaptive_avg_pool2d, (2, 3, 4), (0, 2)),
        (F.adaptive_avg_pool3d, (1, 2, 3, 4, 5), (1, 0, 2)),
    ]:
        want = fn(torch.ones(shape), out)
        got = fn(torch.ones(shape, device="tpu"), out)
        assert got.shape == want.shape and got.dtype == want.dtype
        checked += 1
    assert checked == 3


# An index outside its channel's plane of the output: CPU's kernels refuse it ("Found an
# invalid max index"); the decomposition would write it into another channel's plane (the
# batched case below) or index_put would refuse it with its own IndexError.
_UNPOOL_BAD_INDICES = {
    "1d": (lambda x, i: F.max_unpool1d(x, i, 2), (1, 1, 4), [[[0, 9, 2, 3]]]),
    "1d_next_channel": (lambda x, i: F.max_unpool1d(x, i, 2), (1, 2, 2), [[[0, 5], [0, 1]]]),
    "2d": (lambda x, i: F.max_unpool2d(x, i, 2), (1, 1, 2, 2), [[[[0, 99], [2, 3]]]]),
    "2d_negative": (lambda x, i: F.max_unpool2d(x, i, 2), (1, 1, 2, 2), [[[[0, -3], [2, 3]]]]),
    "2d_unbatched": (lambda x, i: F.max_unpool2d(x, i, 2), (1, 2, 2), [[[0, 16], [2, 3]]]),
    "3d": (
        lambda x, i: F.max_unpool3d(x, i, (1, 2, 2)),
        (1, 1, 1, 2, 2),
        [[[[[0, 999], [2, 3]]]]],
    ),
}


@pytest.mark.parametrize("case", sorted(_UNPOOL_BAD_INDICES))
def test_max_unpool_out_of_range_index_refused_as_cpu(case):
    from tests.ops.value_checks import MODES, assert_refused_as_cpu

    fn, shape, indices = _UNPOOL_BAD_INDICES[case]
    x, idx = torch.randn(shape), torch.tensor(indices)
    op = "max_unpool3d" if case.startswith("3d") else "max_unpool2d"
    assert assert_refused_as_cpu(fn, x, idx, deferred_in=op) == len(MODES)


def test_max_unpool_refused_arguments_leave_no_check_pending():
    # The decomposition's own argument checks refuse first; the index check is not made,
    # so nothing is raised later.
    x = torch.randn(1, 1, 2, 2).to("tpu")
    with pytest.raises(RuntimeError, match="elements in indices should be type int64"):
        torch.ops.aten.max_unpool2d(
            x, torch.full((1, 1, 2, 2), 99, dtype=torch.int32).to("tpu"), [4, 4]
        )
    torch.tpu.synchronize()
    ok = torch.ops.aten.max_unpool2d(x, torch.tensor([[[[0, 5], [10, 15]]]]).to("tpu"), [4, 4])
    assert ok.cpu().flatten()[[0, 5, 10, 15]].tolist() == x.cpu().flatten().tolist()
