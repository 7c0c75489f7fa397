"""torchjax/ops/fused_optim.py: the fused optimizer kernels called directly, with
gradient scaling, tensor learning rates and half types, compared with CPU torch. The
optimizers that call them are checked in test_foreach.py."""

from __future__ import annotations

import copy

import pytest
import torch

from torchjax.testing import opinfo as oi

TPU = "tpu"


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def test_fused_adam_grad_scale_found_inf():
    cpu_model = _mlp()
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    x = torch.randn(5, 4)
    for model, inp in ((cpu_model, x), (tpu_model, x.to(TPU))):
        params = list(model.parameters())
        model(inp).sum().backward()
        dev = params[0].device
        moments = [[torch.zeros_like(p) for p in params] for _ in range(2)]
        states = [*moments, [], [torch.ones((), device=dev) for _ in params]]
        for found in (0.0, 1.0):
            torch._fused_adam_(
                params,
                [p.grad for p in params],
                *states,
                lr=0.1,
                beta1=0.9,
                beta2=0.99,
                weight_decay=0.0,
                eps=1e-8,
                amsgrad=False,
                maximize=False,
                grad_scale=torch.tensor(4.0, device=dev),
                found_inf=torch.tensor(found, device=dev),
            )
    for t, c in zip(tpu_model.parameters(), cpu_model.parameters()):
        oi.compare(t.detach(), c.detach(), "param", tol=(1e-5, 1e-5))
        oi.compare(t.grad, c.grad, "unscaled grad", tol=(1e-6, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_fused_adamw_dtype_tensor_lr(dtype):
    cpu_model = _mlp().to(dtype)
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    x = torch.randn(5, 4, dtype=dtype)
    for model, inp in ((cpu_model, x), (tpu_model, x.to(TPU))):
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True)
        for _ in range(3):
            opt.zero_grad()
            model(inp).pow(2).sum().backward()
            opt.step()
    for t, c in zip(tpu_model.parameters(), cpu_model.parameters()):
        oi.compare(t.detach(), c.detach(), "param")


def _steps(opt_cls, kwargs, start, grads, dev):
    """Parameters copied from ``start`` to ``dev`` and stepped once per entry of
    ``grads`` (the same gradients on every device); (params, optimizer)."""
    params = [p.clone().to(dev).requires_grad_() for p in start]
    opt = opt_cls(params, **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone().to(dev)  # SGD's foreach path writes into the grads
        opt.step()
    return params, opt


# float64 is left out: XLA:CPU forms its FMAs only when LLVM optimises (the suite
# compiles at level 0, Note [Compile speed in the suite]), so float64's lerp is one
# rounding apart there; test_fused_adamw_dtype_tensor_lr covers it within tolerance.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "opt_cls,kwargs",
    [
        (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
        (torch.optim.AdamW, dict(lr=0.01, betas=(0.3, 0.9), weight_decay=0.1)),
        (torch.optim.Adam, dict(lr=0.01, weight_decay=0.1)),
        (torch.optim.Adam, dict(lr=0.01, amsgrad=True, maximize=True)),
    ],
    ids=["adamw", "adamw-beta1-below-half", "adam-l2", "adam-amsgrad-maximize"],
)
def test_fused_adam_parameters_equal_cpus_bit_for_bit(opt_cls, kwargs, dtype):
    # The same gradients on both devices, so only the kernel's arithmetic can differ:
    # CPU's rounding order, its FMAs and its lerp form (Note [Fused Adam as CPU
    # computes it]). Sizes leave a remainder past any vector width.
    torch.manual_seed(0)
    start = [torch.randn(1003, dtype=dtype), torch.randn(37, 29, dtype=dtype)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(6)]
    kwargs = dict(fused=True, **kwargs)
    cpu_params, cpu_opt = _steps(opt_cls, kwargs, start, grads, "cpu")
    tpu_params, tpu_opt = _steps(opt_cls, kwargs, start, grads, TPU)
    for t, c in zip(tpu_params, cpu_params):
        n = (t.detach().cpu() != c.detach()).sum().item()
        assert n == 0, f"{n} parameters differ from CPU's"
        for key in ("exp_avg", "exp_avg_sq"):
            # One moment element in a few thousand may take CPU's scalar remainder
            # loop, which its compiler contracts on its own terms: one ulp at most.
            ours, cpus = tpu_opt.state[t][key].cpu(), cpu_opt.state[c][key]
            ulp = torch.finfo(dtype).eps * cpus.abs()
            assert ((ours - cpus).abs() <= ulp).all(), key
            assert (ours != cpus).sum() <= 2, key


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=0.1, momentum=0.9, weight_decay=0.01),
        dict(lr=0.1, momentum=0.9, nesterov=True),
        dict(lr=0.1, momentum=0.5, dampening=0.3, maximize=True),
        dict(lr=0.1),
    ],
    ids=["momentum-l2", "nesterov", "dampening-maximize", "plain"],
)
def test_fused_sgd_float32_parameters_equal_cpus_bit_for_bit(kwargs):
    # Sizes are whole multiples of every vector width, so CPU's kernel runs its
    # vectorised body only (its scalar remainder loop contracts differently).
    torch.manual_seed(0)
    start = [torch.randn(1024), torch.randn(32, 48)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(6)]
    kwargs = dict(fused=True, **kwargs)
    cpu, _ = _steps(torch.optim.SGD, kwargs, start, grads, "cpu")
    tpu, _ = _steps(torch.optim.SGD, kwargs, start, grads, TPU)
    for t, c in zip(tpu, cpu):
        n = (t.detach().cpu() != c.detach()).sum().item()
        assert n == 0, f"{n} parameters differ from CPU's"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_sgd_half_updates_every_element(dtype):
    # torch 2.13's CPU kernel leaves every whole vector block of a float16/bfloat16
    # parameter unchanged (pytorch/pytorch#191763, fixed after 2.13), so the reference
    # is CPU's single-tensor SGD, which computes in the half type between ops.
    torch.manual_seed(0)
    start = [torch.randn(1024, dtype=dtype)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(3)]
    kwargs = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    (cpu,), _ = _steps(torch.optim.SGD, dict(foreach=False, **kwargs), start, grads, "cpu")
    (tpu,), _ = _steps(torch.optim.SGD, dict(fused=True, **kwargs), start, grads, TPU)
    cpu, tpu = cpu.detach(), tpu.detach().cpu()
    assert (tpu != start[0]).float().mean() > 0.99, "fused SGD left parameters unchanged"
    torch.testing.assert_close(tpu, cpu, atol=0.02, rtol=0.02)


