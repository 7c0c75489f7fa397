"""The backward of a compiled function is torch's autograd graph of its trace: the
gradients eager (and CPU) gives, where differentiating the traced forward would not.

See Note [The compiled VJP is torch's autograd] in torchjax/compile/_autograd.py.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import torchjax


def _compiler(name):
    return torchjax.jit if name == "jit" else (lambda f: torch.compile(f, backend="tpu"))


def _grads(fn, compiler, *shapes, seed=0, values=None):
    """The gradients of ``fn(*args).sum()`` w.r.t. every argument, on CPU and compiled
    on tpu."""
    out = {}
    for dev, f in (("cpu", fn), ("tpu", _compiler(compiler)(fn))):
        g = torch.Generator().manual_seed(seed)
        args = values if values is not None else [torch.randn(s, generator=g) for s in shapes]
        args = [a.clone().to(dev).requires_grad_() for a in args]
        f(*args).sum().backward()
        out[dev] = [a.grad.cpu() for a in args]
    return out["tpu"], out["cpu"]


class _RoundStraightThrough(torch.autograd.Function):
    # A straight-through estimator: its backward is not the derivative of its forward.
    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(scale)
        return (x * scale).round()

    @staticmethod
    def backward(ctx, g):
        (scale,) = ctx.saved_tensors
        return g * scale * 3, None


@pytest.mark.parametrize("compiler", ["jit", "dynamo"])
def test_custom_function_backward_is_the_one_run(compiler):
    def f(x, w):
        return _RoundStraightThrough.apply(x * w, torch.full_like(x, 0.5)) ** 2

    got, want = _grads(f, compiler, (4, 3), (4, 3))
    assert all(g.abs().sum() > 0 for g in want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


_EDGES = {
    # Each gives CPU 0 where differentiating the traced forward gives NaN or another
    # value: derivatives.yaml's own conventions.
    "normalize of a zero row": lambda x: F.normalize(x * (x > 100), dim=1),
    "norm of zeros": lambda x: torch.linalg.vector_norm(x * 0, dim=1),
    "cdist of identical points": lambda x: torch.cdist(x, x),
    "pow 0 at 0": lambda x: (x * 0) ** 0.0,
}


@pytest.mark.parametrize("compiler", ["jit", "dynamo"])
@pytest.mark.parametrize("name", sorted(_EDGES))
def test_gradients_at_edge_points_are_torchs(name, compiler):
    got, want = _grads(_EDGES[name], compiler, (3, 4))
    assert not want[0].isnan().any()
    torch.testing.assert_close(got[0], want[0])


@pytest.mark.parametrize("compiler", ["jit", "dynamo"])
def test_embedding_scale_grad_by_freq(compiler):
    grads = {}
    for dev in ("cpu", "tpu"):
        torch.manual_seed(0)
        m = torch.nn.Embedding(6, 3, scale_grad_by_freq=True).to(dev)
        f = m if dev == "cpu" else _compiler(compiler)(m)
        (f(torch.tensor([[1, 1, 1, 4], [4, 2, 1, 0]]).to(dev)) * 2).sum().backward()
        grads[dev] = m.weight.grad.cpu()
    assert grads["cpu"][1].abs().sum() > 0
    torch.testing.assert_close(grads["tpu"], grads["cpu"])


def test_hook_on_an_intermediate_changes_the_gradient():
    def f(x, w):
        y = x * w
        y.register_hook(lambda g: g * 10)
        return y

    got, want = _grads(f, "jit", (3,), (3,))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
        assert (w != 0).all()


def test_hooks_of_leaves_run_once():
    calls = {"cpu": 0, "tpu": 0}
    grads = {}

    def f(x, w):
        return (x * w).sum()

    for dev, fn in (("cpu", f), ("tpu", torchjax.jit(f))):
        w = torch.ones(3, device=dev, requires_grad=True)

        def hook(g, dev=dev):
            calls[dev] += 1
            return g * 2

        w.register_hook(hook)
        fn(torch.arange(3.0, device=dev), w).backward()
        grads[dev] = w.grad.cpu()
    assert calls == {"cpu": 1, "tpu": 1}
    torch.testing.assert_close(grads["tpu"], grads["cpu"])


class _FlatBuffer(torch.nn.Module):
    # Parameters viewing one flat buffer, as FSDP's flat parameters and some
    # fused-optimizer layouts hold them.
    def __init__(self, flat):
        super().__init__()
        self.weight = torch.nn.Parameter(flat[:12].view(3, 4))
        self.bias = torch.nn.Parameter(flat[12:15])

    def forward(self, x):
        return F.linear(x, self.weight, self.bias).tanh().sum()


def test_parameters_viewing_one_buffer_each_get_their_gradient():
    flat = torch.randn(16, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    cpu = _FlatBuffer(flat.clone())
    cpu(x).backward()
    tpu = _FlatBuffer(flat.to("tpu"))
    assert tpu.weight.untyped_storage().data_ptr() == tpu.bias.untyped_storage().data_ptr()
    torchjax.jit(tpu)(x.to("tpu")).backward()
    for p, q in zip(tpu.parameters(), cpu.parameters()):
        assert p.grad is not None
        torch.testing.assert_close(p.grad.cpu(), q.grad)


@pytest.mark.parametrize("shared", ["output and its view", "two views of one result"])
def test_outputs_sharing_an_intermediate_give_cpu_gradients(shared):
    def f(x):
        y = x.exp() * 2
        return (y[0], y) if shared == "output and its view" else (y[:, 1], y[:, :2])

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    grads = []
    for dev, fn in (("cpu", f), ("tpu", torchjax.jit(f))):
        leaf = x.clone().to(dev).requires_grad_()
        a, b = fn(leaf)
        (a.sum() * 3 + (b * b).sum()).backward()
        grads.append(leaf.grad.cpu())
    torch.testing.assert_close(grads[0], grads[1])


def test_saved_tensor_written_in_place_raises_at_backward():
    def f(w):
        y = w.sigmoid()
        y.mul_(2)
        return y.sum()

    w = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as cpu:
        f(w).backward()
    out = torchjax.jit(f)(w.detach().to("tpu").requires_grad_())
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as tpu:
        out.backward()
    tail = "is at version 1; expected version 0 instead"
    assert tail in str(cpu.value) and tail in str(tpu.value)


def test_second_backward_raises_as_on_cpu():
    cpu = torch.nn.Linear(3, 2)
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(4, 3)
    for fn, dev in ((cpu, "cpu"), (torchjax.jit(tpu), "tpu")):
        loss = fn(x.to(dev)).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
    torch.testing.assert_close(tpu.weight.grad.cpu(), cpu.weight.grad)


def test_step_returning_its_loss_undetached_cannot_backward_again():
    # The step's own backward() freed the graph, as on CPU.
    def step(w):
        loss = (w * w).sum()
        loss.backward()
        return loss

    for fn, dev in ((step, "cpu"), (torchjax.jit(step), "tpu")):
        w = torch.ones(3, device=dev, requires_grad=True)
        loss = fn(w)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()


class _KeptInContext(torch.autograd.Function):
    # Keeps its input on ctx instead of saving it: the graph reaches a value of the
    # trace that the saved tensors do not carry.
    @staticmethod
    def forward(ctx, x):
        ctx.x = x
        return x**3

    @staticmethod
    def backward(ctx, g):
        return g * 3 * ctx.x**2


def test_graph_reaching_past_its_saved_tensors_falls_back_to_jax():
    def f(x):
        return _KeptInContext.apply(x.sin())

    jitted = torchjax.jit(f)
    x = torch.randn(5, generator=torch.Generator().manual_seed(0))
    got, want = (x.clone().to(d).requires_grad_() for d in ("tpu", "cpu"))
    jitted(got).sum().backward()
    f(want).sum().backward()
    torch.testing.assert_close(got.grad.cpu(), want.grad)
    (entry,) = jitted._entries.values()
    assert entry.vjp is not None and not entry.vjp.from_torch


class _ScaleKeepingArgument(torch.autograd.Function):
    # Keeps an argument of the compiled function on ctx, and its backward is not the
    # forward's derivative.
    @staticmethod
    def forward(ctx, x, w):
        ctx.w = w
        return x * w

    @staticmethod
    def backward(ctx, g):
        return g * ctx.w * 5, None


def test_reentrant_checkpoint_and_arguments_on_ctx_replay_in_the_backward():
    # The checkpoint recomputes its block in the backward, reading the parameters; the
    # custom function reads the argument it kept: both see the call's values.
    torch.manual_seed(0)
    block = torch.nn.Linear(4, 4)

    def f(x, w):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(block(t)), x, use_reentrant=True)
        return _ScaleKeepingArgument.apply(h, w).sum()

    jitted = torchjax.jit(f)
    grads = {}
    for dev, fn in (("cpu", f), ("tpu", jitted), ("tpu again", jitted)):
        block.to(dev.split()[0]).zero_grad()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
        x = x.to(dev.split()[0]).requires_grad_()
        fn(x, torch.full((4,), 2.0, device=x.device)).backward()
        grads[dev] = [x.grad.cpu(), block.weight.grad.cpu().clone()]
    for dev in ("tpu", "tpu again"):
        for got, want in zip(grads[dev], grads["cpu"]):
            torch.testing.assert_close(got, want)
    (entry,) = jitted._entries.values()
    assert entry.vjp.from_torch


def test_where_saved_tensor_hooks_are_refused_the_vjp_is_jaxs():
    def f(x):
        return (x.sin() * x).sum()

    jitted = torchjax.jit(f)
    x = torch.randn(4, generator=torch.Generator().manual_seed(0))
    got, want = (x.clone().to(d).requires_grad_() for d in ("tpu", "cpu"))
    with torch.autograd.graph.disable_saved_tensors_hooks("refused here"):
        out = jitted(got)
    out.backward()
    f(want).backward()
    torch.testing.assert_close(got.grad.cpu(), want.grad)
    (entry,) = jitted._entries.values()
    assert not entry.vjp.from_torch


def test_closed_over_non_leaf_gets_its_gradient_through_the_call():
    # torch's backward of the trace would run on into the eager graph before the call.
    grads = {}
    for dev in ("cpu", "tpu"):
        w = torch.arange(4.0, device=dev).requires_grad_()
        w2 = w * 2  # a non-leaf the function closes over

        def f(x, w2=w2):
            return (x * w2).sum()

        fn = f if dev == "cpu" else torchjax.jit(f)
        out = fn(torch.full((4,), 3.0, device=dev))
        assert w.grad is None
        out.backward()
        grads[dev] = w.grad.cpu()
    torch.testing.assert_close(grads["tpu"], grads["cpu"])


def test_changing_which_parameters_require_grad_traces_again():
    torch.manual_seed(0)
    a, b = (torch.nn.Parameter(torch.randn(3).to("tpu")) for _ in range(2))
    x = torch.randn(3)

    def f(x):
        return (x * a + x.pow(2) * b).sum()

    jitted = torchjax.jit(f)
    for trainable, frozen in ((a, b), (b, a), (a, b)):
        frozen.requires_grad_(False)
        trainable.requires_grad_(True)
        a.grad = b.grad = None
        jitted(x.to("tpu")).backward()
        assert frozen.grad is None
        want = x if trainable is a else x.pow(2)
        torch.testing.assert_close(trainable.grad.cpu(), want)
    assert jitted.trace_count == 2


def test_unused_input_keeps_no_gradient_and_a_graph_saving_nothing_backs_twice():
    def f(x, w):
        return x + 1

    results = {}
    for dev, fn in (("cpu", f), ("tpu", torchjax.jit(f))):
        x = torch.ones(3, device=dev, requires_grad=True)
        w = torch.ones(3, device=dev, requires_grad=True)
        loss = fn(x, w).sum()
        loss.backward()
        loss.backward()  # nothing saved: CPU allows it
        results[dev] = (x.grad.cpu(), w.grad)
    torch.testing.assert_close(results["tpu"][0], results["cpu"][0])
    assert results["cpu"][1] is None and results["tpu"][1] is None


@pytest.mark.parametrize("compiler", ["jit", "dynamo"])
def test_differentiating_a_compiled_gradient_again_raises(compiler):
    # A gradient penalty over a compiled forward: the program's gradients carry no
    # graph, so the penalty's terms would be silently missing.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    net = net.to("tpu")
    forward = _compiler(compiler)(net)
    x = torch.randn(5, 3, device="tpu", requires_grad=True)
    (g,) = torch.autograd.grad(forward(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiated again"):
        g.norm().backward()
    (g,) = torch.autograd.grad(forward(x).sum(), x, create_graph=True)
    assert g.shape == x.shape  # create_graph alone is allowed


@pytest.mark.parametrize("compiler", ["jit", "dynamo"])
def test_a_second_derivative_through_a_compiled_gradient_raises_not_none(compiler):
    # torch.autograd.grad with respect to the input itself (and allow_unused): the
    # gradient's error node led nowhere, so the second derivative came back None.
    def cube_sum(a):
        return (a**3).sum()

    x = torch.tensor([1.0, 2.0], device="tpu", requires_grad=True)
    (g,) = torch.autograd.grad(_compiler(compiler)(cube_sum)(x), x, create_graph=True)
    torch.testing.assert_close(g.detach().cpu(), torch.tensor([3.0, 12.0]))
    with pytest.raises(RuntimeError, match="differentiated again"):
        torch.autograd.grad(g.sum(), x, allow_unused=True)
    with pytest.raises(RuntimeError, match="differentiated again"):
        torch.autograd.grad(g.sum(), x)


def test_double_backward_inside_one_jitted_step_matches_cpu():
    def step(net, x):
        x = x.detach().requires_grad_()
        out = net(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = out.mean() + ((g.norm(dim=1) - 1) ** 2).mean()
        loss.backward()
        return loss.detach()

    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(5, 3)
    step(cpu, x)
    torchjax.jit(step)(tpu, x.to("tpu"))
    for p, q in zip(tpu.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-5)


class _DoubleInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, g):
        return g * 2


_WRITES = {
    "mul_": lambda y: y.mul_(2),
    "sin_ of a view": lambda y: y[1:].sin_(),
    "mark_dirty function": lambda y: _DoubleInPlace.apply(y),
}


@pytest.mark.parametrize("compiler", ["jit", "dynamo"])
@pytest.mark.parametrize("name", sorted(_WRITES))
def test_argument_written_in_place_takes_the_writes_history(name, compiler):
    # The gradient reaches the argument's old history through the write, as on CPU,
    # also when the gradient comes from using the argument after the call.
    write = _WRITES[name]

    def f(y):
        write(y)

    grads = {}
    for dev, fn in (("cpu", f), ("tpu", _compiler(compiler)(f))):
        x = torch.linspace(-1, 1, 4, device=dev, requires_grad=True)
        y = x * 1
        fn(y)
        (y * torch.arange(4.0, device=dev)).sum().backward()
        grads[dev] = (y.detach().cpu(), x.grad.cpu())
    for got, want in zip(grads["tpu"], grads["cpu"]):
        torch.testing.assert_close(got, want)


def _returns_a_retained_tensor(x):
    y = x * 2
    y.retain_grad()
    return y, y.sum() * 3


def test_retain_grad_on_a_returned_tensor_warns_under_jit_and_fills_under_compile():
    # Note [Outputs that retain their gradient]: outside the program, y and the loss
    # are sibling outputs, so torchjax.jit cannot fill y.grad as eager does; it says so.
    x = torch.ones(2, requires_grad=True)
    y, loss = _returns_a_retained_tensor(x)
    loss.backward()
    assert torch.equal(y.grad, torch.full((2,), 3.0))

    with pytest.warns(UserWarning, match=r"retain_grad\(\) inside it"):
        y, loss = torchjax.jit(_returns_a_retained_tensor)(x.detach().to("tpu").requires_grad_())

    xt = x.detach().to("tpu").requires_grad_()
    y, loss = torch.compile(_returns_a_retained_tensor, backend="tpu")(xt)
    loss.backward()
    assert y.retains_grad
    assert torch.equal(y.grad.cpu(), torch.full((2,), 3.0))
    assert torch.equal(xt.grad.cpu(), torch.full((2,), 6.0))


# Note [Outputs the backward saved] (torchjax/compile/_autograd.py)
_COMPILERS = {"jit": torchjax.jit, "compile": lambda f: torch.compile(f, backend="tpu")}


@pytest.mark.parametrize("compiler", sorted(_COMPILERS))
def test_writing_an_output_the_backward_saved_raises_as_eager(compiler):
    ran = 0
    for write in (lambda y: y.add_(1), lambda y: y[:1].mul_(2)):  # the output, a view of it
        for device in ("cpu", "tpu"):
            x = torch.tensor([1.0, 2.0], device=device, requires_grad=True)
            f = (lambda t: t.exp()) if device == "cpu" else _COMPILERS[compiler](lambda t: t.exp())
            y = f(x)
            write(y)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.sum().backward()
            ran += 1
    assert ran == 4


@pytest.mark.parametrize("compiler", sorted(_COMPILERS))
def test_writing_an_output_the_backward_did_not_save_keeps_cpus_gradient(compiler):
    grads = []
    for device in ("cpu", "tpu"):
        x = torch.tensor([1.0, 2.0], device=device, requires_grad=True)
        f = (lambda t: t.sin()) if device == "cpu" else _COMPILERS[compiler](lambda t: t.sin())
        y = f(x)
        y.add_(1)  # sin saves its input, not its output
        y.sum().backward()
        grads.append(x.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])
    # Without a write, an output the backward saved differentiates twice with retain_graph.
    x = torch.tensor([1.0, 2.0], device="tpu", requires_grad=True)
    y = _COMPILERS[compiler](lambda t: t.exp())(x)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    torch.testing.assert_close(x.grad.cpu(), 2 * torch.tensor([1.0, 2.0]).exp())


@pytest.mark.parametrize("compiler", sorted(_COMPILERS))
def test_writing_a_parameter_the_backward_saved_raises_as_eager(compiler):
    # Note [Outputs the backward saved]: a Linear's backward saves its weight (through
    # ``t()``), not its bias.
    results = []
    for device in ("cpu", "tpu"):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).to(device)
        f = model if device == "cpu" else _COMPILERS[compiler](model)
        x = torch.ones(2, 4, device=device, requires_grad=True)
        loss = f(x).sum()
        with torch.no_grad():
            model.weight.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        loss = f(x).sum()
        with torch.no_grad():
            model.bias.add_(1)
        loss.backward()
        results.append([x.grad.cpu(), model.weight.grad.cpu()])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
