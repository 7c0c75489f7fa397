"""Tests for torchjax/ops/sort.py: the OpInfo sweep, a tie-aware rerun of the samples
whose tie order torch leaves unspecified, then NaN/-0.0 order, stability, selection
edge cases, errors and the unique family."""

from __future__ import annotations

import math

import pytest
import torch

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests
from torchjax.tensor._errors import DataDependentError
from torchjax.testing import opinfo as oi

OPS = [
    "sort",
    "argsort",
    "msort",
    "topk",
    "kthvalue",
    "median",
    "nanmedian",
    "mode",
    "unique",
    "unique_consecutive",
]
globals().update(make_tests(OPS))

NAN, INF = math.nan, math.inf


same = oi.same


# The OpInfo cases xfailed in expected_failures.csv for tied elements: values must match
# CPU exactly, and each index must point at an element equal to its value (for sort and
# argsort: the indices must also be a permutation).
_TIED = [
    ("sort", torch.bfloat16),
    ("sort", torch.float16),
    ("sort", torch.bool),
    ("argsort", torch.bfloat16),
    ("argsort", torch.float16),
    ("argsort", torch.bool),
    ("topk", torch.bfloat16),
    ("topk", torch.int64),
    ("topk", torch.int32),
    ("kthvalue", torch.int64),
    ("kthvalue", torch.int32),
    ("mode", torch.bfloat16),
    ("mode", torch.float16),
    ("mode", torch.int64),
    ("mode", torch.int32),
    ("mode", torch.bool),
]


def _dim_of(name, sample):
    args, kwargs = sample.args, sample.kwargs
    if "dim" in kwargs:
        return kwargs["dim"]
    if name in ("topk", "kthvalue"):
        return args[1] if len(args) > 1 else -1
    if name in ("sort", "argsort", "mode"):
        return args[0] if args else -1
    raise AssertionError(name)


# The out= cases xfailed for ties (the out= check runs float32 and int64).
_TIED_OUT = [("topk", torch.int64), ("kthvalue", torch.int64)]
_TIED_CASES = [(n, d, False) for n, d in _TIED] + [(n, d, True) for n, d in _TIED_OUT]


