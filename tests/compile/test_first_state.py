"""Note [Optimizer state made in a first call] (torchjax/compile/_made_state.py): a
jitted train step whose first call makes the state of one of torch's optimizers that
only fill it (Adam's zeros) compiles one program, run from the first call on; the
others keep compiling the state-making program first. Values equal CPU torch's."""

import pytest
import torch

import torchjax


def _models():
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    tpu = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    tpu.load_state_dict(cpu.state_dict())
    return cpu, tpu.to("tpu")


def _step(model, opt, x, zero=True):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    if zero:
        opt.zero_grad()
    return loss.detach()


def _train(make_opt, steps=3, zero=True):
    """Trace counts after each call, and the tpu model and optimizer against CPU's."""
    cpu, tpu = _models()
    opt_cpu, opt_tpu = make_opt(cpu.parameters()), make_opt(tpu.parameters())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    step = torchjax.jit(_step, static_argnames=("zero",))
    counts = []
    for _ in range(steps):
        want = _step(cpu, opt_cpu, x, zero=zero)
        got = step(tpu, opt_tpu, x.to("tpu"), zero=zero)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
        counts.append(step.trace_count)
    for p, q in zip(tpu.parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)
    for st, sc in zip(opt_tpu.state.values(), opt_cpu.state.values(), strict=True):
        assert st.keys() == sc.keys()
        for k in sc:
            torch.testing.assert_close(
                st[k].cpu().to(sc[k].dtype), sc[k], rtol=1e-4, atol=1e-5, msg=k
            )
    return counts, step


FILLS_ONLY = {
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "Adam amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "RMSprop, momentum": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.9),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
}


@pytest.mark.parametrize("name", list(FILLS_ONLY))
def test_the_first_call_runs_the_steady_program(name):
    counts, step = _train(FILLS_ONLY[name])
    # Traced twice in the first call (the second with the state as inputs), never again:
    # the later calls run that program.
    assert counts == [2, 2, 2]
    assert step.cache_hits == 2


class _MyAdamW(torch.optim.AdamW):
    pass


OTHERS = {
    # Its first step sets the momentum buffer to the gradient; later steps blend.
    "SGD momentum, dampening": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, dampening=0.5),
    "a subclass of AdamW": lambda p: _MyAdamW(p, lr=1e-2),
}


@pytest.mark.parametrize("name", list(OTHERS))
def test_other_optimizers_compile_the_state_making_program_first(name):
    counts, _ = _train(OTHERS[name])
    assert counts == [1, 2, 2]


def test_gradients_kept_by_the_step_keep_the_first_program():
    # Without zero_grad the first call also makes the gradients: not only optimizer state.
    counts, _ = _train(FILLS_ONLY["AdamW"], zero=False)
    assert counts == [1, 2, 2]


@pytest.mark.parametrize("name", ["Adam", "AdamW", "RMSprop, momentum", "NAdam"])
def test_a_step_clearing_gradients_made_outside_updates_from_the_first_call(name):
    # The gradients come from outside and the step sets them to None: a second trace of
    # the first call would find none and skip the first update.
    torch.manual_seed(0)
    w_cpu = torch.nn.Parameter(torch.randn(3))
    w_tpu = torch.nn.Parameter(w_cpu.detach().clone().to("tpu"))
    opt_cpu, opt_tpu = FILLS_ONLY[name]([w_cpu]), FILLS_ONLY[name]([w_tpu])

    def update(opt):
        opt.step()
        opt.zero_grad()

    step = torchjax.jit(update)
    for i in range(3):
        g = torch.full((3,), float(i + 1))
        w_cpu.grad, w_tpu.grad = g.clone(), g.to("tpu")
        update(opt_cpu)
        step(opt_tpu)
        torch.testing.assert_close(w_tpu.detach().cpu(), w_cpu.detach(), rtol=1e-5, atol=1e-6)
        assert w_tpu.grad is None
