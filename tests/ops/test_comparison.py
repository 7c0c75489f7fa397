"""Comparisons (torchjax/ops/comparison.py): elementwise comparisons, min/max, clamp and
where, equal / isclose / allclose; and the ``<<``/``>>`` dunders
(torchjax/ops/pointwise_binary.py), compared with CPU torch."""

import pytest
import torch

import torchjax
from tests.ops.opinfo_cases import make_tests

OPS = [
    "equal",
    "allclose",
    "isclose",
    "maximum",
    "minimum",
    "fmax",
    "fmin",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "clamp",
    "clamp_min",
    "clamp_max",
    "where",
]
globals().update(make_tests(OPS))

NAN, INF = float("nan"), float("inf")


def _tpu(t):
    return t.to("tpu")


@pytest.mark.parametrize(
    "a,b",
    [
        (torch.arange(6.0), torch.arange(6.0)),
        (torch.arange(6.0), torch.arange(6.0).reshape(2, 3)),
        (torch.ones(2, 3), torch.ones(3, 2)),
        (torch.ones(0), torch.ones(0)),
        (torch.ones(0), torch.ones(0, 1)),
        (torch.tensor([1.0, NAN]), torch.tensor([1.0, NAN])),
        (torch.arange(3), torch.arange(3.0)),
        (torch.tensor(2**40 + 1), torch.tensor(2**40)),
        (torch.tensor(3.0), torch.tensor(3.0)),
    ],
)
def test_equal_matches_cpu(a, b):
    got = torch.equal(_tpu(a), _tpu(b))
    assert type(got) is bool
    assert got == torch.equal(a, b)


def test_equal_on_views():
    base = torch.arange(12).reshape(3, 4)
    t = _tpu(base)
    assert torch.equal(t.t(), _tpu(base.t().contiguous()))
    assert not torch.equal(t[:, 1:], _tpu(base[:, :3]))


@pytest.mark.parametrize("equal_nan", [False, True])
@pytest.mark.parametrize(
    "a,b,rtol,atol",
    [
        (
            torch.tensor([1.0, NAN, INF, -INF, INF]),
            torch.tensor([1.0, NAN, INF, INF, 1.0]),
            1e-5,
            1e-8,
        ),
        (torch.tensor([1.0, 1.001, 2.0]), torch.tensor([1.0, 1.0, 2.1]), 1e-2, 0.0),
        (torch.tensor([1.0, 1.001]), torch.tensor([1.0, 1.0]), 0.0, 0.0),
        (
            torch.tensor([[1.0], [2.0]], dtype=torch.float64),
            torch.tensor([1.0, 2.0], dtype=torch.float64),
            1e-5,
            1e-8,
        ),
        (torch.tensor([0, 5, 2**40]), torch.tensor([1, 5, 2**40 + 1]), 0.0, 1.0),
        (
            torch.tensor([3, 250], dtype=torch.uint8),
            torch.tensor([4, 2], dtype=torch.uint8),
            0.0,
            1.0,
        ),
        (torch.tensor([True, False]), torch.tensor([True, True]), 1e-5, 1e-8),
        (torch.ones(0), torch.ones(0), 1e-5, 1e-8),
    ],
)
def test_isclose_allclose_match_cpu(a, b, rtol, atol, equal_nan):
    kw = dict(rtol=rtol, atol=atol, equal_nan=equal_nan)
    got = torch.isclose(_tpu(a), _tpu(b), **kw)
    want = torch.isclose(a, b, **kw)
    assert got.dtype == torch.bool
    assert torch.equal(got.cpu(), want)
    all_got = torch.allclose(_tpu(a), _tpu(b), **kw)
    assert type(all_got) is bool and all_got == torch.allclose(a, b, **kw)


