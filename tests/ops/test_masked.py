"""torch.masked.* on tpu: Python composites over ATen reductions (no lowerings of their own)
vs CPU torch."""

from __future__ import annotations

import torch

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests
from torchjax.testing import opinfo as oi

OPS = [
    "masked." + n
    for n in (
        "amax amin argmax argmin cumprod cumsum log_softmax logaddexp logsumexp mean median "
        "norm normalize prod softmax softmin std sum var"
    ).split()
]
globals().update(make_tests(OPS))


def test_fully_masked_rows_and_empty():
    x = torch.randn(3, 4)
    mask = torch.tensor([[True, False, True, False], [False] * 4, [True] * 4])
    oi.same(lambda x, m: torch.masked.sum(x, 1, mask=m), x, mask)
    oi.same(lambda x, m: torch.masked.mean(x, 1, mask=m), x, mask)
    oi.same(lambda x, m: torch.masked.amax(x, 1, mask=m), x, mask)
    oi.same(lambda x, m: torch.masked.softmax(x, 1, mask=m), x, mask)
    oi.same(lambda x, m: torch.masked.var(x, 1, unbiased=True, mask=m), x, mask)
    oi.same(lambda x: torch.masked.sum(x, 0), torch.empty(0, 3))


def test_int64_past_2_31():
    x = torch.tensor([[2**40 + 1, 3, -(2**33)], [7, 2**31, 1]])
    mask = torch.tensor([[True, False, True], [True, True, False]])
    oi.same(lambda x, m: torch.masked.sum(x, 1, mask=m), x, mask)
    oi.same(lambda x, m: torch.masked.amax(x, 0, mask=m), x, mask)
    oi.same(lambda x, m: torch.masked.cumsum(x, 1, mask=m), x, mask)
