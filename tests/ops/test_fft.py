"""Tests for torchjax/ops/fft.py: OpInfo sweep over torch.fft (and stft/istft, which reach
the same three primitives) plus what OpInfo misses."""

import pytest
import torch

import torchjax  # noqa: F401
from tests.ops.opinfo_cases import make_tests
from torchjax.testing.opinfo import same

OPS = [
    "fft.fft",
    "fft.fft2",
    "fft.fftn",
    "fft.fftshift",
    "fft.hfft",
    "fft.hfft2",
    "fft.hfftn",
    "fft.ifft",
    "fft.ifft2",
    "fft.ifftn",
    "fft.ifftshift",
    "fft.ihfft",
    "fft.ihfft2",
    "fft.ihfftn",
    "fft.irfft",
    "fft.irfft2",
    "fft.irfftn",
    "fft.rfft",
    "fft.rfft2",
    "fft.rfftn",
    "stft",
    "istft",
]
globals().update(make_tests(OPS))


@pytest.mark.parametrize("norm", [None, "forward", "ortho", "backward"])
def test_fftn_more_than_three_dims(norm):
    # XLA transforms at most three axes at once; the lowering groups them.
    x = torch.randn(2, 3, 4, 5, 3, dtype=torch.complex128)
    same(torch.fft.fftn, x, norm=norm)
    same(torch.fft.ifftn, x, dim=(0, 1, 2, 3, 4), norm=norm)
    r = torch.randn(2, 3, 4, 5, 6, dtype=torch.float64)
    same(torch.fft.rfftn, r, norm=norm)
    same(torch.fft.irfftn, torch.fft.rfftn(r), s=(2, 3, 4, 5, 6), norm=norm)


def test_float64_precision():
    x = torch.randn(64, dtype=torch.float64)
    got = torch.fft.rfft(x.to("tpu"))
    assert got.dtype == torch.complex128
    torch.testing.assert_close(got.cpu(), torch.fft.rfft(x), rtol=1e-12, atol=1e-12)


def test_irfft_ignores_imaginary_dc():
    x = torch.complex(torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64))
    same(torch.fft.irfft, x, n=8)
    same(torch.fft.irfft, x, n=9)


def test_batched_and_odd_sizes_grad():
    x = torch.randn(3, 7, 5, dtype=torch.float64, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    torch.fft.rfft2(x, s=(6, 4), norm="ortho").abs().sum().backward()
    torch.fft.rfft2(xt, s=(6, 4), norm="ortho").abs().sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), x.grad)


def test_empty_dim_list():
    x = torch.randn(3, 4, dtype=torch.complex64)
    same(torch.fft.fftn, x, dim=())


def test_ihfft2_single_dim_out_matches_cpu_quirk():
    # torch's fft_ihfftn_impl swaps conj_physical_out's arguments for one transformed dim:
    # out= stays empty on CPU. We match CPU (the OpInfo out= cases are xfailed for it).
    x = torch.randn(5, 6, 7)
    cpu_out = torch.empty(0, dtype=torch.complex64)
    tpu_out = torch.empty(0, dtype=torch.complex64, device="tpu")
    torch.fft.ihfft2(x, dim=0, out=cpu_out)
    torch.fft.ihfft2(x.to("tpu"), dim=0, out=tpu_out)
    assert tpu_out.shape == cpu_out.shape
