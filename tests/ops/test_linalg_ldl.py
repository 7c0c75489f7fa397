"""Tests for torchjax/ops/linalg_ldl.py: the Bunch-Kaufman LDL factorization in LAPACK's
packed format (Note [LDL in LAPACK's format]) and the solve from it, against CPU torch:
the packed factor, the pivots (1x1 and 2x2 blocks, exactly), info and errors. The OpInfo
sweep of ``linalg.ldl_factor``/``ldl_factor_ex``/``ldl_solve`` is in test_linalg.py."""

import pytest
import torch

import torchjax  # noqa: F401


def _factor_both(a, hermitian=False):
    cpu = torch.linalg.ldl_factor_ex(a, hermitian=hermitian)
    tpu = torch.linalg.ldl_factor_ex(a.to("tpu"), hermitian=hermitian)
    for got, want in zip(tpu, cpu):
        torch.testing.assert_close(got.cpu(), want)
    return cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
def test_factor_and_solve_match_lapack(dtype):
    torch.manual_seed(0)
    a = torch.randn(3, 6, 6, dtype=dtype)
    a = a + a.mT  # symmetric and indefinite: Bunch-Kaufman picks 2x2 blocks
    cpu = _factor_both(a)
    assert (cpu.pivots < 0).any() and (cpu.pivots > 0).any()
    b = torch.randn(3, 6, 2, dtype=dtype)
    want = torch.linalg.ldl_solve(cpu.LD, cpu.pivots, b)
    got = torch.linalg.ldl_solve(cpu.LD.to("tpu"), cpu.pivots.to("tpu"), b.to("tpu"))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_hermitian_reads_the_lower_triangle_and_real_diagonal():
    torch.manual_seed(1)
    a = torch.randn(5, 5, dtype=torch.complex64)  # not Hermitian: only tril(a).real diag read
    cpu = _factor_both(a, hermitian=True)
    b = torch.randn(5, 3, dtype=torch.complex64)
    want = torch.linalg.ldl_solve(cpu.LD, cpu.pivots, b, hermitian=True)
    got = torch.linalg.ldl_solve(
        cpu.LD.to("tpu"), cpu.pivots.to("tpu"), b.to("tpu"), hermitian=True
    )
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def _message(fn, a):
    with pytest.raises(RuntimeError) as e:
        fn(a)
    return str(e.value)


def test_singular_info_and_error():
    """A zero column gives info = its 1-based index; the raising forms fail as on CPU
    (torch's _linalg_check_errors does not know LDL's codes: an internal assert;
    torchjax may add the ATen op it was raised in)."""
    a = torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 3.0]])
    assert _factor_both(a).info.item() == 1
    for fn in (torch.linalg.ldl_factor, lambda a: torch.linalg.ldl_factor_ex(a, check_errors=True)):
        assert _message(fn, a.to("tpu")).startswith(_message(fn, a))


def test_empty_and_one_by_one():
    _factor_both(torch.zeros(2, 0, 0))
    _factor_both(torch.tensor([[-3.0]]))
