"""Tests for torchjax/ops/reduction.py: the OpInfo sweep, then what it misses (int64
past 2**31, dtype rules, empty and 0-d inputs, NaN, ties, errors, out= and views)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests
from torchjax.testing import opinfo as oi

OPS = [
    "sum",
    "mean",
    "nansum",
    "nanmean",
    "prod",
    "amax",
    "amin",
    "max.reduction_no_dim",
    "max.reduction_with_dim",
    "min.reduction_no_dim",
    "min.reduction_with_dim",
    "aminmax",
    "argmax",
    "argmin",
    "var",
    "var.unbiased",
    "std",
    "std.unbiased",
    "var_mean",
    "std_mean",
    "any",
    "all",
    "count_nonzero",
    "logsumexp",
    "linalg.vector_norm",
    "norm",
    "norm.fro",
    "norm.inf",
]
globals().update(make_tests(OPS))

NAN, INF = math.nan, math.inf


same = oi.same


def tpu(*args, **kwargs):
    return torch.tensor(*args, **kwargs).to("tpu")


def test_sum_int64_past_int32():
    x = torch.tensor([2**40, 2**41, -5, 2**62])
    same(torch.sum, x)
    same(torch.prod, torch.tensor([2**20, 2**21, 3]))
    # int32 and bool accumulate in int64, as torch: no wrap-around at 2**31
    same(torch.sum, torch.tensor([2**31 - 1, 2**31 - 1], dtype=torch.int32))
    same(torch.sum, torch.ones(10, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float16])
def test_sum_dtype_argument(dtype):
    x = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    same(lambda t: torch.sum(t, dtype=dtype), x)
    same(lambda t: torch.sum(t, (0, 1), keepdim=True, dtype=dtype), x)
    same(lambda t: torch.prod(t + 1, 1, dtype=dtype), x)
    same(lambda t: torch.mean(t, 1, dtype=torch.float64), x)


def test_dim_lists_keepdim_negative():
    x = torch.randn(2, 3, 4, 5)
    for fn in (torch.sum, torch.mean, torch.amax, torch.amin, torch.nansum, torch.logsumexp):
        same(lambda t, fn=fn: fn(t, (-1, 1), keepdim=True), x)
        same(lambda t, fn=fn: fn(t, [0, 3]), x)
    same(lambda t: torch.var(t, (0, -1), correction=0, keepdim=True), x)
    same(lambda t: torch.std_mean(t, [1, 2], correction=2), x)
    same(lambda t: torch.count_nonzero(t > 0, (0, 2)), x)


def test_duplicate_and_out_of_range_dims():
    x = tpu([[1.0, 2.0]])
    with pytest.raises(RuntimeError, match="appears multiple times"):
        torch.sum(x, (0, 0))
    with pytest.raises(IndexError, match="Dimension out of range"):
        torch.sum(x, 2)


def test_mean_of_integers_raises():
    with pytest.raises(RuntimeError, match="aten::mean.*Long|could not infer output dtype"):
        torch.mean(tpu([1, 2, 3]))
    with pytest.raises(RuntimeError, match="std and var only support floating point"):
        torch.var(tpu([1, 2, 3]))
    with pytest.raises(RuntimeError, match="linalg.vector_norm.*Long"):
        torch.linalg.vector_norm(tpu([1, 2, 3]))


def test_empty_reductions():
    e = torch.empty(0, 3)
    same(torch.sum, e)
    same(lambda t: torch.sum(t, 0), e)
    same(lambda t: torch.prod(t, 0), e)
    same(lambda t: torch.mean(t, 0), e)
    same(lambda t: torch.count_nonzero(t, 0), e)
    same(lambda t: torch.any(t, 0), e)
    same(lambda t: torch.all(t, 0), e)
    same(lambda t: torch.logsumexp(t, 0), e)
    same(lambda t: torch.amax(t, 1), e)  # reducing a non-empty dim of an empty tensor
    same(lambda t: torch.max(t, 1), e)


def test_empty_reductions_without_identity_raise():
    e = torch.empty(0, 3).to("tpu")
    with pytest.raises(IndexError, match=r"amax\(\): Expected reduction dim 0.*aten::amax"):
        torch.amax(e, 0)
    with pytest.raises(RuntimeError, match=r"Expected reduction dim to be specified.*aten::amax"):
        torch.amax(e)
    with pytest.raises(RuntimeError, match="aten::max"):
        torch.max(e)
    with pytest.raises(IndexError, match="aten::min"):
        torch.min(e, 0)
    with pytest.raises(IndexError, match="aten::argmax"):
        torch.argmax(e)
    with pytest.raises(IndexError, match="aten::argmin"):
        torch.argmin(e, 0)
    with pytest.raises(RuntimeError, match="aten::aminmax"):
        torch.aminmax(e)
    with pytest.raises(RuntimeError, match="inf norm on an empty tensor"):
        torch.linalg.vector_norm(e, INF)


def test_zero_dim():
    s = torch.tensor(2.5)
    for fn in (
        torch.sum,
        torch.mean,
        torch.amax,
        torch.max,
        torch.argmax,
        torch.logsumexp,
        torch.prod,
        torch.any,
        torch.count_nonzero,
    ):
        same(lambda t, fn=fn: fn(t, 0) if fn is not torch.count_nonzero else fn(t), s)
    same(lambda t: torch.max(t, -1, keepdim=True), s)
    same(lambda t: torch.argmin(t, 0, keepdim=True), s)
    same(lambda t: torch.aminmax(t, dim=0), s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        same(torch.var, s)


def test_nan_propagation_and_first_nan_index():
    x = torch.tensor([[1.0, NAN, 3.0, NAN], [4.0, 2.0, 0.0, -1.0]])
    for fn in (torch.amax, torch.amin, torch.sum, torch.mean, torch.nansum, torch.logsumexp):
        same(lambda t, fn=fn: fn(t, 1), x)
    same(torch.max, x)
    same(torch.min, x)
    same(lambda t: torch.max(t, 1), x)
    same(lambda t: torch.min(t, 1), x)
    same(lambda t: torch.argmax(t, 1), x)
    same(lambda t: torch.argmin(t, 1), x)
    same(torch.argmax, x)
    same(lambda t: torch.aminmax(t, dim=1), x)
    same(torch.nanmean, x)


def test_argmax_ties_pick_first():
    x = torch.tensor([[3, 1, 3, 3], [0, 0, 0, 0]])
    same(lambda t: torch.argmax(t, 1), x)
    same(lambda t: torch.argmin(t, 1), x)
    same(lambda t: torch.max(t, 1), x)
    same(lambda t: torch.min(t, 0), x)
    same(lambda t: torch.argmax(t, keepdim=True), x)
    with pytest.raises(RuntimeError, match="aten::argmax"):
        torch.argmax(x.bool().to("tpu"))  # as torch


def test_max_dim_named_tuple():
    x = tpu([[1.0, 5.0], [7.0, 2.0]])
    r = torch.max(x, 1)
    assert isinstance(r, torch.return_types.max)
    assert r.values.device.type == "tpu" and r.indices.dtype == torch.int64
    assert r.indices.cpu().tolist() == [1, 0]
    assert isinstance(torch.aminmax(x), torch.return_types.aminmax)


def test_any_all_dtypes_and_dims():
    x = torch.tensor([[0, 3], [0, 0]], dtype=torch.uint8)
    same(torch.any, x)  # uint8 in, uint8 out
    same(lambda t: torch.all(t, 1), x)
    same(lambda t: torch.any(t, (0, 1)), x.float())
    same(lambda t: torch.ops.aten.any.dims(t, []), x.bool())  # [] reduces nothing
    same(lambda t: torch.ops.aten.all.dims(t, None), x.bool())


def test_is_all_true_is_any_true():
    for op in (torch.ops.aten._is_all_true, torch.ops.aten._is_any_true):
        for x in (
            torch.tensor([True, False]),
            torch.ones(2, 3, dtype=torch.bool),
            torch.zeros(4, dtype=torch.bool),
            torch.tensor(True),
            torch.tensor([], dtype=torch.bool),  # all: True, any: False
        ):
            got = same(op, x)
            assert got.shape == () and got.dtype == torch.bool
        # torch asserts a bool input (RuntimeError); so do we, naming the op.
        with pytest.raises(RuntimeError, match=f"aten::{op.__name__}: expected a bool tensor"):
            op(torch.tensor([1, 0], device="tpu"))


def test_var_std_corrections():
    x = torch.randn(4, 6, dtype=torch.float64)
    for c in (0, 1, 2, 3.5):
        same(lambda t, c=c: torch.var(t, 1, correction=c), x)
        same(lambda t, c=c: torch.std(t, correction=c, keepdim=True), x)
        same(lambda t, c=c: torch.var_mean(t, 0, correction=c), x)
    same(lambda t: torch.var(t, 1), torch.randn(3, 4, dtype=torch.complex64))
    with pytest.warns(UserWarning, match="degrees of freedom"):
        torch.var(tpu([1.0, 2.0]), correction=2)


@pytest.mark.parametrize("ord", [0, 1, 2, 3.5, -1, -2.5, INF, -INF])
def test_vector_norm_orders(ord):
    x = torch.tensor([[3.0, 0.0, -4.0], [1.0, 2.0, 0.5]])
    same(lambda t: torch.linalg.vector_norm(t, ord), x)
    same(lambda t: torch.linalg.vector_norm(t, ord, dim=1, keepdim=True), x)
    same(lambda t: torch.linalg.vector_norm(t, ord, dtype=torch.float64), x)
    same(lambda t: torch.linalg.vector_norm(t, ord), x.to(torch.complex64))


def test_logsumexp_infinities_and_ints():
    x = torch.tensor([[-INF, -INF], [INF, 1.0], [-INF, 0.0], [INF, INF]])
    same(lambda t: torch.logsumexp(t, 1), x)
    same(lambda t: torch.logsumexp(t, 0), torch.tensor([1, 2, 3]))
    same(lambda t: torch.logsumexp(t, 0), torch.tensor([True, False]))


def test_out_variants():
    x = torch.randn(3, 4)
    out = torch.empty(0).to("tpu")
    r = torch.sum(x.to("tpu"), 1, out=out)
    assert r is out
    oi.compare(out, torch.sum(x, 1))
    v, i = torch.empty(0).to("tpu"), torch.empty(0, dtype=torch.long).to("tpu")
    r = torch.max(x.to("tpu"), 0, out=(v, i))
    expected = torch.max(x, 0)
    oi.compare((v, i), (expected.values, expected.indices))
    lo, hi = torch.empty(0).to("tpu"), torch.empty(0).to("tpu")
    torch.aminmax(x.to("tpu"), dim=1, out=(lo, hi))
    oi.compare((lo, hi), tuple(torch.aminmax(x, dim=1)))
    # int -> float out: the out dtype decides, as torch
    ints = torch.arange(6).reshape(2, 3)
    fout = torch.empty(2).to("tpu")
    torch.sum(ints.to("tpu"), 1, out=fout)
    oi.compare(fout, torch.sum(ints, 1, out=torch.empty(2)))


def test_out_into_a_view_and_reduce_a_view():
    x = torch.randn(4, 5)
    buf = torch.zeros(3, 5).to("tpu")
    torch.sum(x.to("tpu"), 0, out=buf[1])
    expected = torch.zeros(3, 5)
    expected[1] = x.sum(0)
    oi.compare(buf, expected)
    same(lambda t: t.t()[1:].amax(0), x)
    same(lambda t: t[:, ::2].var(1), x)


@pytest.mark.parametrize("op", ["sum", "nansum"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reduction_dtype_rounds_the_input_first(op, dtype):
    # CPU converts the input to dtype= before reducing: a float64 or float32 input is
    # rounded to the half type element by element, then added in float32. (A float32
    # sum's order of additions is the machine's: compared to the last bits only.)
    for src in (torch.float32, torch.float64):
        x = torch.tensor([1.5409961, -1.0845223, -0.7192576, 0.3, 1.1], dtype=src)
        want = getattr(torch, op)(x, 0, dtype=dtype)
        got = getattr(torch, op)(x.to("tpu"), 0, dtype=dtype).cpu()
        assert got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=4e-7, atol=0)
        else:
            assert torch.equal(got, want), (src, got, want)
    x = torch.tensor([1.5409961, -1.0845223, -0.7192576])
    if op == "sum" and dtype == torch.bfloat16:
        assert torch.sum(x.to("tpu"), 0, dtype=dtype).item() == -0.265625


_OUT_DTYPE_CASES = [
    ("sum", lambda x, o: torch.sum(x, 1, out=o), torch.int64),
    ("prod", lambda x, o: torch.prod(x, 1, out=o), torch.int64),
    ("sum", lambda x, o: torch.sum(x, 1, out=o), torch.float64),
    ("nansum", lambda x, o: torch.nansum(x, 1, out=o), torch.float64),
    ("mean", lambda x, o: torch.mean(x, 1, out=o), torch.float64),
    ("sum", lambda x, o: torch.sum(x, 1, out=o), torch.bfloat16),
]


@pytest.mark.parametrize("name, call, out_dtype", _OUT_DTYPE_CASES)
def test_out_dtype_is_the_reductions_dtype(name, call, out_dtype):
    # ATen reads the out tensor's dtype as dtype= (infer_dtype_from_optional): an int64
    # out truncates each element before adding, a float64 out adds in float64.
    x = torch.tensor([[0.6, -0.7, -1.2, 1e-8], [1.5, 2.5, 0.9, -1.0], [1.0, 1e-8, -1.0, 0.0]])
    want = torch.zeros(3, dtype=out_dtype)
    call(x, want)
    got = torch.zeros(3, dtype=out_dtype, device="tpu")
    call(x.to("tpu"), got)
    assert torch.equal(got.cpu(), want), (got, want)


@pytest.mark.parametrize("out_dtype", [torch.int64, torch.float64])
@pytest.mark.parametrize("op", ["cumsum", "cumprod"])
def test_scan_out_dtype_is_the_scans_dtype(op, out_dtype):
    x = torch.tensor([[0.6, -0.7, -1.2], [1.5, 2.5, 0.9], [1.0, 1e-8, -1.0]])
    want = torch.zeros(3, 3, dtype=out_dtype)
    getattr(torch, op)(x, 1, out=want)
    got = torch.zeros(3, 3, dtype=out_dtype, device="tpu")
    getattr(torch, op)(x.to("tpu"), 1, out=got)
    assert torch.equal(got.cpu(), want)


def test_nansum_of_floats_into_an_integer_out_refuses_as_cpu():
    for d in ("cpu", "tpu"):
        out = torch.empty((), dtype=torch.long, device=d)
        with pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
            torch.nansum(torch.tensor([1.0, 2.0], device=d), 0, out=out)
    out = torch.empty((), dtype=torch.long, device="tpu")
    torch.nansum(torch.tensor([1, 2], device="tpu"), 0, out=out)
    assert out.item() == 3


def test_reductions_over_a_dim_of_more_than_64_dims_raise_as_cpu():
    # torch keeps the reduced dims in a 64-bit mask: a dim given on a 65-dim tensor is
    # refused (argmax, max.dim and hash_tensor included), a full reduction is not.
    cpu = torch.randn([1] * 64 + [2])
    x = cpu.to("tpu")  # NumPy holds at most 64 dims: the transfer goes flat
    assert x.shape == cpu.shape
    back = x.cpu()  # and back
    assert back.shape == cpu.shape and torch.equal(back, cpu) and x.tolist() == cpu.tolist()
    assert x[..., 1:].item() == cpu[..., 1:].item()
    ops = {
        "sum": lambda t: torch.sum(t, 0),
        "argmax": lambda t: torch.argmax(t, 0),
        "argmin": lambda t: torch.argmin(t, 1),
        "max.dim": lambda t: torch.max(t, 0),
        "hash_tensor": lambda t: torch.hash_tensor(t, dim=0),
    }
    for op in ops.values():
        for t in (cpu, x):  # both devices refuse each
            with pytest.raises(RuntimeError, match="only tensors with up to 64 dims are supported"):
                op(t)
    for full in (torch.sum, torch.amax, torch.mean):
        torch.testing.assert_close(full(x).cpu(), full(cpu))
