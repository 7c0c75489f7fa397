"""torchjax/ops/histogram.py: searchsorted, bucketize, bincount, histc vs CPU torch."""

from __future__ import annotations

import pytest
import torch

import torchjax
from tests.ops.opinfo_cases import make_tests
from tests.ops.value_checks import MODES, assert_computes_as_cpu, assert_refused_as_cpu
from torchjax.device import _checks
from torchjax.testing import opinfo as oi

OPS = ["searchsorted", "bucketize", "bincount", "histc"]
globals().update(make_tests(OPS))

TPU = "tpu"


@pytest.mark.parametrize("side", ["left", "right"])
def test_searchsorted_nan_and_sorter(side):
    seq = torch.tensor([3.0, 1.0, float("nan"), 2.0, 2.0])
    sorter = torch.argsort(seq)
    values = torch.tensor([[2.0, float("nan"), -1.0], [5.0, 1.0, 2.5]])
    oi.same(lambda s, v, o: torch.searchsorted(s, v, side=side, sorter=o), seq, values, sorter)


def test_searchsorted_batched_scalar_int32():
    seq = torch.sort(torch.randn(2, 3, 7), dim=-1).values
    values = torch.randn(2, 3, 4)
    oi.same(lambda s, v: torch.searchsorted(s, v, right=True, out_int32=True), seq, values)
    oi.same(lambda s: torch.searchsorted(s, 0.5), seq[0, 0])


def test_searchsorted_errors():
    seq = torch.arange(4.0, device=TPU)
    with pytest.raises(RuntimeError, match="opposites"):
        torch.searchsorted(seq, seq, right=True, side="left")
    with pytest.raises(RuntimeError, match="first N-1 dimensions"):
        torch.searchsorted(seq.reshape(2, 2), torch.zeros(3, 2, device=TPU))


_BAD_SORTERS = {
    "index past the end": torch.tensor([0, 5]),
    "negative index": torch.tensor([0, -1]),
    "batched": torch.tensor([[0, 1], [2, 0]]),
}


@pytest.mark.parametrize("name", sorted(_BAD_SORTERS))
def test_searchsorted_refuses_a_sorter_out_of_range_at_the_op_as_cpu(name):
    # ATen's searchsorted_pre_check reads the sorter's min and max back on CPU and CUDA.
    sorter = _BAD_SORTERS[name]
    seq = torch.ones(sorter.shape)
    fn = lambda s, v, o: torch.searchsorted(s, v, sorter=o)  # noqa: E731
    assert assert_refused_as_cpu(fn, seq, torch.ones(sorter.shape), sorter) == len(MODES)


def test_searchsorted_valid_sorter_computes_as_cpu():
    seq = torch.tensor([[3.0, 1.0, 2.0], [0.0, -1.0, 5.0]])
    fn = lambda s, v, o: torch.searchsorted(s, v, sorter=o, right=True)  # noqa: E731
    values = torch.tensor([[2.0, 0.0], [4.0, -2.0]])
    assert assert_computes_as_cpu(fn, seq, values, torch.argsort(seq)) == len(MODES)


def test_bucketize_int64_large():
    boundaries = torch.tensor([0, 2**31, 2**33], dtype=torch.int64)
    values = torch.tensor([-1, 2**31, 2**32, 2**40], dtype=torch.int64)
    oi.same(lambda v, b: torch.bucketize(v, b), values, boundaries)
    oi.same(lambda v, b: torch.bucketize(v, b, right=True), values, boundaries)


def test_bincount_weights_minlength_empty():
    x = torch.tensor([0, 3, 3, 1])
    oi.same(lambda a, w: torch.bincount(a, w, minlength=7), x, torch.rand(4))
    oi.same(lambda a, w: torch.bincount(a, w), x, torch.rand(4, dtype=torch.float64))
    oi.same(lambda a: torch.bincount(a, minlength=3), torch.tensor([], dtype=torch.int64))


