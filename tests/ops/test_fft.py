"""Tests for torchjax/ops/fft.py: OpInfo sweep over torch.fft (and stft/istft, which reach
the same three primitives) plus what OpInfo misses."""

import pytest
import torch

import torchjax
from tests.ops.opinfo_cases import make_tests
from torchjax.testing.opinfo import compare, same

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


COMPILERS = {
    "jit": torchjax.jit,
    "compile": lambda fn: torch.compile(fn, backend="tpu"),
}
# (n_fft, keyword arguments of both stft and istft, istft's length)
STFT_CASES = [
    (64, {}, 400),
    (64, {"hop_length": 32, "win_length": 48}, 390),
    (32, {"center": False, "normalized": True}, None),
    (16, {"onesided": False}, 400),
]


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("n_fft,kwargs,length", STFT_CASES)
def test_stft_and_istft_compiled(compiler, n_fft, kwargs, length):
    # istft's NOLA check read a traced flag on the host: Note [istft's window check
    # under a trace] in torchjax/ops/fft.py.
    win = kwargs.get("win_length", n_fft)
    # A window that is nowhere zero: center=False keeps the signal's ends in the check.
    window = torch.hann_window(win, dtype=torch.float64) + 0.1
    x = torch.randn(2, 400, dtype=torch.float64)

    def forward(x, w):
        return torch.stft(x, n_fft, window=w, return_complex=True, **kwargs)

    def inverse(s, w):
        return torch.istft(s, n_fft, window=w, length=length, **kwargs)

    def round_trip(x, w):
        return inverse(forward(x, w), w)

    spec = forward(x, window)
    xt, st, wt = x.to("tpu"), spec.to("tpu"), window.to("tpu")
    compare(COMPILERS[compiler](forward)(xt, wt), spec)
    compare(COMPILERS[compiler](inverse)(st, wt), inverse(spec, window))
    compare(COMPILERS[compiler](round_trip)(xt, wt), round_trip(x, window))


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize(
    "window,kwargs",
    [
        (torch.hann_window(64), {"center": False}),
        (torch.zeros(64, dtype=torch.float64), {"onesided": True, "length": 300}),
        (torch.zeros(48), {"win_length": 48, "hop_length": 12, "normalized": True}),
    ],
)
def test_istft_window_check_under_a_trace(compiler, window, kwargs):
    # The check fails (a zero in the window envelope): the compiled call raises eager's
    # RuntimeError, word for word.
    x = torch.randn(2, 400, dtype=window.dtype)
    spec = torch.stft(x, 64, window=torch.hann_window(64, dtype=x.dtype), return_complex=True)

    def inverse(s, w):
        return torch.istft(s, 64, window=w, **kwargs)

    with pytest.raises(RuntimeError, match="window overlap add min"):
        inverse(spec, window)
    with pytest.raises(RuntimeError) as eager:
        inverse(spec.to("tpu"), window.to("tpu"))
    with pytest.raises(RuntimeError) as compiled:
        COMPILERS[compiler](inverse)(spec.to("tpu"), window.to("tpu"))
    assert str(compiled.value) == str(eager.value)
    assert str(eager.value).startswith(
        f"istft(tpuComplex{'Double' if x.dtype == torch.float64 else 'Float'}Type"
    )
