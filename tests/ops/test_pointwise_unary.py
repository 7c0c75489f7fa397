"""OpInfo sweep and direct tests for torchjax/ops/pointwise_unary.py."""

import math

import pytest
import torch

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests

OPS = [
    "abs",
    "neg",
    "sign",
    "sgn",
    "exp",
    "exp2",
    "expm1",
    "log",
    "log2",
    "log10",
    "log1p",
    "sqrt",
    "rsqrt",
    "reciprocal",
    "sin",
    "cos",
    "tan",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "tanh",
    "asinh",
    "acosh",
    "atanh",
    "erf",
    "erfc",
    "erfinv",
    "floor",
    "ceil",
    "round",
    "round.decimals_0",
    "round.decimals_3",
    "round.decimals_neg_3",
    "trunc",
    "frac",
    "sigmoid",
    "logit",
    "isnan",
    "isinf",
    "isfinite",
    "isposinf",
    "isneginf",
    "nan_to_num",
    "signbit",
    "square",
    "bitwise_not",
    "logical_not",
    "lgamma",
    "digamma",
    "i0",
    "special.i0e",
    "special.i1",
    "special.i1e",
    "special.ndtri",
    "special.erfcx",
    "deg2rad",
    "rad2deg",
    "positive",
    "polygamma.polygamma_n_0",
    "polygamma.polygamma_n_1",
    "polygamma.polygamma_n_2",
    "sinc",
    "special.entr",
    "special.ndtr",
    "special.log_ndtr",
    "isreal",
    "mvlgamma.mvlgamma_p_1",
]
globals().update(make_tests(OPS))


def tpu(t):
    return t.to("tpu")


def test_round_half_to_even():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 1.25, 2.675])
    torch.testing.assert_close(torch.round(tpu(x)).cpu(), torch.round(x))
    torch.testing.assert_close(torch.round(tpu(x), decimals=1).cpu(), torch.round(x, decimals=1))


def test_nan_inf_predicates():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0])
    for fn in (
        torch.isnan,
        torch.isinf,
        torch.isfinite,
        torch.isposinf,
        torch.isneginf,
        torch.signbit,
        torch.nan_to_num,
    ):
        torch.testing.assert_close(fn(tpu(x)).cpu(), fn(x), equal_nan=True)
    got = torch.nan_to_num(tpu(x), nan=1.0, posinf=2.0, neginf=-2.0).cpu()
    torch.testing.assert_close(got, torch.nan_to_num(x, nan=1.0, posinf=2.0, neginf=-2.0))


def test_int_inputs():
    x = torch.tensor([2**40 + 1, -3, 0], dtype=torch.int64)
    for fn in (
        torch.floor,
        torch.ceil,
        torch.round,
        torch.trunc,
        torch.abs,
        torch.neg,
        torch.sign,
        torch.bitwise_not,
        torch.logical_not,
        torch.isnan,
    ):
        torch.testing.assert_close(fn(tpu(x)).cpu(), fn(x))
    assert torch.exp(tpu(x[1:])).dtype == torch.float32


def test_empty_and_zero_dim():
    for x in (torch.empty(0, 3), torch.tensor(0.3)):
        for fn in (torch.exp, torch.sigmoid, torch.isnan, torch.round):
            got = fn(tpu(x))
            assert got.shape == x.shape and got.dtype == fn(x).dtype
            torch.testing.assert_close(got.cpu(), fn(x))


def test_inplace_on_view():
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t = tpu(base)
    t[0].exp_()
    base[0].exp_()
    torch.testing.assert_close(t.cpu(), base)
    t.t().sin_()
    base.t().sin_()
    torch.testing.assert_close(t.cpu(), base)


def test_out_dtype():
    x = torch.tensor([1.0, 4.0])
    out = torch.empty(2, dtype=torch.float64, device="tpu")
    torch.sqrt(tpu(x), out=out)
    torch.testing.assert_close(out.cpu(), torch.sqrt(x).double())
    with pytest.raises(RuntimeError, match="can't be cast"):
        torch.sqrt(tpu(x), out=torch.empty(2, dtype=torch.int64, device="tpu"))


def test_errors():
    b = tpu(torch.tensor([True, False]))
    with pytest.raises(RuntimeError, match="aten::neg"):
        torch.neg(b)
    with pytest.raises(NotImplementedError, match="aten::abs"):
        torch.abs(b)
    with pytest.raises(NotImplementedError, match="aten::bitwise_not"):
        torch.bitwise_not(tpu(torch.tensor([1.0])))