def _call_out(fn, s):
    """``fn`` with out= (values and int64 indices, 0-element) on tpu, as the out= check."""
    t = oi.to_tpu(s)
    ref = oi.call(fn, s)
    out = tuple(torch.empty(0, dtype=r.dtype, device="tpu") for r in ref)
    got = fn(t.input, *t.args, **t.kwargs, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    return got


@pytest.mark.parametrize(
    "name,dtype,out",
    _TIED_CASES,
    ids=[f"{n}-{str(d)[6:]}{'-out' if o else ''}" for n, d, o in _TIED_CASES],
)
def test_tied_samples_by_gather(name, dtype, out):
    op = oi.opinfos([name])[0]
    fn = op.get_op()
    for s in oi.samples(op, dtype):
        x = s.input
        expected = oi.call(fn, s)
        got = _call_out(fn, s) if out else oi.call(fn, oi.to_tpu(s))
        dim = _dim_of(name, s)
        if name == "argsort":
            idx = got.cpu()
            oi.compare(got, expected, name) if x.dim() == 0 else None
            values, exp_values = x.gather(dim, idx), x.gather(dim, expected)
        else:
            idx = got.indices.cpu()
            values, exp_values = got.values.cpu(), expected.values
            assert got.indices.dtype == torch.int64
        torch.testing.assert_close(values, exp_values, rtol=0, atol=0, equal_nan=True)
        if x.dim() == 0:
            assert idx.item() == 0
            continue
        keep = (
            name in ("kthvalue", "mode")
            and not s.kwargs.get("keepdim", False)
            and not (len(s.args) > 2 if name == "kthvalue" else len(s.args) > 1)
        )
        gi = idx.unsqueeze(dim) if keep else idx
        picked = x.gather(dim, gi)
        torch.testing.assert_close(
            picked,
            exp_values.unsqueeze(dim) if keep else exp_values,
            rtol=0,
            atol=0,
            equal_nan=True,
        )
        if name in ("sort", "argsort"):
            assert (
                idx.sort(dim).values
                == torch.arange(x.shape[dim]).view(
                    [-1 if d == dim % x.dim() else 1 for d in range(x.dim())]
                )
            ).all()


def test_nan_sorts_largest_and_negative_zero_is_zero():
    x = torch.tensor([1.0, NAN, -0.0, 0.0, -NAN, -1.0, INF, -INF, 0.0])
    for descending in (False, True):
        same(lambda t, d=descending: torch.sort(t, descending=d, stable=True), x)
        same(lambda t, d=descending: torch.argsort(t, descending=d, stable=True), x)
    same(lambda t: torch.topk(t, 3), x)
    same(lambda t: torch.topk(t, 3, largest=False), x[[0, 1, 4, 5, 6, 7]])
    same(lambda t: torch.kthvalue(t, 9), x)


def test_stable_ties_both_directions():
    x = torch.tensor([[2, 1, 2, 0, 1, 2], [5, 5, 5, 5, 5, 5]])
    for descending in (False, True):
        same(lambda t, d=descending: torch.sort(t, dim=1, descending=d, stable=True), x)
        same(lambda t, d=descending: torch.sort(t, dim=0, descending=d, stable=True), x)
        same(lambda t, d=descending: torch.sort(t, dim=1, descending=d, stable=True), x.bool())
    ints = torch.tensor([torch.iinfo(torch.int64).min, 0, torch.iinfo(torch.int64).max, -1])
    same(lambda t: torch.sort(t, descending=True), ints)
    same(torch.msort, torch.tensor([[3.0, 1.0], [2.0, 4.0], [0.0, 5.0]]))


def test_zero_dim_and_empty():
    s = torch.tensor(3.0)
    same(torch.sort, s)
    same(lambda t: torch.topk(t, 1), s)
    same(lambda t: torch.topk(t, 0), s)
    same(lambda t: torch.kthvalue(t, 1), s)
    same(lambda t: torch.median(t, 0), s)
    same(lambda t: torch.mode(t, 0), s)
    same(torch.median, torch.empty(0))
    same(lambda t: torch.sort(t, 1), torch.empty(3, 0))
    same(lambda t: torch.topk(t, 0), torch.empty(3, 0))


def test_selection_errors():
    x = torch.ones(3).to("tpu")
    with pytest.raises(RuntimeError, match="selected index k out of range.*aten::topk"):
        torch.topk(x, 4)
    with pytest.raises(RuntimeError, match="kthvalue.*out of range"):
        torch.kthvalue(x, 0)
    with pytest.raises(IndexError, match="aten::median"):
        torch.median(torch.empty(3, 0).to("tpu"), 1)
    with pytest.raises(IndexError, match="aten::mode"):
        torch.mode(torch.empty(0, 3).to("tpu"), 0)
    with pytest.raises(RuntimeError, match="complex"):
        torch.sort(torch.ones(2, dtype=torch.complex64).to("tpu"))


def test_median_nan():
    x = torch.tensor([[1.0, NAN, 2.0, NAN], [3.0, 1.0, 2.0, 0.0], [NAN, NAN, NAN, NAN]])
    same(lambda t: torch.median(t, 1), x)
    same(lambda t: torch.nanmedian(t, 1), x[:2])
    same(lambda t: torch.nanmedian(t, 1, keepdim=True), x[:2])
    # all NaN: the value is NaN; torch's index is whichever NaN its unstable select keeps
    oi.compare(torch.nanmedian(x.to("tpu"), 1).values, torch.nanmedian(x, 1).values)
    same(torch.median, x)
    same(torch.nanmedian, x)
    same(torch.nanmedian, x[2])


def test_mode_ties_pick_smallest_value_last_index():
    x = torch.tensor([[1, 2, 1, 2, 3], [1, 2, 1, 2, 3], [4, 4, 4, 4, 4], [7, 1, 7, 1, 7]])
    same(lambda t: torch.mode(t, 1), x)
    same(lambda t: torch.mode(t, 1, keepdim=True), x.double())


def test_out_variants():
    x = torch.randn(4, 5)
    v, i = torch.empty(0).to("tpu"), torch.empty(0, dtype=torch.long).to("tpu")
    torch.sort(x.to("tpu"), 1, descending=True, out=(v, i))
    expected = torch.sort(x, 1, descending=True)
    oi.compare((v, i), (expected.values, expected.indices))
    torch.topk(x.to("tpu"), 2, 0, out=(v, i))
    expected = torch.topk(x, 2, 0)
    oi.compare((v, i), (expected.values, expected.indices))


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"return_inverse": True},
        {"return_inverse": True, "return_counts": True},
        {"return_counts": True, "sorted": False},
    ],
)
def test_unique(kwargs):
    x = torch.tensor([[3, 1, 3], [2, 1, 0]])
    same(lambda t: torch.unique(t, **kwargs), x)
    same(lambda t: torch.unique(t, dim=1, **kwargs), x)
    same(lambda t: torch.unique(t, dim=0, **kwargs), torch.tensor([[1, 2], [0, 1], [1, 2]]))
    same(lambda t: torch.unique(t, **kwargs), torch.tensor([NAN, 1.0, NAN, 1.0]))
    kw = {k: v for k, v in kwargs.items() if k != "sorted"}
    same(lambda t: torch.unique_consecutive(t, **kw), torch.tensor([1, 1, 2, 2, 3, 1, 1]))
    same(
        lambda t: torch.unique_consecutive(t, dim=0, **kw),
        torch.tensor([[1, 2], [1, 2], [0, 1], [1, 2]]),
    )
    same(lambda t: torch.unique_consecutive(t, **kw), torch.empty(0))


