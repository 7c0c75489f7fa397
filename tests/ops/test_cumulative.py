"""Tests for torchjax/ops/cumulative.py: the OpInfo sweep, then int64 past 2**31, dtype
rules, NaN and ties in cummax/cummin, infinities in logcumsumexp, 0-d/empty, out= and
in-place on views."""

from __future__ import annotations

import math

import pytest
import torch

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests
from torchjax.testing import opinfo as oi

OPS = ["cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"]
globals().update(make_tests(OPS))

NAN, INF = math.nan, math.inf


same = oi.same


def test_cumsum_int64_and_dtypes():
    same(lambda t: torch.cumsum(t, 0), torch.tensor([2**40, 2**41, -7, 2**62]))
    same(lambda t: torch.cumsum(t, 0), torch.tensor([2**31 - 1] * 3, dtype=torch.int32))
    same(lambda t: torch.cumsum(t, 0), torch.tensor([True, False, True]))
    same(lambda t: torch.cumprod(t, 0), torch.tensor([True, False, True]))
    same(lambda t: torch.cumsum(t, 1, dtype=torch.float64), torch.arange(6).reshape(2, 3))
    same(lambda t: torch.cumprod(t, -1, dtype=torch.int32), torch.arange(1, 7).reshape(2, 3))


def test_cummax_cummin_nan_and_ties():
    x = torch.tensor([1.0, NAN, 2.0, NAN, 0.5, 1.0, 1.0])
    same(lambda t: torch.cummax(t, 0), x)
    same(lambda t: torch.cummin(t, 0), x)
    ties = torch.tensor([[1, 1, 0, 1, 2, 2], [3, 3, 3, 1, 1, 0]])
    same(lambda t: torch.cummax(t, 1), ties)
    same(lambda t: torch.cummin(t, 1), ties)
    same(lambda t: torch.cummax(t, 0), ties.bool())


def test_logcumsumexp_infinities():
    x = torch.tensor([-INF, -INF, 0.0, INF, 1.0, NAN, 2.0])
    same(lambda t: torch.logcumsumexp(t, 0), x)
    same(lambda t: torch.logcumsumexp(t, 0), torch.tensor([-INF, -INF]))
    with pytest.raises(NotImplementedError, match="aten::logcumsumexp"):
        torch.logcumsumexp(torch.tensor([1, 2]).to("tpu"), 0)


@pytest.mark.parametrize(
    "fn", [torch.cumsum, torch.cumprod, torch.cummax, torch.cummin, torch.logcumsumexp]
)
def test_zero_dim_and_empty(fn):
    same(lambda t: fn(t, 0), torch.tensor(1.5))
    same(lambda t: fn(t, -1), torch.tensor(1.5))
    same(lambda t: fn(t, 1), torch.empty(2, 0))
    with pytest.raises(IndexError, match="Dimension out of range"):
        fn(torch.ones(2).to("tpu"), 1)


def test_out_and_inplace_on_view():
    x = torch.randn(3, 4)
    out = torch.empty(0).to("tpu")
    assert torch.cumsum(x.to("tpu"), 1, out=out) is out
    oi.compare(out, torch.cumsum(x, 1))
    v, i = torch.empty(0).to("tpu"), torch.empty(0, dtype=torch.long).to("tpu")
    torch.cummax(x.to("tpu"), 0, out=(v, i))
    expected = torch.cummax(x, 0)
    oi.compare((v, i), (expected.values, expected.indices))
    # in-place on a view writes through to the base
    base_cpu, base = x.clone(), x.to("tpu")
    base_cpu[1].cumsum_(0)
    base[1].cumsum_(0)
    oi.compare(base, base_cpu)
    base_cpu.t()[2].cumprod_(0)
    base.t()[2].cumprod_(0)
    oi.compare(base, base_cpu)


@pytest.mark.parametrize("op", ["cumsum_", "cumprod_"])
def test_inplace_scans_refuse_as_cpu(op):
    # bool has no in-place kernel unless there is nothing to scan; dtype= must be
    # self's. They raised RuntimeError (int64 into bool) or computed.
    cases = [
        (lambda d: torch.tensor([True, False, True], device=d), {}),
        (lambda d: torch.tensor(True, device=d), {}),
        (lambda d: torch.zeros(0, dtype=torch.bool, device=d), {}),
        (lambda d: torch.tensor([1, 2], dtype=torch.int32, device=d), {"dtype": torch.int64}),
        (lambda d: torch.tensor([1, 2], dtype=torch.int8, device=d), {}),
    ]
    refusals = [
        type(oi.same_or_refused(lambda d, m=make, k=kwargs: getattr(m(d), op)(0, **k), op))
        for make, kwargs in cases
    ]
    assert NotImplementedError in refusals and RuntimeError in refusals


@pytest.mark.parametrize("op", ["cumsum", "cumprod"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_float32_scans_accumulate_in_double_as_cpu(op, dtype):
    # ATen's CPU scan keeps its running value in acc_type<float> = double.
    cases = [
        torch.tensor([3e7, 1.0, 1.0, 1.0, 1.0, -3e7]),
        torch.tensor([1.0, 1e-3, -1.0]),
        torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 1e3,
        1 + torch.randn(64, generator=torch.Generator().manual_seed(1)) * 1e-3,
    ]
    for x in cases:
        x = x.to(dtype)
        want = getattr(torch, op)(x, -1)
        got = getattr(torch, op)(x.to("tpu"), -1).cpu()
        assert got.dtype == want.dtype
        assert torch.equal(got, want), (x, got, want)
    assert torch.cumsum(cases[0].to("tpu"), 0)[-1].item() == 4.0


@pytest.mark.parametrize("op", ["cumsum", "cumprod"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scan_dtype_rounds_the_input_first(op, dtype):
    x = torch.tensor([1.5409961, -1.0845223, -0.7192576, 0.4, 1.3])
    want = getattr(torch, op)(x, 0, dtype=dtype)
    got = getattr(torch, op)(x.to("tpu"), 0, dtype=dtype).cpu()
    assert got.dtype == dtype and torch.equal(got, want)
