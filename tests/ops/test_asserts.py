"""torch._assert_async and F.one_hot on tpu (torchjax/ops/asserts.py): device checks,
raised at the next sync (or at the op in immediate mode), never a silent result."""

import pytest
import torch
import torch.nn.functional as F

import torchjax
from torchjax.device import _checks

TPU = "tpu"


@pytest.fixture
def immediate():
    torch.tpu.set_sync_checks(True)
    yield
    torch.tpu.set_sync_checks(False)


@pytest.mark.parametrize(
    "values, num_classes",
    [([0, 3, 4], 5), ([[1, 0], [2, 2]], 3), ([1, 2], -1), ([], 3)],
    ids=["1d", "2d", "inferred", "empty"],
)
def test_one_hot_equals_cpu(values, num_classes):
    x = torch.tensor(values, dtype=torch.long)
    got = F.one_hot(x.to(TPU), num_classes)
    want = F.one_hot(x, num_classes)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize(
    "values, message",
    [([0, 5], "must be smaller than num_classes"), ([-1, 2], "must be non-negative")],
    ids=["too-large", "negative"],
)
def test_one_hot_out_of_range_raises_at_the_next_sync(values, message):
    # Before: a row of zeros for the bad index, no error at all.
    out = F.one_hot(torch.tensor(values).to(TPU), 5)  # no read, no raise
    # Queued unread; in fused eager the recorded segment queues it when the read runs it.
    assert _checks.pending() >= 1 or torchjax.eager_mode() == "fused"
    with pytest.raises(RuntimeError, match=f"one_hot: Class values {message}.*aten::_assert"):
        out.cpu()
    assert _checks.pending() == 0


def test_one_hot_out_of_range_raises_at_the_op_in_immediate_mode(immediate):
    x = torch.tensor([7]).to(TPU)
    with pytest.raises(RuntimeError, match="smaller than num_classes"):
        F.one_hot(x, 5)


def test_one_hot_checks_under_inference_mode():
    with torch.inference_mode():
        out = F.one_hot(torch.tensor([0, 9]).to(TPU), 5)
        with pytest.raises(RuntimeError, match="smaller than num_classes"):
            out.sum().item()


def test_one_hot_refuses_what_cpu_refuses():
    for x in (torch.tensor([1.0]), torch.tensor([1], dtype=torch.int32)):
        with pytest.raises(RuntimeError, match="only applicable to index tensor"):
            F.one_hot(x, 3)
        with pytest.raises(RuntimeError, match="only applicable to index tensor"):
            F.one_hot(x.to(TPU), 3)


@pytest.mark.parametrize(
    "cond, args, message",
    [
        (False, (), "Expected Tensor with single nonzero value, but got zero"),
        (0.0, ("my {message}",), "my {message}"),
        (0, ("count",), "count"),
    ],
    ids=["default", "braces", "int"],
)
def test_assert_async_raises_cpus_message_at_the_next_sync(cond, args, message):
    with pytest.raises(RuntimeError, match=message.replace("{", r"\{").replace("}", r"\}")):
        torch._assert_async(torch.tensor(cond), *args)
    torch._assert_async(torch.tensor(cond).to(TPU), *args)  # queued, not raised
    with pytest.raises(RuntimeError) as info:
        torch.tpu.synchronize()
    assert str(info.value).startswith(message)


def test_assert_async_passes_a_true_condition():
    torch._assert_async(torch.tensor(True).to(TPU), "never")
    torch._assert_async(torch.tensor(2.5).to(TPU))
    torch.tpu.synchronize()
    assert _checks.pending() == 0


@pytest.mark.parametrize("values", [[True, True], []], ids=["two", "none"])
def test_assert_async_refuses_what_cpu_refuses(values):
    x = torch.tensor(values, dtype=torch.bool)
    with pytest.raises(RuntimeError) as cpu:
        torch._assert_async(x)
    with pytest.raises(RuntimeError) as tpu:
        torch._assert_async(x.to(TPU))
    assert str(tpu.value).startswith(str(cpu.value))


def test_assert_async_under_jit_raises_at_the_next_sync_as_eager():
    # The assert is an output of the compiled program (Note [Device checks of compiled
    # programs] in torchjax/device/_checks.py), reported as eager reports it.
    def f(x):
        torch._assert_async(x > 10)
        return x + 1

    with pytest.raises(RuntimeError) as eager:
        f(torch.tensor(1).to(TPU)).item()
    out = torchjax.jit(f)(torch.tensor(1).to(TPU))
    with pytest.raises(RuntimeError) as got:
        out.item()
    assert str(got.value) == str(eager.value)
    assert torchjax.jit(f)(torch.tensor(11).to(TPU)).item() == 12