def test_bincount_negative_raises():
    with pytest.raises(RuntimeError, match="aten::bincount"):
        torch.bincount(torch.tensor([1, -1], device=TPU))


def test_histc_range_nan_and_edges():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, float("nan"), 5.0, -1.0])
    oi.same(lambda a: torch.histc(a, bins=4, min=0, max=3), x)
    oi.same(lambda a: torch.histc(a, bins=5), torch.full((3,), 2.0))
    oi.same(lambda a: torch.histc(a, bins=3), torch.empty(0))
    # min == max (even inf) with data: torch takes the data's range, no error.
    oi.same(lambda a: torch.histc(a, bins=3, min=float("inf"), max=float("inf")), x[:4])
    # An empty range too large to widen by 1 in float32 widens by one float32 step.
    oi.same(lambda a: torch.histc(a, bins=4), torch.tensor([1e10]))
    oi.same(lambda a: torch.histc(a, bins=4), torch.tensor([-3e38, -3e38]))


_INF, _NAN = float("inf"), float("nan")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "values, kwargs",
    [
        ([_INF], {}),
        ([-_INF], {}),
        ([1.0, _INF], {}),
        ([-_INF, _INF], {}),
        ([_NAN], {}),
        ([_INF], {"min": 1, "max": 1}),
        ([1.0], {"min": 0, "max": _INF}),
        ([1.0], {"min": _NAN, "max": 1}),
        ([], {"min": _INF, "max": _INF}),
        ([1.0, 2.0], {"min": 3, "max": 1}),
    ],
)
def test_histc_range_errors_are_cpus_raised_at_the_op(values, kwargs, dtype):
    # Every torch backend reads the data's range back at the op: raised there, not at a
    # later sync, with CPU's exception and text (Note [Device-side checks]).
    with pytest.raises(RuntimeError) as cpu:
        torch.histc(torch.tensor(values, dtype=dtype), bins=4, **kwargs)
    with pytest.raises(RuntimeError) as got:
        torch.histc(torch.tensor(values, dtype=dtype, device=TPU), bins=4, **kwargs)
    assert str(got.value) == str(cpu.value)
    assert _checks.pending() == 0


def test_jitted_histc_of_data_not_finite_raises_by_the_call():
    jitted = torchjax.jit(lambda a: torch.histc(a, bins=3))
    x = torch.tensor([1.0, _INF])
    with pytest.raises(RuntimeError) as cpu:
        torch.histc(x, bins=3)
    with pytest.raises(RuntimeError) as got:
        jitted(x.to(TPU))
    assert str(got.value) == str(cpu.value) == "torch.histc: range of [1, inf] is not finite"
    torch.testing.assert_close(jitted(x[:1].to(TPU)).cpu(), torch.histc(x[:1], bins=3))


def test_bincount_under_jit_raises_histc_traces():
    import jax
    import jax.numpy as jnp

    from torchjax._compat.jax import x64
    from torchjax.ops import histogram

    def traced_bincount(a):
        return torchjax.to_jax(torch.bincount(torchjax.from_jax(a)))

    with x64(True):
        x = jnp.asarray([0, 2, 2, 5], dtype=jnp.int64)
        with pytest.raises(torchjax.DataDependentError, match="aten::bincount"):
            jax.jit(traced_bincount)(x)
        data = jnp.asarray([0.5, 1.0, 3.0, 2.5], dtype=jnp.float32)
        traced = jax.jit(lambda a: histogram.histc(a, bins=4))(data)
    expected = torch.histc(torch.tensor([0.5, 1.0, 3.0, 2.5]), bins=4)
    torch.testing.assert_close(torch.from_numpy(jax.device_get(traced).copy()), expected)


