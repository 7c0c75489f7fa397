"""torch.func transforms inside compiled functions (Note [torch.func transforms in compiled
programs] in torchjax/compile/_func_transforms.py): grad, vjp, jacrev, hessian and vmap of a
grad give CPU's values under torchjax.jit and torch.compile(backend="tpu"), and a
backward() through them gives CPU's gradients."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, hessian, jacrev, vjp, vmap

import torchjax

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

COMPILERS = ["torchjax.jit", "torch.compile"]


def _compiled(name, fn):
    return torchjax.jit(fn) if name == "torchjax.jit" else torch.compile(fn, backend="tpu")


def _hooks_as_found():
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def _check(compiler, make, *args):
    """``make(device)`` run on CPU and compiled on tpu, twice (the second call runs the
    cached program), on the same ``args``."""
    want = make("cpu")(*args)
    f = _compiled(compiler, make("tpu"))
    for _ in range(2):
        got = f(*(a.to("tpu") for a in args))
        torch.testing.assert_close(
            torch.utils._pytree.tree_map(lambda t: t.cpu(), got), want, rtol=1e-5, atol=1e-6
        )
    _hooks_as_found()
    if compiler == "torchjax.jit":
        assert f.trace_count == 1


@pytest.mark.parametrize("compiler", COMPILERS)
def test_grad(compiler):
    w = torch.randn(5)

    def make(device):
        wd = w.to(device)
        return lambda x: grad(lambda x: (x.sin() * wd).sum())(x)

    _check(compiler, make, torch.randn(5))


@pytest.mark.parametrize("compiler", COMPILERS)
def test_vjp(compiler):
    def make(device):
        def f(x, v):
            out, pullback = vjp(lambda x: x.exp() * x.sum(), x)
            return out, pullback(v)[0]

        return f

    _check(compiler, make, torch.randn(4), torch.randn(4))


@pytest.mark.parametrize("compiler", COMPILERS)
def test_jacrev(compiler):
    w = torch.randn(3, 4)

    def make(device):
        wd = w.to(device)
        return lambda x: jacrev(lambda x: torch.tanh(wd @ x))(x)

    _check(compiler, make, torch.randn(4))


@pytest.mark.parametrize("compiler", COMPILERS)
def test_hessian(compiler):
    def make(device):
        return lambda x: hessian(lambda x: (x.sin() * x.roll(1)).sum())(x)

    _check(compiler, make, torch.randn(4))


def _per_sample_grads(model, detach: bool):
    def loss(params, x, y):
        out = functional_call(model, params, (x.unsqueeze(0),))
        return F.cross_entropy(out, y.unsqueeze(0))

    def f(x, y):
        params = {k: v.detach() if detach else v for k, v in model.named_parameters()}
        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)

    return f


@pytest.mark.parametrize("detach", [True, False], ids=["detached", "parameters"])
@pytest.mark.parametrize("compiler", COMPILERS)
def test_per_sample_gradients_of_a_module(compiler, detach):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    models = {"cpu": model, "tpu": copy.deepcopy(model).to("tpu")}
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    _check(compiler, lambda device: _per_sample_grads(models[device], detach), x, y)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_backward_through_a_grad(compiler):
    # The graph outside the transform reaches values saved inside it: the program's VJP
    # is jax's (Note [torch.func transforms in compiled programs]).
    def f(x, w):
        return grad(lambda x: (x.sin() * x * w).sum())(x).square().sum()

    x, w = torch.randn(4), torch.randn(4)
    grads = {}
    for device, fn in (("cpu", f), ("tpu", _compiled(compiler, f))):
        xs, ws = (t.detach().to(device).requires_grad_() for t in (x, w))
        fn(xs, ws).backward()
        grads[device] = (xs.grad.cpu(), ws.grad.cpu())
    torch.testing.assert_close(grads["tpu"], grads["cpu"])
    _hooks_as_found()


@pytest.mark.parametrize("compiler", COMPILERS)
def test_train_step_with_an_input_gradient_penalty(compiler):
    # A gradient penalty taken with torch.func.grad, then loss.backward() and a step:
    # the parameters move as on CPU.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(5, 3)
    params = {}
    for device in ("cpu", "tpu"):
        m = copy.deepcopy(model).to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x, m=m, opt=opt):
            penalty = grad(lambda x: m(x).sum())(x).square().sum()
            loss = m(x).square().mean() + penalty
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        run = step if device == "cpu" else _compiled(compiler, step)
        for _ in range(2):
            run(x.to(device))
        params[device] = [p.detach().cpu() for p in m.parameters()]
    torch.testing.assert_close(params["tpu"], params["cpu"], rtol=1e-5, atol=1e-6)
    _hooks_as_found()


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_checkpointed_region_beside_a_grad_keeps_torchs_backward(compiler):
    # Non-reentrant checkpointing pushes hooks of its own inside the trace's; outside
    # the transform both work as before.
    from torch.utils.checkpoint import checkpoint

    def f(x, w):
        g = grad(lambda x: (x.cos() * 2).sum())(x.detach())
        y = checkpoint(lambda a: (a * w).sin(), x, use_reentrant=False)
        return (y * g).sum()

    x, w = torch.randn(4), torch.randn(4)
    grads = {}
    for device, fn in (("cpu", f), ("tpu", _compiled(compiler, f))):
        xs, ws = (t.detach().to(device).requires_grad_() for t in (x, w))
        fn(xs, ws).backward()
        grads[device] = (xs.grad.cpu(), ws.grad.cpu())
    torch.testing.assert_close(grads["tpu"], grads["cpu"])
    _hooks_as_found()


def _grad_under_user_hooks(x):
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        return grad(lambda x: x.sin().sum())(x)


def test_only_the_traces_own_hooks_leave_the_stack():
    # torch refuses a transform under the user's hooks in eager, and so does the
    # compiled function; without them it runs.
    x = torch.randn(3)
    f = torchjax.jit(lambda x: grad(lambda x: x.sin().sum())(x))
    torch.testing.assert_close(f(x.to("tpu")).cpu(), x.cos())
    with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
        _grad_under_user_hooks(x)
    with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
        torchjax.jit(_grad_under_user_hooks)(x.to("tpu"))
    _hooks_as_found()
