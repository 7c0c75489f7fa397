"""torchjax/ops/distance.py: cdist (``_cdist_forward`` / ``_cdist_backward``) vs CPU torch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests
from torchjax.testing import opinfo as oi
from torchjax.testing.opinfo import grads_match

OPS = ["cdist", "nn.functional.pdist"]
globals().update(make_tests(OPS))

TPU = "tpu"


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, math.inf])
@pytest.mark.parametrize("mode", ["use_mm_for_euclid_dist", "donot_use_mm_for_euclid_dist"])
def test_cdist_p_and_grad(p, mode):
    torch.manual_seed(0)
    x1 = torch.randn(2, 1, 4, 3, dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(3, 5, 3, dtype=torch.float64, requires_grad=True)
    # a shared row: zero distances take ATen's zero-gradient convention
    with torch.no_grad():
        x2[0, 0] = x1[0, 0, 0]
    grads = []
    for a, b in ((x1, x2), oi.to_tpu((x1, x2))):
        out = torch.cdist(a, b, p=p, compute_mode=mode)
        grads.append((out,) + torch.autograd.grad(out.sum(), (a, b)))
    oi.compare(grads[1], grads[0], f"cdist p={p}")


def test_cdist_large_uses_mm_path():
    x1, x2 = torch.randn(30, 8), torch.randn(40, 8)
    oi.same(lambda a, b: torch.cdist(a, b), x1, x2)


def test_cdist_empty():
    oi.same(lambda a, b: torch.cdist(a, b, p=1), torch.randn(0, 3), torch.randn(4, 3))


def test_cdist_errors():
    with pytest.raises(RuntimeError, match="same number of columns"):
        torch.cdist(torch.randn(2, 3, device=TPU), torch.randn(2, 4, device=TPU))


_G = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 2.0, 3.0, float("inf")])
def test_pdist_norms_and_duplicate_rows(p):
    x = torch.randn(5, 3, generator=_G, dtype=torch.float64)
    x[3] = x[1]  # a zero distance: ATen's gradient is 0 there, not NaN
    grads_match(lambda x: F.pdist(x, p), x)
