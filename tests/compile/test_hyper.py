"""torchjax/compile/_hyper.py: optimizer hyperparameters and Python scalars read by a
jitted function are inputs of the program or guards, never stale constants."""

import copy

import pytest
import torch

import torchjax


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _train(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _check(tpu_model, cpu_model, what):
    for p, q in zip(tpu_model.parameters(), cpu_model.parameters()):
        d = (p.detach().cpu() - q.detach()).abs().max().item()
        assert d < 1e-5, (what, d)


SCHEDULED = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, foreach=True)),
    (torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1, fused=True)),
]


@pytest.mark.parametrize(
    "opt_cls,kwargs", SCHEDULED, ids=["sgd", "sgd-foreach", "adamw", "adamw-fused"]
)
@pytest.mark.parametrize("sched", ["lambda", "step"])
def test_lr_scheduler_under_jit_matches_cpu_without_retracing(opt_cls, kwargs, sched):
    cpu = _model()
    tpu = copy.deepcopy(cpu).to("tpu")
    opt_cpu, opt_tpu = opt_cls(cpu.parameters(), **kwargs), opt_cls(tpu.parameters(), **kwargs)

    def scheduler(opt):
        if sched == "lambda":  # a new lr every step
            return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)

    s_cpu, s_tpu = scheduler(opt_cpu), scheduler(opt_tpu)
    step = torchjax.jit(lambda x: _train(tpu, opt_tpu, x))
    g = torch.Generator().manual_seed(3)
    for i in range(6):
        x = torch.randn(4, 6, generator=g)
        _train(cpu, opt_cpu, x)
        step(x.to("tpu"))
        _check(tpu, cpu, f"parameters after step {i}")
        s_cpu.step()
        s_tpu.step()
        assert opt_tpu.param_groups[0]["lr"] == opt_cpu.param_groups[0]["lr"]
        assert isinstance(opt_tpu.param_groups[0]["lr"], float)  # the trace put it back
    # The first call creates the optimizer state; lr is an input: no retrace after that.
    assert step.trace_count == 2, step.last_retrace_reason


@pytest.mark.parametrize(
    "opt_cls,kwargs,change",
    [
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9), dict(momentum=0.5)),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9), dict(weight_decay=0.2)),
        (torch.optim.AdamW, dict(lr=0.05), dict(betas=(0.5, 0.9))),
        (torch.optim.AdamW, dict(lr=0.05), dict(eps=1e-2, weight_decay=0.3)),
        (torch.optim.Adagrad, dict(lr=0.1), dict(lr=0.01)),
    ],
    ids=["sgd-momentum", "sgd-weight-decay", "adamw-betas", "adamw-eps-wd", "adagrad-lr"],
)
def test_other_hyperparameters_are_guards(opt_cls, kwargs, change):
    cpu = _model()
    tpu = copy.deepcopy(cpu).to("tpu")
    opt_cpu, opt_tpu = opt_cls(cpu.parameters(), **kwargs), opt_cls(tpu.parameters(), **kwargs)
    step = torchjax.jit(lambda x: _train(tpu, opt_tpu, x))
    x = torch.randn(4, 6)
    for i in range(5):
        if i == 3:
            opt_cpu.param_groups[0].update(change)
            opt_tpu.param_groups[0].update(change)
            before = step.trace_count
        _train(cpu, opt_cpu, x)
        step(x.to("tpu"))
        _check(tpu, cpu, f"parameters after step {i}")
    assert step.trace_count > before
    assert "Python scalars" in step.last_retrace_reason


def test_python_numbers_in_closure_and_globals_are_guards():
    scale = 2.0
    f = torchjax.jit(lambda x: x * scale + OFFSET)
    x = torch.ones(3, device="tpu")
    assert f(x).tolist() == [3.0, 3.0, 3.0]
    scale = 5.0
    assert f(x).tolist() == [6.0, 6.0, 6.0]
    globals()["OFFSET"] = 10.0
    assert f(x).tolist() == [15.0, 15.0, 15.0]
    assert f.trace_count == 3
    assert f(x).tolist() == [15.0, 15.0, 15.0] and f.trace_count == 3


OFFSET = 1.0


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam], ids=["SGD", "Adam"])
@pytest.mark.parametrize(
    "sched",
    [
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e),
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=10),
    ],
    ids=["LambdaLR", "StepLR", "OneCycleLR"],
)
def test_a_scheduler_stepped_inside_the_function_is_refused(opt_cls, sched):
    # Note [Learning rates assigned while tracing]: the new rate was lost, silently.
    p = torch.nn.Parameter(torch.ones(2, device="tpu"))
    opt = opt_cls([p], lr=1.0)
    scheduler = sched(opt)

    @torchjax.jit
    def step():
        p.sum().backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()

    with pytest.raises(RuntimeError, match=r"sets an optimizer's lr \(scheduler.step\(\) inside"):
        step()
    assert not isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # the group is restored