@pytest.mark.parametrize(
    "a,b,kw,match",
    [
        (torch.arange(3), torch.arange(3.0), {}, "aten::allclose: .*did not match"),
        (torch.ones(3), torch.ones(2), {}, "aten::allclose: The size of tensor a"),
        (torch.ones(3), torch.ones(3), {"rtol": -1.0}, "aten::allclose: rtol must be"),
        (torch.ones(3), torch.ones(3), {"atol": -1.0}, "aten::allclose: atol must be"),
    ],
)
def test_allclose_errors(a, b, kw, match):
    with pytest.raises(RuntimeError):
        torch.allclose(a, b, **kw)
    with pytest.raises(RuntimeError, match=match):
        torch.allclose(_tpu(a), _tpu(b), **kw)


def test_equal_cpu_tensor_raises():
    with pytest.raises(RuntimeError, match="aten::equal"):
        torch.equal(_tpu(torch.ones(3)), torch.ones(3))


# ---------------------------------------------------------------------------------------
# << and >> (aten::__lshift__ / __rshift__ / __ilshift__ / __irshift__)

_SHIFT_INPUTS = [
    torch.tensor([0, 1, -8, 2**40, -(2**40), 2**62]),
    torch.tensor([0, 1, -8, 2**30, -(2**31)], dtype=torch.int32),
    torch.tensor([1, 3, 128, 255], dtype=torch.uint8),
]


@pytest.mark.parametrize("x", _SHIFT_INPUTS, ids=lambda t: str(t.dtype))
@pytest.mark.parametrize("s", [0, 1, 7, 31, 40, 63, 64, 70, -1])
def test_shift_scalar(x, s):
    for fn in (lambda a: a << s, lambda a: a >> s):
        want = fn(x)
        got = fn(_tpu(x))
        assert got.dtype == want.dtype
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("x", _SHIFT_INPUTS, ids=lambda t: str(t.dtype))
def test_shift_tensor_and_inplace(x):
    s = torch.tensor([0, 1, 3, 33, 40, 64][: x.numel()] + [2] * max(0, x.numel() - 6))
    s = s[: x.numel()].to(x.dtype if x.dtype != torch.uint8 else torch.uint8)
    for fn in (lambda a, b: a << b, lambda a, b: a >> b):
        want = fn(x, s)
        got = fn(_tpu(x), _tpu(s))
        assert got.dtype == want.dtype
        assert torch.equal(got.cpu(), want)
    for shift in (3, s):
        want, got = x.clone(), _tpu(x)
        want <<= shift
        got <<= shift if isinstance(shift, int) else _tpu(shift)
        assert torch.equal(got.cpu(), want)
        want >>= shift
        got >>= shift if isinstance(shift, int) else _tpu(shift)
        assert torch.equal(got.cpu(), want)


def test_shift_inplace_on_view():
    base = torch.arange(10).reshape(2, 5) * (2**33)
    want, got = base.clone(), _tpu(base)
    wv, gv = want[:, 1:4], got[:, 1:4]
    wv >>= 2
    gv >>= 2
    want[1] <<= 3
    got[1] <<= 3
    assert torch.equal(got.cpu(), want)


def test_shift_broadcast_and_0d():
    x, s = torch.arange(6).reshape(2, 3), torch.tensor([[1], [40]])
    assert torch.equal((_tpu(x) << _tpu(s)).cpu(), x << s)
    assert torch.equal((_tpu(torch.tensor(5)) >> 1).cpu(), torch.tensor(5) >> 1)


def test_shift_float_raises():
    # CPU's text: the shift kernels refuse the dtype ("lshift_cpu" ... 'Float')
    for shift in (lambda t: t << 1, lambda t: t >> 1):
        with pytest.raises(NotImplementedError) as cpu:
            shift(torch.ones(3))
        with pytest.raises(NotImplementedError) as tpu:
            shift(_tpu(torch.ones(3)))
        assert str(tpu.value).split(" (in aten::")[0] == str(cpu.value)


@pytest.mark.parametrize(
    "fn", [torch.maximum, torch.minimum, torch.max, torch.min, torch.fmax, torch.fmin]
)
def test_complex_min_max_are_refused_as_on_cpu(fn):
    c = torch.ones(2, dtype=torch.cfloat)
    with pytest.raises(RuntimeError) as cpu_error:
        fn(c, c)
    with pytest.raises(RuntimeError) as tpu_error:
        fn(c.to("tpu"), c.to("tpu"))
    assert str(tpu_error.value).startswith(str(cpu_error.value))


