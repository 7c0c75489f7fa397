"""Python numbers in promoted positions (Note [Python numbers as device scalars])."""

import math

import jax
import torch

import torchjax  # noqa: F401
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
