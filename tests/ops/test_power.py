"""pow (torchjax/ops/power.py): OpInfo sweep, integer powers over every bit of the
exponent, and the exponents ATen special-cases, against CPU torch."""

import pytest
import torch

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests
from tests.ops.test_pointwise_binary import _INT_VALUES, _all_pairs, _same, tpu

OPS = ["pow", "__rpow__"]
globals().update(make_tests(OPS))


def test_int_pow():
    a = torch.tensor([2, -1, 1, 3, -1, 0, 7])
    e = torch.tensor([-1, -3, -2, 2, -2, 3, 21])
    _same(torch.pow(tpu(a), tpu(e)), torch.pow(a, e))
    _same(tpu(a) ** 3, a**3)
    _same(2 ** tpu(e.abs()), 2 ** e.abs())
    with pytest.raises(RuntimeError, match="Integers to negative integer powers"):
        tpu(a) ** -1


_NEGATIVE_POWER_CALLS = {
    "pow": lambda x: x.pow(-2),
    "pow_": lambda x: x.pow_(-1),
    "out": lambda x: torch.pow(x, -2, out=x.clone()),
}


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int64])
@pytest.mark.parametrize("name", sorted(_NEGATIVE_POWER_CALLS))
def test_negative_integer_exponent_of_integers_raises_as_on_cpu(dtype, name):
    call = _NEGATIVE_POWER_CALLS[name]
    # uint8 and bool would wrap -2 to a positive exponent once promoted. A bool out=
    # meets torch's meta kernel first, which refuses the int64 -> bool cast before the
    # exponent (CPU's kernel checks the exponent first): both are RuntimeErrors.
    match = None if (dtype, name) == (torch.bool, "out") else "negative integer powers"
    for dev in ("cpu", "tpu"):
        x = torch.tensor([2, 3], device=dev).to(dtype)
        with pytest.raises(RuntimeError, match=match):
            call(x)
    x = torch.tensor([2, 3], dtype=dtype)
    assert torch.equal(x.to("tpu").pow(torch.tensor(-2)).cpu(), x.pow(torch.tensor(-2)))


@pytest.mark.parametrize("dtype", list(_INT_VALUES), ids=str)
def test_integer_pow_uses_every_bit_of_the_exponent(dtype):
    # XLA's integer power read the low six bits of the exponent (2 ** 64 was 1).
    info = torch.iinfo(dtype)
    bases = [v for v in (info.min, -3, -2, -1, 0, 1, 2, 3, 7, info.max) if v >= info.min]
    exps = [e for e in (0, 1, 2, 5, 31, 63, 64, 65, 127, 129, 255, 300, 2**31 - 1) if e <= info.max]
    base, exp = _all_pairs(dtype, bases, exps)
    assert torch.equal((base.to("tpu") ** exp.to("tpu")).cpu(), base**exp)
    for e in (64, 129):
        if e <= info.max:
            assert torch.equal((base.to("tpu") ** e).cpu(), base**e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("exponent", [2, 3, -2, -1, 2.0, 3.0])
def test_powers_cpu_special_cases_bit_for_bit(exponent, dtype):
    # ATen's pow_tensor_scalar_kernel computes x*x, x*x*x, 1/(x*x), 1/x for these; the
    # general power differed in the last bit of a quarter of the float32 results.
    x = torch.rand(2000, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 6
    x = (x + 0.1).to(dtype)
    want = x**exponent
    got = x.to("tpu") ** exponent
    assert got.dtype == want.dtype and torch.equal(got.cpu(), want)
    inplace = x.to("tpu")
    inplace.pow_(exponent)
    assert torch.equal(inplace.cpu(), want)
    out = torch.empty(0, dtype=dtype, device="tpu")
    torch.pow(x.to("tpu"), exponent, out=out)
    assert torch.equal(out.cpu(), want)


def test_complex_square_is_a_product_not_the_polar_form():
    z = torch.tensor([2j, -1 + 0j, 3 - 4j, 0.5 - 2j], dtype=torch.complex128)
    assert torch.equal(torch.square(z.to("tpu")).cpu(), torch.square(z))
    assert torch.equal((z.to("tpu") ** 3).cpu(), z**3)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.int32], ids=str
)
@pytest.mark.parametrize("exponent", [65519.0, 1e39, 300, 2.5], ids=repr)
def test_exponent_that_does_not_fit_a_half_tensor_raises_as_cpu(dtype, exponent):
    # CPU's half kernels read the exponent as the tensor's type (checked); float32 and
    # float64 ones read a double, integer ones check integers only.
    def outcome(x):
        try:
            return torch.pow(x, exponent).dtype
        except RuntimeError as e:
            return type(e), str(e).split(" (in aten::")[0]

    x = torch.ones(2, dtype=dtype)
    assert outcome(x.to("tpu")) == outcome(x)