def test_histc_integers_as_on_cuda():
    # CPU torch refuses integer histc; CUDA (and transformers' MoE routing off CPU) uses
    # it: counts in the input dtype, bins as for the same values in floating point.
    ids = torch.tensor([0, 3, 3, 1, 7, 2, 3, -1, 9], dtype=torch.int32)
    got = torch.histc(ids.to(TPU), bins=8, min=0, max=7)
    assert got.dtype == torch.int32
    want = torch.histc(ids.double(), bins=8, min=0, max=7).to(torch.int32)
    assert torch.equal(got.cpu(), want)


def test_dtype_errors():
    with pytest.raises(NotImplementedError, match="aten::histc"):
        torch.histc(torch.tensor([True, False], device=TPU))
    with pytest.raises(NotImplementedError, match="aten::bincount"):
        torch.bincount(torch.tensor([1.0, 2.0], device=TPU))


@pytest.mark.parametrize("right", [False, True])
@pytest.mark.parametrize(
    "seq_shape,values_shape", [((0, 0), (0, 0)), ((2, 0), (2, 3)), ((0, 3), (0, 2))]
)
def test_searchsorted_empty_batched(seq_shape, values_shape, right):
    # An empty boundary row or batch once failed in the lowering's reshape (JAX refused it).
    seq, values = torch.randn(seq_shape), torch.randn(values_shape)
    oi.same(lambda s, v: torch.searchsorted(s, v, right=right), seq, values)


def test_searchsorted_warns_once_for_non_contiguous_operands_as_cpu(monkeypatch):
    import warnings

    from torchjax.ops import histogram

    monkeypatch.setattr(histogram, "_WARNED_NON_CONTIGUOUS", set())
    boundaries, values = torch.arange(10.0)[::2], torch.tensor([3.0, 7.0])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tpu_boundaries = torch.arange(10.0, device="tpu")[::2]
        got = torch.searchsorted(tpu_boundaries, values.to("tpu"))
        torch.searchsorted(tpu_boundaries, values.to("tpu"))  # once per program
        torch.searchsorted(boundaries.to("tpu"), values.to("tpu"))  # contiguous: nothing
    texts = [str(w.message) for w in seen if "searchsorted" in str(w.message)]
    assert texts == [
        "torch.searchsorted(): boundary tensor is non-contiguous, this will lower the "
        "performance due to extra data copy when converting non-contiguous tensor to "
        "contiguous, please use contiguous boundary tensor if possible. This message will "
        "only appear once per program."
    ]
    assert torch.equal(got.cpu(), torch.searchsorted(boundaries, values))


def test_searchsorted_refusals_have_cpus_text():
    # A scalar (or 0-d) value needs 1-d boundaries; otherwise the leading dims must match.
    boundaries = torch.tensor([[1, 2, 3], [2, 3, 4]])
    for value in (1, torch.tensor(1), torch.tensor([1])):
        with pytest.raises(RuntimeError) as cpu:
            torch.searchsorted(boundaries, value)
        tpu_value = value.to("tpu") if isinstance(value, torch.Tensor) else value
        with pytest.raises(RuntimeError) as got:
            torch.searchsorted(boundaries.to("tpu"), tpu_value)
        assert str(cpu.value) in str(got.value)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.int32, torch.int64])
@pytest.mark.parametrize("out_int32", [False, True])
@pytest.mark.parametrize("op", ["searchsorted", "bucketize"])
def test_out_dtype_refusal_has_bucketizations_text(op, out_int32, out_dtype):
    b, v = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.5, 3.5])

    def call(dev):
        out = torch.empty(2, dtype=out_dtype, device=dev)
        if op == "searchsorted":
            return torch.searchsorted(b.to(dev), v.to(dev), out=out, out_int32=out_int32)
        return torch.bucketize(v.to(dev), b.to(dev), out=out, out_int32=out_int32)

    try:
        want = call("cpu")
    except RuntimeError as e:
        with pytest.raises(RuntimeError) as got:
            call("tpu")
        assert str(got.value).startswith(str(e))
    else:
        assert torch.equal(call("tpu").cpu(), want)
