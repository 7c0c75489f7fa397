"""Note [State after a trace whose program does not run] (torchjax/compile/_rollback.py):
a torchjax.jit call whose trace raises, after ``backward()`` or ``optimizer.step()`` ran
inside it, leaves the state as it was (``.grad``s, optimizer state, a GradScaler's) and
its exception unchanged; the next eager and compiled steps match CPU torch."""

import pytest
import torch

import torchjax
from torchjax.compile import _entry
from torchjax.compile._capturable import make_capturable


def _models():
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    tpu = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    tpu.load_state_dict(cpu.state_dict())
    return cpu, tpu.to("tpu")


def _x(i):
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(i))


def _step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _values(model, opt):
    """Each parameter's ``.grad`` (object, values) and each state entry's (object,
    values), by parameter position."""
    grads = [(p.grad, None if p.grad is None else p.grad.cpu().clone()) for p in model.parameters()]
    state = {}
    for i, p in enumerate(model.parameters()):
        if p in opt.state:
            entry = opt.state[p]
            state[i] = (entry, {k: (v, v.cpu().clone()) for k, v in entry.items()})
    return grads, state


def _assert_unchanged(model, opt, before):
    grads, state = _values(model, opt)
    want_grads, want_state = before
    for (g, values), (want_g, want_values) in zip(grads, want_grads, strict=True):
        assert g is want_g
        if want_values is not None:
            torch.testing.assert_close(values, want_values, rtol=0, atol=0)
    assert state.keys() == want_state.keys()
    for i, (entry, values) in state.items():
        want_entry, want_values = want_state[i]
        assert entry is want_entry and values.keys() == want_values.keys()
        for k, (v, value) in values.items():
            assert v is want_values[k][0], k
            torch.testing.assert_close(value, want_values[k][1], rtol=0, atol=0, msg=k)


def _assert_matches(cpu, opt_cpu, tpu, opt_tpu):
    for p, q in zip(tpu.parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-6)
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6)
    for st, sc in zip(opt_tpu.state.values(), opt_cpu.state.values(), strict=True):
        assert st.keys() == sc.keys()
        for k in sc:
            torch.testing.assert_close(st[k].cpu().to(sc[k].dtype), sc[k], rtol=1e-5, atol=1e-6)


def _then_steps_match(cpu, opt_cpu, tpu, opt_tpu):
    """An eager step, then a compiled one: both match CPU torch's."""
    want = _step(cpu, opt_cpu, _x(1))
    got = _step(tpu, opt_tpu, _x(1).to("tpu"))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
    _assert_matches(cpu, opt_cpu, tpu, opt_tpu)
    want = _step(cpu, opt_cpu, _x(2))
    got = torchjax.jit(_step)(tpu, opt_tpu, _x(2).to("tpu"))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
    _assert_matches(cpu, opt_cpu, tpu, opt_tpu)


# (where the error is raised, whether the optimizer already has state, whether the
# parameters already have gradients)
CASES = {
    "after backward": ("backward", False, False),
    "after backward, gradients kept": ("backward", False, True),
    "after step, fresh optimizer": ("step", False, False),
    "after step, optimizer with state": ("step", True, False),
    "after step, optimizer with state, gradients kept": ("step", True, True),
}


@pytest.mark.parametrize("case", CASES)
def test_a_user_error_leaves_the_state_as_it_was(case):
    where, stepped, with_grads = CASES[case]
    cpu, tpu = _models()
    opt_cpu = torch.optim.Adam(cpu.parameters(), lr=1e-2)
    # capturable from the start: torchjax.jit switches it on and moves an existing state's
    # step counter to the device first, and this test compares state entries by identity.
    opt_tpu = torch.optim.Adam(tpu.parameters(), lr=1e-2, capturable=True)
    if stepped:
        _step(cpu, opt_cpu, _x(0))
        _step(tpu, opt_tpu, _x(0).to("tpu"))
    if with_grads:
        cpu(_x(3)).sum().backward()
        tpu(_x(3).to("tpu")).sum().backward()
    # torchjax.jit also widens the step counters of an optimizer it meets to float64, new
    # tensors (Note [Step counters of compiled optimizers are float64]): done here first,
    # as the meeting does, so the entries compared by identity are the ones it keeps.
    make_capturable(opt_tpu)
    error = ValueError("user error")

    def failing(x):
        tpu(x).square().mean().backward()
        if where == "step":
            opt_tpu.step()
        raise error

    before = _values(tpu, opt_tpu)
    with pytest.raises(ValueError) as info:
        torchjax.jit(failing)(_x(4).to("tpu"))
    assert info.value is error and str(info.value) == "user error"
    _assert_unchanged(tpu, opt_tpu, before)
    _then_steps_match(cpu, opt_cpu, tpu, opt_tpu)


def test_a_step_that_clears_gradients_then_fails_keeps_them():
    cpu, tpu = _models()
    tpu(_x(3).to("tpu")).sum().backward()
    opt = torch.optim.SGD(tpu.parameters(), lr=0.1)

    def failing(x):
        opt.zero_grad()  # sets every .grad to None
        raise KeyError("late")

    before = _values(tpu, opt)
    with pytest.raises(KeyError, match="late"):
        torchjax.jit(failing)(_x(4).to("tpu"))
    _assert_unchanged(tpu, opt, before)


