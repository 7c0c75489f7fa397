"""torch's process-wide settings that a trace bakes into its program are part of a
torchjax.jit call's cache key (``global_modes`` in torchjax/compile/_call.py): a change
retraces, and the results are eager's under each setting."""

import torch

import torchjax


def _x():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).to("tpu")


def test_autocast_dtype_is_part_of_the_key():
    f = torchjax.jit(lambda a, b: a @ b)
    x, w = _x(), _x().T.contiguous()
    got = []
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        with torch.autocast("tpu", dtype=dtype):
            out, want = f(x, w), x @ w
        assert out.dtype == want.dtype == dtype
        torch.testing.assert_close(out.cpu(), want.cpu())
        got.append(f.trace_count)
    assert got == [1, 2, 2]
    assert f(x, w).dtype == torch.float32  # autocast off: a third program
    assert f.trace_count == 3


def test_a_linear_under_float16_autocast_after_bfloat16_is_float16():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4).to("tpu")
    f = torchjax.jit(lin)
    x = _x()
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float16):
            with torch.autocast("tpu", dtype=dtype):
                out, want = f(x), lin(x)
            assert out.dtype == want.dtype == dtype
            torch.testing.assert_close(out.cpu(), want.cpu(), rtol=0, atol=0)


def test_default_dtype_is_part_of_the_key():
    f = torchjax.jit(lambda x: x + torch.ones(2, device="tpu"))
    x = torch.zeros(2, dtype=torch.float64, device="tpu")
    assert f(x).dtype == torch.float64  # promotion: float64 argument
    g = torchjax.jit(lambda x: torch.ones(2, device=x.device) * 2)
    assert g(x).dtype == torch.float32
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert g(x).dtype == torch.float64 == (torch.ones(2, device="tpu") * 2).dtype
        assert g.trace_count == 2
    finally:
        torch.set_default_dtype(old)
    assert g(x).dtype == torch.float32
    assert g.trace_count == 2


def test_float32_matmul_precision_is_part_of_the_key():
    f = torchjax.jit(lambda a, b: a @ b)
    x, w = _x(), _x().T.contiguous()
    old = torch.get_float32_matmul_precision()
    try:
        f(x, w)
        torch.set_float32_matmul_precision("medium" if old != "medium" else "highest")
        f(x, w)
        assert f.trace_count == 2
    finally:
        torch.set_float32_matmul_precision(old)
    f(x, w)
    assert f.trace_count == 2