def test_logit_eps_and_grad():
    x = torch.tensor([0.0, 0.3, 0.9, 1.0], dtype=torch.float64, requires_grad=True)
    t = x.detach().to("tpu").requires_grad_()
    torch.logit(t, eps=0.1).sum().backward()
    torch.logit(x, eps=0.1).sum().backward()
    torch.testing.assert_close(t.grad.cpu(), x.grad)
    assert math.isinf(torch.logit(tpu(torch.tensor([1.0]))).item())


@pytest.mark.parametrize("decimals", [1, 2, 3, -1, -2])
def test_round_decimals_bit_for_bit(decimals):
    # The scale division is correctly rounded on CPU (Note [Division by a broadcast
    # divisor]); XLA's reciprocal multiply differed in the last bit.
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 100
    assert torch.equal(x.to("tpu").round(decimals=decimals).cpu(), x.round(decimals=decimals))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", [torch.sign, torch.sgn])
def test_sign_of_nan_and_negative_zero_is_cpus(op, dtype):
    # ATen computes (0 < x) - (x < 0): 0 for NaN, +0.0 for -0.0.
    x = torch.tensor([float("nan"), -0.0, 0.0, -2.5, 3.0, float("-inf")], dtype=dtype)
    want = op(x)
    got = op(x.to("tpu")).cpu()
    assert torch.equal(got, want)
    assert torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
@pytest.mark.parametrize(
    "name", ["sqrt", "rsqrt", "asin", "acos", "acosh", "asinh", "atanh", "atan", "log", "exp"]
)
def test_complex_branch_cuts_follow_the_sign_of_a_zero_imaginary_part(name, dtype):
    # Note [Complex special values]: sqrt(-1 - 0j) is -1j, acosh(-1 - 0j) is
    # -pi j; XLA's gave the other side of the cut.
    re = torch.tensor([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], dtype=torch.float64).repeat(2)
    im = torch.tensor([-0.0] * 6 + [0.0] * 6, dtype=torch.float64)
    z = torch.complex(re, im).to(dtype)
    fn = getattr(torch, name)
    torch.testing.assert_close(fn(z.to("tpu")).cpu(), fn(z))


def test_abs_of_unsigned_integers_is_the_input():
    x = torch.tensor([0, 5, 128, 255], dtype=torch.uint8)
    got = torch.abs(x.to("tpu"))
    assert got.dtype == torch.uint8 and torch.equal(got.cpu(), x)
    assert torch.equal(x.to("tpu").abs_().cpu(), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_rsqrt_is_atens_one_over_sqrt_bit_for_bit(dtype):
    # XLA's rsqrt differed from CPU's 1/sqrt in the last bit of a third of the results.
    x = torch.rand(20000, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    x = (x * 100 + 0.01).to(dtype)
    assert torch.equal(torch.rsqrt(x.to("tpu")).cpu(), torch.rsqrt(x))
    assert torch.equal((x.to("tpu") ** -0.5).cpu(), x**-0.5)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_abs_of_infinite_and_nan_parts_as_cpu(dtype):
    # An infinite part makes |z| infinite even beside a NaN (C99 hypot); XLA gave NaN.
    inf, nan = float("inf"), float("nan")
    parts = (inf, -inf, nan, 0.0, -2.5)
    z = torch.tensor([complex(a, b) for a in parts for b in parts], dtype=dtype)
    got = torch.abs(z.to("tpu")).cpu()
    torch.testing.assert_close(got, torch.abs(z), equal_nan=True, rtol=0, atol=0)
    assert got.dtype == torch.abs(z).dtype


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_exp_at_infinities_and_nans_as_cpu(dtype):
    # C99 Annex G: exp(-inf + inf j) is 0, exp(inf + nan j) is inf + nan j; XLA gave NaN.
    inf, nan = float("inf"), float("nan")
    parts = (inf, -inf, nan, 0.0, -0.0, 1.5, -2.0)
    z = torch.tensor([complex(a, b) for a in parts for b in parts], dtype=dtype)
    want, got = torch.exp(z), torch.exp(z.to("tpu")).cpu()
    for part in (torch.real, torch.imag):
        w, g = part(want), part(got)
        assert torch.equal(w.isnan(), g.isnan())
        finite = ~w.isnan()
        assert torch.equal(w[finite], g[finite])
        assert torch.equal(w[finite].signbit(), g[finite].signbit())  # signed zeros too