def test_a_grad_scaler_step_refused_under_jit_leaves_the_scaler_as_it_was():
    # A read of a traced value into Python after GradScaler.step: refused in a trace,
    # after the scaler made its scale and unscaled the gradients there.
    cpu, tpu = _models()
    opt_cpu = torch.optim.SGD(cpu.parameters(), lr=0.1)
    opt_tpu = torch.optim.SGD(tpu.parameters(), lr=0.1)
    scaler_cpu = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scaler_tpu = torch.amp.GradScaler("tpu", init_scale=2.0**10, growth_interval=2)

    def scaled_step(model, opt, scaler, x, read=False):
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(opt)
        if read:
            print(scaler._scale.item())
        scaler.update()
        opt.zero_grad()

    before = dict(vars(scaler_tpu))
    with pytest.raises(torchjax.DataDependentError, match="_local_scalar_dense"):
        torchjax.jit(scaled_step)(tpu, opt_tpu, scaler_tpu, _x(4).to("tpu"), True)
    assert vars(scaler_tpu) == before  # no scale made, no optimizer recorded as unscaled
    assert all(p.grad is None for p in tpu.parameters()) and not opt_tpu.state
    for i in range(3):
        scaled_step(cpu, opt_cpu, scaler_cpu, _x(i))
        scaled_step(tpu, opt_tpu, scaler_tpu, _x(i).to("tpu"))
        assert scaler_tpu.get_scale() == scaler_cpu.get_scale()
        _assert_matches(cpu, opt_cpu, tpu, opt_tpu)


def test_a_first_run_that_fails_leaves_the_state_as_it_was(monkeypatch):
    # A program that failed to compile or run (out of memory) never wrote back the
    # state its trace made.
    cpu, tpu = _models()
    opt_cpu = torch.optim.Adam(cpu.parameters(), lr=1e-2)
    opt_tpu = torch.optim.Adam(tpu.parameters(), lr=1e-2)

    def fails(self, call):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    with monkeypatch.context() as m:
        m.setattr(_entry.Entry, "run", fails)
        with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
            torchjax.jit(_step)(tpu, opt_tpu, _x(4).to("tpu"))
    assert all(p.grad is None for p in tpu.parameters()) and not opt_tpu.state
    _then_steps_match(cpu, opt_cpu, tpu, opt_tpu)


def test_traces_whose_program_does_not_run_leave_the_state_as_it_was():
    # Jitted.trace runs no program; repeat refuses a step that makes state.
    cpu, tpu = _models()
    opt_cpu = torch.optim.Adam(cpu.parameters(), lr=1e-2)
    opt_tpu = torch.optim.Adam(tpu.parameters(), lr=1e-2)
    step = torchjax.jit(_step)
    step.trace(tpu, opt_tpu, _x(4).to("tpu"))
    assert all(p.grad is None for p in tpu.parameters()) and not opt_tpu.state
    with pytest.raises(RuntimeError, match="creates state when traced"):
        step.repeat(2, tpu, opt_tpu, _x(4).to("tpu"))
    assert all(p.grad is None for p in tpu.parameters()) and not opt_tpu.state
    _then_steps_match(cpu, opt_cpu, tpu, opt_tpu)


def test_a_step_run_eagerly_for_shared_arguments_starts_from_the_state_before_its_trace():
    # Note [Arguments that share memory]: the traced step wrote an argument that views a
    # buffer, so the call runs the function eagerly after tracing it.
    cpu, tpu = _models()
    opt_cpu = torch.optim.Adam(cpu.parameters(), lr=1e-2)
    opt_tpu = torch.optim.Adam(tpu.parameters(), lr=1e-2)
    for model in (cpu, tpu):
        model.register_buffer("count", torch.zeros(2, device=next(model.parameters()).device))

    def counted(model, opt, x, count):  # keeps the gradients its backward made
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        count.add_(1)
        return loss.detach()

    want = counted(cpu, opt_cpu, _x(0), cpu.count[:])
    got = torchjax.jit(counted)(tpu, opt_tpu, _x(0).to("tpu"), tpu.count[:])
    torch.testing.assert_close(got.cpu(), want)
    torch.testing.assert_close(tpu.count.cpu(), cpu.count)
    _assert_matches(cpu, opt_cpu, tpu, opt_tpu)
    opt_cpu.zero_grad()
    opt_tpu.zero_grad()
    _then_steps_match(cpu, opt_cpu, tpu, opt_tpu)


def test_only_references_that_reach_tpu_tensors_are_put_back():
    # A cache list given a traced tensor and an attribute set to one are put back; a
    # list of the shapes traced and a counter keep what the Python did.
    class Cache:
        def __init__(self):
            self.keys = []
            self.last = None
            self.calls = 0

    cache, shapes = Cache(), []

    def failing(x):
        shapes.append(tuple(x.shape))
        cache.calls += 1
        cache.keys.append(x * 2)
        cache.last = x + 1
        raise ValueError("after the cache was written")

    with pytest.raises(ValueError, match="after the cache"):
        torchjax.jit(failing)(torch.ones(2, device="tpu"))
    assert cache.keys == [] and cache.last is None
    assert shapes == [(2,)] and cache.calls == 1


def test_export_leaves_a_buffer_its_trace_assigned_as_it_was():
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)
            self.register_buffer("total", torch.zeros(2))

        def forward(self, x):
            y = self.lin(x)
            self.total = self.total + y.sum(0)  # a new tensor: the buffer is reassigned
            return y

    m = Counting().to("tpu")
    total = m.total
    torchjax.export(m, torch.ones(3, 4, device="tpu"))
    assert m.total is total
    m(torch.ones(3, 4, device="tpu"))  # eager, from the buffer as it was
    want = m.lin(torch.ones(3, 4, device="tpu")).sum(0)
    torch.testing.assert_close(m.total.cpu(), want.detach().cpu())
