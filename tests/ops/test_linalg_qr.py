"""Tests for torchjax/ops/linalg_qr.py: OpInfo sweep over QR, the Householder products
and least squares, plus what OpInfo misses (lstsq's outputs per driver, QR's complex
backward)."""

import torch

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests
from torchjax.testing.opinfo import same

OPS = [
    "linalg.householder_product",
    "linalg.lstsq",
    "linalg.lstsq.grad_oriented",
    "linalg.qr",
    "geqrf",
    "ormqr",
    "qr",
]
globals().update(make_tests(OPS))


def test_lstsq_shapes_per_driver():
    a, b = torch.randn(2, 5, 3), torch.randn(2, 5, 4)
    for driver in (None, "gelsy", "gelsd", "gelss", "gels"):
        same(torch.linalg.lstsq, a, b, driver=driver)
    same(torch.linalg.lstsq, torch.randn(1, 5, 3), b, driver="gelsd")
    same(torch.linalg.lstsq, a, torch.randn(2, 5), driver="gelss")


def test_qr_complex_backward_writes_through_real_view():
    """linalg_qr_backward scales ``at::real(R.diagonal())`` in place: a write through a
    view across dtypes (Note [Views across dtypes]) that must reach the gradient."""
    torch.manual_seed(0)
    a = torch.randn(4, 3, dtype=torch.complex64)

    def grad(dev):
        x = a.to(dev).detach().requires_grad_()
        q, r = torch.linalg.qr(x)
        (q.abs().sum() + r.real.sum() + (r.imag**2).sum()).backward()
        return x.grad.cpu()

    torch.testing.assert_close(grad("tpu"), grad("cpu"), rtol=1e-4, atol=1e-5)
