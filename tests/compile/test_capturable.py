"""Compiled optimizers on tpu (torchjax/compile/_capturable.py): a train step under a
learning-rate schedule compiles a fixed number of programs and gives CPU eager's
parameters, in the parameters' own dtype (Note [Step counters of compiled optimizers
are float64])."""

import pytest
import torch
import torch.nn.functional as F

import torchjax

STEPS = 8

# (optimizer, its arguments, OneCycleLR's max_lr): OneCycleLR sets lr every step, and
# Adam's betas or SGD's momentum (cycle_momentum) with it.
OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1), 0.05),
    "Adam": (torch.optim.Adam, dict(lr=0.01), 0.05),
    "SGD": (torch.optim.SGD, dict(lr=0.01, momentum=0.9), 0.1),
}

# How far from CPU eager the compiled step may land after STEPS steps. Eager tpu gives
# CPU's float32 parameters to 6e-8 (the model's own ops); float32 step counters gave
# 2e-6 for Adam, float64 parameters included.
TOLERANCE = {
    torch.float64: dict(rtol=0, atol=1e-14),
    torch.float32: dict(rtol=0, atol=4e-7),
    # the compiled step is torch's capturable foreach one (the default on tpu, as on
    # CUDA): it divides by bias corrections rounded to bfloat16 and rounds its decays'
    # numbers to bfloat16 (in-place foreach mul_), where eager CPU's single-tensor loop
    # multiplies by Python floats: up to three bfloat16 steps apart after STEPS steps
    # (one with the single-tensor loop compiled)
    torch.bfloat16: dict(rtol=2**-6, atol=2**-9),
}


def _traces():
    return torchjax.compile.dynamo_stats()["traces"]


def _train(device, compiler, name, dtype, cycle_momentum=True):
    """Parameters after STEPS scheduled steps, and the traces counted after step 3 and
    after the last."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = model.to(dtype).to(device)
    cls, kwargs, max_lr = OPTIMIZERS[name]
    opt = cls(model.parameters(), **kwargs)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=max_lr, total_steps=STEPS, cycle_momentum=cycle_momentum
    )

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    if compiler == "torch.compile":
        run = torch.compile(step, backend="tpu")
    elif compiler == "torchjax.jit":
        run = torchjax.jit(step)
    else:
        run = step
    gen = torch.Generator().manual_seed(1)
    before, counts = _traces(), []
    for i in range(STEPS):
        x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)
        run(x.to(dtype).to(device), y.to(dtype).to(device))
        sched.step()
        if i in (2, STEPS - 1):
            counts.append(run.trace_count if compiler == "torchjax.jit" else _traces() - before)
    return [p.detach().cpu() for p in model.parameters()], counts, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_one_cycle_lr_compiled_step_gives_cpus_parameters_without_retracing(name, dtype):
    cpu, _, _ = _train("cpu", None, name, dtype)
    tpu, (after_3, after_all), opt = _train("tpu", "torch.compile", name, dtype)
    for got, want in zip(tpu, cpu):
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    # a new lr (and betas, momentum) every step: the programs of the first steps serve
    # every later value
    assert 0 < after_3 == after_all <= 4, (after_3, after_all)
    for state in opt.state.values():
        if "step" in state:
            assert state["step"].dtype == torch.float64 and state["step"].item() == STEPS


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_jitted_adam_step_gives_cpus_parameters(dtype):
    # torchjax.jit takes lr as an input; betas are guarded, so they stay fixed here
    kwargs = dict(cycle_momentum=False)
    cpu, _, _ = _train("cpu", None, "AdamW", dtype, **kwargs)
    tpu, (after_3, after_all), _ = _train("tpu", "torchjax.jit", "AdamW", dtype, **kwargs)
    for got, want in zip(tpu, cpu):
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    assert after_3 == after_all <= 3, (after_3, after_all)


def test_a_loaded_float32_step_counter_is_widened_and_keeps_counting():
    # load_state_dict casts a capturable optimizer's step to float32 on the device
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, device="tpu"))
    opt = torch.optim.Adam([w], lr=0.1)

    @torch.compile(backend="tpu")
    def step(x):
        (w * x).square().sum().backward()
        opt.step()
        opt.zero_grad()

    torch._dynamo.reset()
    x = torch.tensor([1.0, 3.0, -1.0], dtype=torch.float64)
    step(x.to("tpu"))
    saved = opt.state_dict()
    opt.load_state_dict(saved)
    assert opt.state[w]["step"].dtype == torch.float32
    step(x.to("tpu"))
    assert opt.state[w]["step"].dtype == torch.float64 and opt.state[w]["step"].item() == 2

    cpu_w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    cpu_opt = torch.optim.Adam([cpu_w], lr=0.1)
    for _ in range(2):
        (cpu_w * x).square().sum().backward()
        cpu_opt.step()
        cpu_opt.zero_grad()
    torch.testing.assert_close(w.detach().cpu(), cpu_w.detach(), rtol=0, atol=1e-15)