def test_heaviside_values_and_mixed_dtypes():
    x = torch.tensor([-1.0, 0.0, 2.0, float("nan")])
    v = torch.tensor([0.5, 0.5, 0.5, 0.5])
    assert torch.equal(torch.heaviside(x.to("tpu"), v.to("tpu")).cpu(), torch.heaviside(x, v))
    i = torch.tensor([0, 2, -1])
    assert torch.equal(torch.heaviside(i.to("tpu"), i.to("tpu")).cpu(), torch.heaviside(i, i))
    with pytest.raises(RuntimeError, match="heaviside is not yet implemented for tensors with"):
        torch.heaviside(x, v.double())
    with pytest.raises(RuntimeError, match="heaviside is not yet implemented for tensors with"):
        torch.heaviside(x.to("tpu"), v.double().to("tpu"))


_SIGNED_ZEROS = [0.0, -0.0, 1.0, -1.0, float("nan"), float("inf")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", [6, 48])
def test_clamp_to_a_number_keeps_self_where_equal(size, dtype):
    # CPU's kernels for a number bound keep self where it equals the bound, so the sign
    # of a zero survives clamp(0.0, max=-0.0); XLA's max/min choose by sign.
    x = torch.tensor((_SIGNED_ZEROS * 8)[:size], dtype=dtype)
    calls = [
        lambda t: torch.clamp(t, max=-0.0),
        lambda t: torch.clamp(t, min=0.0),
        lambda t: torch.clamp(t, min=-0.0, max=0.0),
        lambda t: torch.clamp_min(t, 0.0),
        lambda t: torch.clamp_max(t, -0.0),
        lambda t: t.clone().clamp_(min=0.0),
        lambda t: torch.clamp(t, min=float("nan")),
    ]
    for call in calls:
        want, got = call(x), call(x.to("tpu")).cpu()
        assert torch.equal(want.isnan(), got.isnan())
        numbers = ~want.isnan()
        assert torch.equal(want[numbers], got[numbers])
        assert torch.equal(want[numbers].signbit(), got[numbers].signbit())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_clamp_to_a_tensor_keeps_the_bound_where_equal(dtype):
    # CPU's vector loop keeps the bound (64 elements: no scalar tail on any vector width).
    x = torch.tensor((_SIGNED_ZEROS * 11)[:64], dtype=dtype)
    calls = [
        lambda t, b: torch.clamp(t, min=b),
        lambda t, b: torch.clamp(t, max=b),
        lambda t, b: torch.clamp_min(t, b),
        lambda t, b: torch.clamp_max(t, b),
    ]
    for zero in (0.0, -0.0):
        bound = torch.full_like(x, zero)
        for call in calls:
            want, got = call(x, bound), call(x.to("tpu"), bound.to("tpu")).cpu()
            numbers = ~want.isnan()
            assert torch.equal(want.isnan(), got.isnan())
            assert torch.equal(want[numbers].signbit(), got[numbers].signbit())
            assert torch.equal(want[numbers], got[numbers])


@pytest.mark.parametrize(
    "call",
    [
        lambda x: torch.clamp(x, min=0),
        lambda x: torch.clamp(x, min=x),
        lambda x: torch.clamp_min(x, 0),
        lambda x: torch.clamp_max(x, x),
        lambda x: x.clamp_(max=1),
    ],
)
def test_clamp_of_complex_refuses_as_cpu(call):
    x = torch.tensor([1 + 1j])
    with pytest.raises(NotImplementedError) as want:
        call(x)
    with pytest.raises(NotImplementedError) as got:
        call(x.to("tpu"))
    assert str(got.value).startswith(str(want.value))


_CLAMP_OUTPUT_REFUSALS = {
    "clamp_min_": lambda t, f: t.clamp_min_(0.5),
    "clamp_max_": lambda t, f: t.clamp_max_(0.5),
    "clamp_": lambda t, f: t.clamp_(0.5),
    "clamp_max_only": lambda t, f: t.clamp_(max=0.5),
    "clamp_min_and_max": lambda t, f: t.clamp_(-1, 0.5),
    "clamp_complex_bound": lambda t, f: t.clamp_(1j),
    "clamp_out": lambda t, f: torch.clamp(f, 0.5, out=t),
    "clamp_min_out": lambda t, f: torch.clamp_min(f, 0.5, out=t),
    "clamp_max_out": lambda t, f: torch.clamp_max(t, 0.5, out=t.clone()),
}


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize(
    "dtype", [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64], ids=str
)
@pytest.mark.parametrize("name", sorted(_CLAMP_OUTPUT_REFUSALS))
def test_clamp_to_numbers_refuses_an_output_type_as_cpu(name, dtype, mode):
    # An in-place clamp of an integer tensor by a float bound names the C++ type ("bool",
    # "long int"), as CPU's meta function prints it; an out= tensor needs the result type.
    fn = _CLAMP_OUTPUT_REFUSALS[name]
    t, f = torch.ones(2, dtype=dtype), torch.ones(2)
    with pytest.raises(RuntimeError) as cpu:
        fn(t, f)
    with pytest.raises(RuntimeError) as got:
        (torchjax.jit(fn) if mode == "jit" else fn)(t.to("tpu"), f.to("tpu"))
    assert str(got.value) == str(cpu.value)


def test_clamp_out_of_another_float_type_refused_as_cpu():
    x = torch.tensor([0.25, 2.0])
    for out_dtype in (torch.float16, torch.float64):
        with pytest.raises(RuntimeError) as cpu:
            torch.clamp(x, 0.5, out=torch.empty(2, dtype=out_dtype))
        with pytest.raises(RuntimeError) as got:
            torch.clamp(x.to("tpu"), 0.5, out=torch.empty(2, dtype=out_dtype, device="tpu"))
        assert str(got.value) == str(cpu.value)
    # a tensor bound casts into out=, as on CPU
    out = torch.empty(2, dtype=torch.float16, device="tpu")
    torch.clamp(x.to("tpu"), torch.tensor(0.5).to("tpu"), out=out)
    want = torch.clamp(x, torch.tensor(0.5), out=torch.empty(2, dtype=torch.float16))
    assert torch.equal(out.cpu(), want)


# isin runs as torch's decomposition, which took bool and complex inputs CPU refuses.
_ISIN_CASES = {
    "bool_both": lambda d: torch.isin(
        torch.tensor([True, False], device=d), torch.tensor([True], device=d)
    ),
    "bool_elements": lambda d: torch.isin(
        torch.tensor([True], device=d), torch.tensor([1], device=d)
    ),
    "bool_test": lambda d: torch.isin(torch.tensor([1], device=d), torch.tensor([True], device=d)),
    "bool_scalar_test": lambda d: torch.isin(torch.tensor([1, 0], device=d), True),
    "bool_scalar_element": lambda d: torch.isin(True, torch.tensor([1], device=d)),
    "complex": lambda d: torch.isin(torch.tensor([1j], device=d), torch.tensor([1j], device=d)),
    "complex_scalar": lambda d: torch.isin(torch.tensor([1.0], device=d), 1j),
    "keywords": lambda d: torch.isin(
        elements=torch.tensor([1], device=d), test_elements=torch.tensor([True], device=d)
    ),
    "float_ok": lambda d: torch.isin(
        torch.tensor([1.0, 2.0], device=d), torch.tensor([2.0], device=d)
    ),
}


@pytest.mark.parametrize("case", sorted(_ISIN_CASES))
def test_isin_refuses_bool_and_complex_as_cpu(case):
    from torchjax.testing.opinfo import same_or_refused

    error = same_or_refused(_ISIN_CASES[case], case)
    assert (error is None) == (case == "float_ok")
    if error is not None:
        with pytest.raises(RuntimeError, match=str(error).replace("(", r"\(").replace(")", r"\)")):
            _ISIN_CASES[case]("tpu")
