"""Python numbers in promoted positions (Note [Python numbers as device scalars])."""

import math

import jax
import pytest
import torch

import torchjax
from torchjax.ops import promotion


def _ops(x, i, b):
    return [x * 0.5, x + 1, x - 2.5, i * 3, i + 1, b + True, b * 1, x * -0.0, x * 0.0]


def test_a_repeated_number_is_not_transferred_again():
    # The first calls keep each number's device array; the next ones pass it (a NumPy
    # scalar would be an implicit host-to-device transfer per call).
    cpu = (torch.tensor([[1.5, -2.0]]), torch.tensor([[3, -4]]), torch.tensor([[True, False]]))
    tpu = [t.to("tpu") for t in cpu]
    _ops(*tpu)
    with jax.transfer_guard_host_to_device("disallow"):
        got = _ops(*tpu)
    want = _ops(*cpu)
    assert len(got) == len(want) == 9
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)


def test_signed_zeros_nan_and_types_keep_their_own_values():
    x = torch.tensor([1.0, -3.0])
    for device in ("cpu", "tpu"):
        t = x.to(device)
        pos, neg = (t * 0.0).cpu(), (t * -0.0).cpu()
        assert [math.copysign(1.0, v) for v in pos.tolist()] == [1.0, -1.0]
        assert [math.copysign(1.0, v) for v in neg.tolist()] == [-1.0, 1.0]
        assert torch.isnan((t + float("nan")).cpu()).all()
    b = torch.tensor([True, False]).to("tpu")
    assert (b + True).dtype == torch.bool and (b + 1).dtype == torch.int64
    assert (b + 1).tolist() == [2, 1] and (b + 1.0).tolist() == [2.0, 1.0]
    i8 = torch.tensor([100], dtype=torch.int8)
    assert (i8.to("tpu") + 100).tolist() == (i8 + 100).tolist()


def test_many_distinct_numbers_stay_correct_past_the_bound():
    t = torch.tensor([2.0]).to("tpu")
    n = promotion._MAX_SCALAR_ARRAYS + 50
    got = [(t * float(k)).item() for k in range(n)]
    assert got == [2.0 * k for k in range(n)]
    assert len(promotion._SCALAR_ARRAYS) <= promotion._MAX_SCALAR_ARRAYS


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_a_complex32_result_is_refused_naming_op_dtypes_and_fix():
    # CPU gives complex32 (ComplexHalf); jax has no such dtype, so a tpu tensor cannot
    # hold it. The refusal is a NotImplementedError (a TypeError would be swallowed by
    # Tensor.__mul__ into "unsupported operand type(s)"), naming the op, the operands'
    # dtypes and what to do, eager and under torchjax.jit.
    x = torch.ones(2, dtype=torch.float16)
    assert (x * 1j).dtype == torch.complex32
    tpu = x.to("tpu")
    calls = {
        "aten::mul.Tensor": lambda t: t * 1j,
        "aten::add.Tensor": lambda t: 1j + t,
        "aten::sub.Tensor": lambda t: t - 1j,
    }
    checked = 0
    for op, fn in calls.items():
        for run in (fn, torchjax.jit(fn)):
            with pytest.raises(NotImplementedError) as info:
                run(tpu)
            text = str(info.value)
            assert op in text and "torch.complex32" in text, text
            assert "a torch.float16 tensor and a Python complex" in text, text
            assert "x.float()" in text, text
            checked += 1
    assert checked == 6
    # float32 operands: complex64, as on CPU.
    want = x.float() * 1j
    got = tpu.float() * 1j
    assert got.dtype == want.dtype == torch.complex64
    torch.testing.assert_close(got.cpu(), want)


@pytest.mark.parametrize(
    "call",
    [
        lambda t: t.mul_(1j),
        lambda t: t.add_(1j),
        lambda t: t.div_(torch.tensor(1j)),
    ],
    ids=["mul_", "add_", "div_-0d"],
)
def test_a_complex32_result_written_in_place_is_refused_as_cpu(call):
    # CPU computes in complex32, then refuses to write it into the float16 self: its cast
    # error, not torchjax's complex32 refusal (no tpu tensor could hold it, self neither).
    with pytest.raises(RuntimeError) as cpu:
        call(torch.ones(2, dtype=torch.float16))
    for run in (call, torchjax.jit(call)):
        with pytest.raises(RuntimeError) as got:
            run(torch.ones(2, dtype=torch.float16, device="tpu"))
        assert type(got.value) is RuntimeError
        assert str(got.value).startswith(str(cpu.value)), (got.value, cpu.value)


def test_complex_of_float16_is_refused_with_the_same_advice():
    h = torch.ones(2, dtype=torch.float16, device="tpu")
    with pytest.raises(NotImplementedError, match=r"two torch\.float16 tensors.*x\.float\(\)"):
        torch.complex(h, h)
