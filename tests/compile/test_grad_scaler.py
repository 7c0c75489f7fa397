"""torchjax/compile/_grad_scaler.py: a train step with torch.amp.GradScaler compiles under
torchjax.jit and gives eager CPU's scales, skipped steps and parameters (Note [GradScaler
steps in compiled programs])."""

import functools

import pytest
import torch

import torchjax

_OPTIMIZERS = {
    "sgd_momentum": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, dampening=0.5),
    "adam": functools.partial(torch.optim.Adam, lr=1e-2),
    "adamw_fused": functools.partial(torch.optim.AdamW, lr=1e-2, fused=True),
}


def _train(device, make_opt, *, jit, infs, steps=6, clip=False):
    """Per step: the scale after it, its loss, the parameters and the optimizer state;
    and the step function run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(
        device
    )
    opt = make_opt(model.parameters())
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=2)

    def step(x):
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss.detach()

    run = torchjax.jit(step) if jit else step
    history = []
    for i in range(steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
        if i in infs:
            x[0, 0] = float("inf")  # non-finite gradients: the step is skipped
        loss = run(x.to(device))
        state = [
            {k: v.detach().cpu().clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
            for s in opt.state.values()
        ]
        params = [p.detach().cpu().clone() for p in model.parameters()]
        history.append((scaler.get_scale(), loss.cpu(), params, state))
    return history, run


def _assert_same(got, want):
    for (scale, loss, params, state), (w_scale, w_loss, w_params, w_state) in zip(
        got, want, strict=True
    ):
        assert scale == w_scale
        torch.testing.assert_close(loss, w_loss, equal_nan=True)
        # Compiled Adam computes its bias corrections in float32 tensors (capturable), as
        # CUDA does: ~1e-5 relative from eager's Python floats.
        torch.testing.assert_close(params, w_params, rtol=1e-4, atol=1e-6)
        # A first step skipped under jit leaves Adam's state at its initial values where
        # eager leaves none; the values that follow are the same.
        if len(state) == len(w_state):
            for s, w in zip(state, w_state):
                for k in w:
                    torch.testing.assert_close(s[k].float(), w[k].float(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
@pytest.mark.parametrize("infs", [(0, 3), (2,)], ids=["first-and-fourth-skipped", "third"])
def test_compiled_scaler_steps_match_eager_cpu(name, infs):
    want, _ = _train("cpu", _OPTIMIZERS[name], jit=False, infs=infs)
    eager, _ = _train("tpu", _OPTIMIZERS[name], jit=False, infs=infs)
    got, run = _train("tpu", _OPTIMIZERS[name], jit=True, infs=infs)
    assert [s for s, *_ in want] == (
        [512, 512, 1024, 512, 512, 1024] if infs == (0, 3) else [1024, 2048, 1024, 1024, 2048, 2048]
    )
    _assert_same(eager, want)
    _assert_same(got, want)
    # The calls that made the scaler's or the optimizer's state ran eagerly; then one
    # program serves every step, skipped or not.
    assert run.trace_count <= 3 and run.cache_hits >= 3


def test_unscale_and_clipping_before_the_step():
    want, _ = _train("cpu", _OPTIMIZERS["sgd_momentum"], jit=False, infs=(1,), clip=True)
    got, run = _train("tpu", _OPTIMIZERS["sgd_momentum"], jit=True, infs=(1,), clip=True)
    _assert_same(got, want)
    assert run.cache_hits >= 3


def test_a_step_making_state_under_another_trace_is_refused():
    # Under jax.jit of torch code (not torchjax.jit), no call can run eagerly instead.
    import jax
    import jax.numpy as jnp

    def f(w_arr):
        w = torchjax.from_jax(w_arr).requires_grad_()
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("tpu")
        scaler.scale(w.square().sum()).backward()
        scaler.step(opt)
        return torchjax.to_jax(w.detach())

    with pytest.raises(RuntimeError, match=r"GradScaler.step\(SGD\) under a trace made"):
        jax.jit(f)(jnp.ones(3))


class _Replacing(torch.optim.Optimizer):
    """An optimizer that makes a new state tensor every step instead of writing it."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                avg = state.get("avg")
                state["avg"] = avg = p.grad.clone() if avg is None else 0.5 * avg + p.grad
                p.sub_(group["lr"] * avg)


def test_an_optimizer_that_replaces_its_state():
    want, _ = _train("cpu", _Replacing, jit=False, infs=(0, 3))
    got, _ = _train("tpu", _Replacing, jit=True, infs=(0, 3))
    _assert_same(got, want)


def test_an_adam_first_step_compiles_once_the_scale_exists():
    # Note [Optimizer state made in a first call]: the state the masked step made is put
    # back to its fills and traced again as input, so the first call runs the program.
    def run(device, jit):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
        scaler.scale(torch.ones((), device=device))  # makes the scale

        def step(x):
            scaler.scale(model(x).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

        f = torchjax.jit(step) if jit else step
        for i in range(2):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
            if i == 0:
                x[0, 0] = float("inf")
            f(x.to(device))
        return f, scaler.get_scale(), [p.detach().cpu() for p in model.parameters()]

    f, scale, params = run("tpu", True)
    _, want_scale, want = run("cpu", False)
    assert scale == want_scale == 512
    torch.testing.assert_close(params, want, rtol=1e-4, atol=1e-6)
    assert f.trace_count == 2 and f.cache_hits == 1