@pytest.mark.parametrize(
    "fn", [torch.unique, torch.unique_consecutive, lambda t: torch.unique(t, dim=0)]
)
def test_unique_under_a_jax_trace_raises(fn):
    import jax
    import jax.numpy as jnp

    def traced(a):
        out = fn(torchjax.from_jax(a))
        return torchjax.to_jax(out[0] if isinstance(out, tuple) else out)

    with pytest.raises(DataDependentError, match="output shape that depends on tensor values"):
        jax.jit(traced)(jnp.ones(3))


@pytest.mark.parametrize("op", [torch.unique, torch.unique_consecutive])
def test_unique_along_a_dim_of_empty_tensors_as_cpu(op):
    # Empty only along another dimension: torch refuses (the slices have no length);
    # empty along the selected one: an empty result. It returned a (0, 1) result.
    with pytest.raises(RuntimeError, match="0 sized dimensions"):
        op(torch.zeros(0, 4), dim=1)
    with pytest.raises(RuntimeError, match="0 sized dimensions"):
        op(torch.zeros(0, 4, device="tpu"), dim=1)
    checked = 0
    for shape, dim in [((0, 4), 0), ((3, 0), 1), ((2, 0, 3), 1)]:
        want = op(torch.zeros(shape), dim=dim, return_inverse=True, return_counts=True)
        got = op(torch.zeros(shape, device="tpu"), dim=dim, return_inverse=True, return_counts=True)
        assert [t.shape for t in got] == [t.shape for t in want], (shape, dim)
        checked += 1
    assert checked == 3


_SELECTION_REFUSALS = {
    "topk_bool": lambda d: torch.topk(torch.tensor([True, False], device=d), 1),
    "kthvalue_bool": lambda d: torch.kthvalue(torch.tensor([True, False], device=d), 1),
    "median_bool": lambda d: torch.median(torch.tensor([True, False], device=d)),
    "median_dim_bool": lambda d: torch.median(torch.tensor([True, False], device=d), 0),
    "nanmedian_dim_bool": lambda d: torch.nanmedian(torch.tensor([True, False], device=d), 0),
    "kthvalue_empty": lambda d: torch.kthvalue(torch.empty(0, device=d), 1),
}


@pytest.mark.parametrize("name", sorted(_SELECTION_REFUSALS))
def test_selection_refuses_as_cpu(name):
    error = oi.same_or_refused(_SELECTION_REFUSALS[name], name)
    assert error is not None, f"{name}: CPU accepts it; the case checks nothing"


@pytest.mark.parametrize(
    "values_dtype, indices_dtype",
    [(torch.float32, torch.int32), (torch.float64, torch.int32), (torch.bfloat16, torch.int64)],
)
def test_mode_out_of_the_wrong_dtype_has_cpus_text(values_dtype, indices_dtype):
    x = torch.tensor([1.0, 2.0, 2.0])
    outs = (torch.empty(0, dtype=values_dtype), torch.empty(0, dtype=indices_dtype))
    with pytest.raises(RuntimeError) as cpu:
        torch.mode(x, out=outs)
    with pytest.raises(RuntimeError) as tpu:
        torch.mode(x.to("tpu"), out=tuple(o.to("tpu") for o in outs))
    assert str(tpu.value).startswith(str(cpu.value)), (tpu.value, cpu.value)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_kthvalue_of_complex_as_cpu(dtype):
    # A 0-d complex tensor is its own kthvalue on CPU; longer ones are refused with
    # NotImplementedError (was a RuntimeError for both).
    x = torch.tensor(1 + 2j, dtype=dtype)
    want, got = torch.kthvalue(x, 1), torch.kthvalue(x.to("tpu"), 1)
    assert torch.equal(got.values.cpu(), want.values) and got.indices.item() == 0
    v = torch.tensor([1 + 2j, 3j], dtype=dtype)
    with pytest.raises(NotImplementedError) as cpu:
        torch.kthvalue(v, 1)
    with pytest.raises(NotImplementedError) as tpu:
        torch.kthvalue(v.to("tpu"), 1)
    assert str(tpu.value).startswith(str(cpu.value))