def test_fused_steps_are_entries_of_the_overloads_table():
    # One executable per (static hyperparameters, parameter list structure, shapes):
    # counted per overload and emptied by clear_caches, as every op's executables.
    from torchjax.device._stats import cache_info
    from torchjax.ops import executables

    adamw = torch.ops.aten._fused_adamw_.default
    executables.clear_caches(adamw)
    model = torch.nn.Linear(3, 2).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    for step in range(3):
        opt.param_groups[0]["lr"] = 0.1 / (step + 1)  # a schedule: not a new executable
        model(torch.ones(4, 3, device="tpu")).sum().backward()
        opt.step()
    info = cache_info(adamw)
    assert (info.calls, info.keys, info.traces) == (3, 1, 1)
    executables.clear_caches(adamw)
    assert cache_info(adamw).calls == 0
    opt.step()
    assert (cache_info(adamw).keys, cache_info(adamw).traces) == (1, 1)


def _duplicated_steps(opt_cls, kwargs, device):
    # A parameter group naming ``p`` twice (torch.optim warns and keeps both): CPU's fused
    # kernel updates it twice, the second time from the first's result.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64).to(device))
    q = torch.nn.Parameter(torch.randn(64).to(device))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = opt_cls([p, q, p], fused=True, **kwargs)
    for step in range(3):
        torch.manual_seed(step)
        p.grad, q.grad = torch.randn(64).to(device), torch.randn(64).to(device)
        opt.step()
    return [t.detach().cpu() for t in (p, q)]


@pytest.mark.parametrize(
    "opt_cls,kwargs",
    [
        (torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1)),
        (torch.optim.Adam, dict(lr=0.1, amsgrad=True)),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
        (torch.optim.SGD, dict(lr=0.1)),
    ],
    ids=["adamw", "adam-amsgrad", "sgd-momentum", "sgd"],
)
def test_a_parameter_listed_twice_is_updated_twice_as_on_cpu(opt_cls, kwargs):
    # Note [A fused step over shared tensors runs tensor by tensor]
    got = _duplicated_steps(opt_cls, kwargs, TPU)
    want = _duplicated_steps(opt_cls, kwargs, "cpu")
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
