"""torch.distributions' samplers on tpu: gamma, Dirichlet, Poisson and binomial draws have
CPU's shapes, dtypes, support and moments; the deterministic parts (Gamma's
reparameterization gradient, edge values, draws from a CPU generator, refusals) equal
CPU's."""

import math

import numpy as np
import pytest
import scipy.special  # a dependency of jax
import torch
import torch.distributions as D

import torchjax  # noqa: F401

N = 4000


def _t(values, device):
    return torch.tensor(values, device=device)


DISTRIBUTIONS = {
    "Gamma": lambda d: D.Gamma(_t([2.0, 0.5], d), _t(1.5, d)),
    "Beta": lambda d: D.Beta(_t([2.0, 0.7], d), _t([3.0, 0.7], d)),
    "Dirichlet": lambda d: D.Dirichlet(_t([1.0, 2.0, 3.0], d)),
    "StudentT": lambda d: D.StudentT(_t([5.0], d)),
    "Chi2": lambda d: D.Chi2(_t([4.0], d)),
    "Poisson": lambda d: D.Poisson(_t([0.0, 1.0, 7.5], d)),
    "Binomial": lambda d: D.Binomial(_t([10.0, 3.0], d), _t([0.3, 0.9], d)),
    "LKJCholesky": lambda d: D.LKJCholesky(3, _t(2.0, d)),
}


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_samples_have_cpus_shape_dtype_support_and_moments(name):
    torch.manual_seed(0)
    cpu = DISTRIBUTIONS[name]("cpu").sample((N,))
    dist = DISTRIBUTIONS[name]("tpu")
    tpu = dist.sample((N,))
    assert (tpu.shape, tpu.dtype, tpu.device.type) == (cpu.shape, cpu.dtype, "tpu")
    assert bool(dist.support.check(tpu).all())
    # Sample means within 5 standard errors of each other (the two draw other numbers).
    diff = (tpu.cpu().mean(0) - cpu.mean(0)).abs()
    se = ((tpu.cpu().var(0) + cpu.var(0)) / N).sqrt()
    assert bool((diff <= 5 * se + 1e-6).all()), (diff, se)
    assert diff.numel() > 0


def _exact_gamma_grad(alpha, x, h=1e-5):
    # d x / d alpha at a fixed CDF: -(dF/dalpha) / (dF/dx), F the regularised gamma.
    a, v = alpha.numpy(), x.numpy()
    da = (scipy.special.gammainc(a + h, v) - scipy.special.gammainc(a - h, v)) / (2 * h)
    pdf = np.exp((a - 1) * np.log(v) - v - scipy.special.gammaln(a))
    return torch.from_numpy(-da / pdf)


def test_gamma_reparameterization_gradient():
    # rsample's backward is _standard_gamma_grad at the drawn sample: within 1e-3 of
    # CPU's (torch's approximation) and closer to the exact derivative than it.
    alpha = torch.tensor([0.3, 1.0, 2.5, 40.0], device="tpu", requires_grad=True)
    x = torch._standard_gamma(alpha)
    x.sum().backward()
    expected = torch._standard_gamma_grad(alpha.detach().cpu(), x.detach().cpu())
    torch.testing.assert_close(alpha.grad.cpu(), expected, rtol=2e-3, atol=1e-6)
    grid = torch.tensor([0.05, 0.5, 1.0, 4.0, 30.0], dtype=torch.float64)
    a, v = torch.meshgrid(grid, grid[:4], indexing="ij")
    exact = _exact_gamma_grad(a, v)
    for dtype, rtol in ((torch.float64, 1e-8), (torch.float32, 1e-5)):
        got = torch._standard_gamma_grad(a.to("tpu", dtype), v.to("tpu", dtype))
        assert got.dtype == dtype
        torch.testing.assert_close(got.cpu().double(), exact, rtol=rtol, atol=0)
        cpu = torch._standard_gamma_grad(a.to(dtype), v.to(dtype)).double()
        torch.testing.assert_close(got.cpu().double(), cpu, rtol=2e-3, atol=0)


def test_edge_values_are_cpus():
    for dtype in (torch.float32, torch.float64):
        alpha = torch.tensor([math.nan, math.inf, 0.0, -1.0, 1e-30], dtype=dtype)
        assert torch.equal(
            torch._standard_gamma(alpha.to("tpu")).cpu(), torch._standard_gamma(alpha)
        )
    zeros = torch.tensor([[0.0, 0.0], [1e-30, 1e-30]])
    assert torch.equal(
        torch._sample_dirichlet(zeros.to("tpu")).cpu(), torch._sample_dirichlet(zeros)
    )
    count, prob = torch.tensor([3.0, 4.0]), torch.tensor([1.5, 0.0])  # prob clamped into [0, 1]
    assert torch.equal(
        torch.binomial(count.to("tpu"), prob.to("tpu")).cpu(), torch.binomial(count, prob)
    )


def test_half_precision_draws_in_float32():
    # As CUDA's kernels (CPU has none for these dtypes).
    for dtype in (torch.float16, torch.bfloat16):
        x = torch._standard_gamma(torch.full((1000,), 3.0, dtype=dtype, device="tpu"))
        assert x.dtype == dtype and bool(torch.isfinite(x).all())
        assert abs(x.float().mean().item() - 3.0) < 0.3


@pytest.mark.parametrize(
    "draw",
    [
        lambda d, g: torch._standard_gamma(_t([2.0, 0.5, 9.0], d), g),
        lambda d, g: torch._sample_dirichlet(_t([[1.0, 2.0], [0.5, 0.5]], d), g),
        lambda d, g: torch.poisson(_t([1.0, 30.0], d), g),
        lambda d, g: torch.binomial(_t([10.0, 100.0], d), _t([0.3, 0.5], d), g),
    ],
    ids=["gamma", "dirichlet", "poisson", "binomial"],
)
def test_a_cpu_generator_draws_cpus_numbers(draw):
    cpu = draw("cpu", torch.Generator().manual_seed(3))
    tpu = draw("tpu", torch.Generator().manual_seed(3))
    assert tpu.device.type == "tpu" and cpu.numel() > 0
    assert torch.equal(tpu.cpu(), cpu)


def test_refusals_match_cpu():
    with pytest.raises(NotImplementedError, match="\"poisson_cpu\" not implemented for 'Long'"):
        torch.poisson(torch.tensor([1], device="tpu"))
    with pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
        torch._standard_gamma(torch.tensor([1], device="tpu"))
    # A negative rate is a device-side check: raised at the next synchronisation.
    torch.poisson(torch.tensor([1.0, -2.0], device="tpu"))
    with pytest.raises(
        RuntimeError, match="invalid Poisson rate, expected rate to be non-negative"
    ):
        torch.tpu.synchronize()
    with pytest.raises(RuntimeError, match="invalid Poisson rate"):
        torch.poisson(torch.tensor([-1.0]))
