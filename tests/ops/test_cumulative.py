"""Tests for torchjax/ops/cumulative.py: the OpInfo sweep, then int64 past 2**31, dtype
rules, NaN and ties in cummax/cummin, infinities in logcumsumexp, 0-d/empty, out= and
in-place on views, and the integer scans' form by platform."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
import torch

import torchjax
from tests.ops.opinfo_cases import make_tests
from torchjax.ops import cumulative, executables
from torchjax.tensor import _shadows
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


# Integer scans by platform (Note [Integer scans by platform]). CI has no TPU: the
# lowering is read for "tpu" on CPU, and the torch-level checks run the TPU entry under
# this backend's key.


def _lowered(fn, x, platform):
    from tests.pallas.test_lowering import _TPU

    with jax.sharding.use_abstract_mesh(_TPU), jax.enable_x64(True):
        return jax.jit(fn).trace(x).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("op", ["cumsum", "cumprod"])
@pytest.mark.parametrize("dtype", [jnp.int64, jnp.int32, jnp.uint8, jnp.bool_, jnp.float32])
def test_integer_scans_lower_without_reduce_window_on_tpu_only(op, dtype):
    # XLA:TPU is slow to compile reduce_window (lax.cumsum's lowering), 64-bit most.
    with jax.enable_x64(True):
        x = jnp.ones((2, 129), dtype)
    fn = lambda v: getattr(cumulative, op)(v, 1)  # noqa: E731
    integer = dtype != jnp.float32
    assert ("reduce_window" in _lowered(fn, x, "tpu")) == (not integer)
    assert "reduce_window" in _lowered(fn, x, "cpu")
    assert cumulative.INT_SCAN_BY_PLATFORM == {"tpu": "associative"}


def _fresh():
    executables.clear_caches()
    jax.clear_caches()


@pytest.fixture
def tpu_int_scans(monkeypatch):
    """The TPU entry of INT_SCAN_BY_PLATFORM under this backend's key; yields the list of
    scans it traced ("sum"/"prod"). Tensors keep no host values, neither remembered nor
    waiting to be put: a small integer cumsum would run CPU's kernel instead (Note
    [Integer ops on host values])."""
    form = cumulative.INT_SCAN_BY_PLATFORM["tpu"]
    traced = []
    for kind, fn in cumulative._INT_SCANS[form].items():
        spy = lambda x, axis, f=fn, k=kind: traced.append(k) or f(x, axis)  # noqa: E731
        monkeypatch.setitem(cumulative._INT_SCANS[form], kind, spy)
    monkeypatch.setattr(cumulative, "INT_SCAN_BY_PLATFORM", {jax.default_backend(): form})
    monkeypatch.setattr(_shadows, "remember", lambda storage, values: None)
    monkeypatch.setattr(_shadows, "_deferrable", lambda values: False)
    _fresh()  # the form is chosen when the op is traced: trace anew
    torchjax.reset_stats()
    yield traced
    assert torchjax.stats()["host_ops"] == 0
    _fresh()


_INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]


def _full_range(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def _scan_cases(dtype):
    """(input, dim, dtype=) cases: random values over the dtype's range (products and
    narrow sums wrap), lengths 1 to 129 (odd and even levels of the scan), every dim and
    negative ones, dtype= as narrow as int8, 0-d and empty inputs."""
    x = _full_range(dtype, (3, 4, 129), 0)
    cases = [(x, d, None) for d in (0, 1, 2, -1, -3)]
    cases += [(x[:, :, :n], -1, None) for n in (1, 2, 3, 7, 64)]
    cases += [(x, -1, out) for out in (torch.int8, torch.uint8, torch.int16, torch.int32)]
    big = {torch.int64: [2**62, 2**62, -(2**63), 3], torch.int32: [2**31 - 1] * 4}
    if dtype in big:
        cases.append((torch.tensor(big[dtype], dtype=dtype), 0, None))
        cases.append((torch.tensor(big[dtype], dtype=dtype), 0, dtype))
    cases += [(x[0, 0, 0], 0, None), (x[0, 0, 0], -1, dtype)]
    cases += [(x[:, :0], 1, None), (x[:, :0], -1, dtype), (x[:0], 0, None)]
    return cases


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("dtype", _INT_DTYPES, ids=str)
@pytest.mark.parametrize("op", ["cumsum", "cumprod"])
def test_integer_scans_by_the_tpu_form_equal_cpu(tpu_int_scans, op, dtype, mode):
    fn = getattr(torch, op)
    cases = _scan_cases(dtype)
    for x, dim, out_dtype in cases:
        if out_dtype == torch.bool:
            continue
        call = lambda t, d=dim, o=out_dtype: fn(t, d, dtype=o)  # noqa: E731
        want = call(x)
        got = (torchjax.jit(call) if mode == "jit" else call)(x.to("tpu"))
        oi.compare(got, want, f"{op}({tuple(x.shape)}, {dim}, dtype={out_dtype})")
    assert len(cases) >= 19 and op.removeprefix("cum") in tpu_int_scans


@pytest.mark.parametrize("dtype", _INT_DTYPES[:-1], ids=str)
@pytest.mark.parametrize("op", ["cumsum", "cumprod"])
def test_integer_scans_in_place_and_out_take_the_tpu_form(tpu_int_scans, op, dtype):
    x = _full_range(dtype, (4, 33), 1)
    base_cpu, base = x.clone(), x.to("tpu")
    getattr(base_cpu[1:], f"{op}_")(1)
    getattr(base[1:], f"{op}_")(1)
    oi.compare(base, base_cpu, f"{op}_")
    base_cpu.t()[2].__getattribute__(f"{op}_")(0)
    base.t()[2].__getattribute__(f"{op}_")(0)
    oi.compare(base, base_cpu, f"{op}_ on a column")
    for out_dtype in (torch.int64, dtype):
        out_cpu, out = torch.empty(0, dtype=out_dtype), torch.empty(0, dtype=out_dtype).to("tpu")
        want = getattr(torch, op)(x, 0, out=out_cpu)
        assert getattr(torch, op)(x.to("tpu"), 0, out=out) is out
        oi.compare(out, want, f"{op}(out={out_dtype})")
    assert tpu_int_scans.count(op.removeprefix("cum")) >= 3


@pytest.mark.parametrize("op", ["cumsum", "cumprod"])
def test_a_bool_dtype_scan_refuses_as_cpu(op):
    # CPU has no bool kernel for cumsum/cumprod unless there is nothing to scan; JAX's
    # cumsum refused bool with a TypeError, and an associative scan would have computed.
    for shape in [(2, 3), (), (0,), (2, 0)]:
        x = torch.ones(shape, dtype=torch.int8)
        oi.same_or_refused(lambda d, t=x: getattr(torch, op)(t.to(d), -1, dtype=torch.bool), op)
    with pytest.raises(NotImplementedError, match=f'"{op}_out_cpu" not implemented for'):
        getattr(torch, op)(torch.ones(2, 3, device="tpu"), 0, dtype=torch.bool)
