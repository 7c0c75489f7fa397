"""torchjax.jit: compiled results equal eager (CPU torch and tpu eager), state written back,
one trace per signature, randomness threaded through calls."""

import copy
import functools
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchjax

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )  # fmt: skip


def cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 4, 3, stride=2), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
        torch.nn.Linear(4 * 3 * 3, 5),
    )  # fmt: skip


def test_mlp_forward_matches_cpu_and_traces_once():
    cpu = mlp()
    tpu = copy.deepcopy(cpu).to("tpu")
    f = torchjax.jit(tpu)
    for seed in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            torch.testing.assert_close(f(x.to("tpu")).cpu(), cpu(x), rtol=1e-5, atol=1e-6)
    assert f.trace_count == 1 and f.cache_hits == 2
    # Parameters are inputs, not constants: changing them changes the result, no retrace.
    with torch.no_grad():
        tpu[0].weight.mul_(2)
        cpu[0].weight.mul_(2)
        torch.testing.assert_close(f(x.to("tpu")).cpu(), cpu(x), rtol=1e-5, atol=1e-6)
    assert f.trace_count == 1


def test_new_shape_retraces_and_says_why():
    f = torchjax.jit(mlp().to("tpu"), warn_after=1)
    with torch.no_grad():
        f(torch.randn(2, 16, device="tpu"))
        with pytest.warns(
            torchjax.RetraceWarning, match=r"#0 changed from float32\[2, 16\] to float32\[3, 16\]"
        ):
            f(torch.randn(3, 16, device="tpu"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            f(torch.randn(2, 16, device="tpu"))  # cached: no trace, no warning
    assert f.trace_count == 2
    assert "changed" in f.last_retrace_reason


def test_static_args_and_python_scalars_are_part_of_the_key():
    def fn(x, scale, *, mode="sum"):
        y = x * scale
        return y.sum() if mode == "sum" else y.mean()

    f = torchjax.jit(fn)
    x = torch.arange(6.0, device="tpu")
    assert f(x, 2.0).item() == 30.0
    assert f(x, 3.0).item() == 45.0
    assert f(x, 3.0, mode="mean").item() == 7.5
    assert f(x, 3.0, mode="mean").item() == 7.5
    assert f.trace_count == 3 and f.cache_hits == 1


def test_scalars_equal_in_python_but_not_in_a_trace_get_their_own_programs():
    # 1 == 1.0 == True and 0.0 == -0.0 in Python; the traced results differ in dtype
    # or sign, so each needs its own executable. NaN must still hit its own entry.
    f = torchjax.jit(lambda x, s: x * s)
    ints = torch.arange(3, device="tpu")
    for s in (1, 1.0, True):
        out = f(ints, s)
        want = torch.arange(3) * s
        assert out.dtype == want.dtype
        torch.testing.assert_close(out.cpu(), want)
    ones = torch.ones(2, device="tpu")
    for s in (0.0, -0.0):
        assert torch.equal(f(ones, s).cpu().signbit(), (torch.ones(2) * s).signbit())
    f(ones, float("nan"))
    before = f.trace_count
    assert f(ones, float("nan")).isnan().all()
    assert f.trace_count == before
    # The same holds for a number the function reads from its closure.
    scale = 1
    g = torchjax.jit(lambda x: x * scale)
    assert g(ints).dtype == torch.int64
    scale = 1.0
    assert g(ints).dtype == torch.float32 and g.trace_count == 2


def test_outputs_keep_their_pytree_and_dtypes():
    f = torchjax.jit(lambda x: {"a": x.long() * 2**40, "b": (x.double(), 3)})
    out = f(torch.arange(3, device="tpu"))
    assert out["a"].dtype == torch.int64 and out["a"][2].item() == 2 * 2**40
    assert out["b"][0].dtype == torch.float64 and out["b"][1] == 3


def test_cnn_batchnorm_running_stats_written_back():
    cpu = cnn().train()
    tpu = copy.deepcopy(cpu).to("tpu")
    f = torchjax.jit(tpu)
    for seed in range(3):
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            torch.testing.assert_close(f(x.to("tpu")).cpu(), cpu(x), rtol=1e-4, atol=1e-5)
    for name, buf in cpu.named_buffers():
        torch.testing.assert_close(dict(tpu.named_buffers())[name].cpu(), buf, rtol=1e-5, atol=1e-6)
    assert tpu[1].num_batches_tracked.item() == 3
    assert f.trace_count == 1
    tpu.eval()
    cpu.eval()
    with torch.no_grad():
        torch.testing.assert_close(f(x.to("tpu")).cpu(), cpu(x), rtol=1e-4, atol=1e-5)
    assert f.trace_count == 2  # eval() changes the program (training flags are in the key)


def test_grad_flows_through_a_jitted_module():
    cpu = mlp()
    tpu = copy.deepcopy(cpu).to("tpu")
    f = torchjax.jit(tpu)
    x = torch.randn(8, 16)
    xt = x.to("tpu").requires_grad_()
    x.requires_grad_()
    for _ in range(2):
        f(xt).square().sum().backward()
        cpu(x).square().sum().backward()
    for p, q in zip(tpu.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xt.grad.cpu(), x.grad, rtol=1e-5, atol=1e-5)
    assert f.trace_count == 1


def test_grad_flows_through_a_jitted_function():
    # A plain function's outputs carry a grad_fn as a module's do: to its tensor
    # arguments and to tensors it closes over, combined with eager terms outside it.
    def run(dev, wrap):
        w = torch.tensor([1.0, 2.0, 3.0], device=dev, requires_grad=True)
        v = torch.tensor([0.5, -1.0, 2.0], device=dev, requires_grad=True)
        x = torch.arange(3.0, device=dev)

        def f(x, w):
            return (x * w * v).sum()

        g = wrap(f)
        for _ in range(3):
            out = g(x, w)
            assert out.requires_grad and out.grad_fn is not None
            (out + w.square().sum() + v.sum()).backward()
        return w.grad.cpu(), v.grad.cpu(), g

    (wc, vc, _), (wt, vt, g) = run("cpu", lambda f: f), run("tpu", torchjax.jit)
    torch.testing.assert_close(wt, wc)
    torch.testing.assert_close(vt, vc)
    assert g.trace_count == 2  # the first backward made v.grad, state the function can see
    with torch.no_grad():
        assert not g(torch.ones(3, device="tpu"), torch.ones(3, device="tpu")).requires_grad


def _train(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_adamw_train_step_is_one_program_matching_eager():
    cpu = mlp()
    eager, compiled = copy.deepcopy(cpu).to("tpu"), copy.deepcopy(cpu).to("tpu")
    opt_cpu = torch.optim.AdamW(cpu.parameters(), lr=1e-2, weight_decay=0.1)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1)
    opt_jit = torch.optim.AdamW(compiled.parameters(), lr=1e-2, weight_decay=0.1)

    @torchjax.jit
    def step(x, y):
        return _train(compiled, opt_jit, x, y)

    g = torch.Generator().manual_seed(1)
    for i in range(10):
        x, y = torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)
        l_cpu = _train(cpu, opt_cpu, x, y)
        l_eager = _train(eager, opt_eager, x.to("tpu"), y.to("tpu"))
        l_jit = step(x.to("tpu"), y.to("tpu"))
        assert abs(l_jit.item() - l_eager.item()) < 1e-5, i
        assert abs(l_jit.item() - l_cpu.item()) < 1e-5, i
    # The first call creates AdamW's state (torch creates it lazily): it traces again with
    # that state filled (Note [Optimizer state made in a first call]); the other nine
    # calls reuse that program.
    assert step.trace_count == 2 and step.cache_hits == 9
    for p, q in zip(compiled.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-5)
    st = opt_jit.state[next(iter(compiled.parameters()))]
    assert st["step"].device.type == "tpu" and st["step"].item() == 10


def test_train_step_module_and_optimizer_as_arguments():
    model = mlp().to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = torchjax.jit(_train)
    x, y = torch.randn(16, 16, device="tpu"), torch.randint(0, 4, (16,), device="tpu")
    losses = [step(model, opt, x, y).item() for _ in range(5)]
    assert losses[-1] < losses[0]
    assert step.trace_count == 2


def test_random_ops_differ_per_call_and_replay_after_manual_seed():
    f = torchjax.jit(lambda x: x + torch.rand(4, device="tpu"))
    drop = torchjax.jit(torch.nn.Dropout(0.5).to("tpu"))
    x = torch.zeros(4, device="tpu")
    torch.manual_seed(7)
    a, b = f(x).cpu(), f(x).cpu()
    d1, d2 = drop(torch.ones(64, device="tpu")).cpu(), drop(torch.ones(64, device="tpu")).cpu()
    assert not torch.equal(a, b) and not torch.equal(d1, d2)
    assert ((a >= 0) & (a < 1)).all()
    assert set(d1.unique().tolist()) <= {0.0, 2.0}
    torch.manual_seed(7)
    assert torch.equal(f(x).cpu(), a) and torch.equal(f(x).cpu(), b)
    assert f.trace_count == 1


def test_a_trace_draws_nothing_from_the_rng():
    # A program with no random op takes no key: a call that traces it and a call that
    # hits its cache leave the RNG alike, so seeded draws after it are the same.
    f = torchjax.jit(lambda x: x * 2)
    g = torchjax.jit(lambda x: x + torch.rand(3, device="tpu"))

    def draws(n):
        torch.manual_seed(0)
        f(torch.ones(n, device="tpu"))
        return g(torch.zeros(3, device="tpu")).cpu(), torch.rand(3, device="tpu").cpu()

    first = draws(3)  # f and g trace
    for n in (3, 4):  # a cache hit of both; f traces a new shape
        again = draws(n)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    assert f.trace_count == 2 and g.trace_count == 1


def test_tiny_llama_forward_matches_eager():
    import transformers

    from examples import tiny_llama_generate as tl

    torch.manual_seed(0)
    cpu = transformers.AutoModelForCausalLM.from_config(tl.tiny_llama_config()).eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    f = torchjax.jit(tpu)
    batch = tl.prompts()
    with torch.no_grad():
        want = cpu(**batch).logits
        got = f(**{k: v.to("tpu") for k, v in batch.items()})
        again = f(**{k: v.to("tpu") for k, v in batch.items()})
    torch.testing.assert_close(got.logits.cpu(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again.logits.cpu(), want, rtol=1e-4, atol=1e-4)
    assert f.trace_count == 1


def test_cpu_arguments_are_moved_and_non_hashable_static_is_an_error():
    f = torchjax.jit(lambda x, opts: x * 2, static_argnames=("opts",))
    assert f(torch.ones(2), opts=(1, 2)).device.type == "tpu"
    with pytest.raises(TypeError, match="static argument 'opts' must be hashable"):
        f(torch.ones(2), opts=[1, 2])


def test_export_gives_self_contained_stablehlo():
    import jax

    cpu = cnn().eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(2, 3, 8, 8)
    exported = torchjax.export(tpu, x.to("tpu"))
    restored = jax.export.deserialize(exported.serialize())
    (out,) = restored.call(x.numpy())
    with torch.no_grad():
        torch.testing.assert_close(
            torch.from_numpy(jax.device_get(out).copy()), cpu(x), rtol=1e-4, atol=1e-5
        )
    assert "stablehlo" in exported.mlir_module()


def test_hashable_static_objects_are_keyed_by_value():
    import dataclasses
    import enum

    class Mode(enum.Enum):
        DOUBLE = 2
        TRIPLE = 3

    @dataclasses.dataclass(frozen=True)
    class Window:
        start: int
        stop: int

    f = torchjax.jit(lambda x, mode, w: x[w.start : w.stop] * mode.value)
    x = torch.arange(6.0, device="tpu")
    assert f(x, Mode.DOUBLE, Window(1, 3)).tolist() == [2.0, 4.0]
    assert f(x, Mode.DOUBLE, Window(1, 3)).tolist() == [2.0, 4.0]  # an equal new object
    assert f(x, Mode.TRIPLE, Window(1, 3)).tolist() == [3.0, 6.0]
    assert f.trace_count == 2


def test_keyed_static_values_are_one_leaf_keyed_once_and_say_what_changed():
    # Note [Static values keyed once]: equal keys share a program, the typed key tells
    # 1 from 1.0 and True, and a retrace names the item that changed.
    from torchjax.compile import _call
    from torchjax.compile._keys import Keyed

    f = torchjax.jit(lambda x, *, guard: x * guard.value[1][0], warn_after=1)
    x = torch.arange(3, device="tpu")
    big = tuple(range(500))
    assert len(_call.flatten_args((x,), {"guard": Keyed((big, (2,)))})[0]) == 2
    assert f(x, guard=Keyed((big, (2,)))).tolist() == [0, 2, 4]
    assert f(x, guard=Keyed((big, (2,)))).tolist() == [0, 2, 4]  # an equal new object
    assert f.trace_count == 1
    with pytest.warns(torchjax.RetraceWarning, match=r"changed from 2 to 2.0"):
        out = f(x, guard=Keyed((big, (2.0,))))
    assert out.dtype == torch.float32 and f.trace_count == 2
    with pytest.warns(torchjax.RetraceWarning, match=r"changed from 2.0 to True"):
        assert f(x, guard=Keyed((big, (True,)))).dtype == torch.int64
    assert f.trace_count == 3
    assert Keyed((1, [2])) == Keyed((1, [2])) and Keyed(1) != Keyed(True)


class _MyTensor(torch.Tensor):
    pass


class _Logged(torch.Tensor):
    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def _classes(out):
    return [type(r).__name__ for r in out]


@pytest.mark.parametrize("cls", [_MyTensor, _Logged])
def test_results_keep_a_user_subclass_as_in_eager(cls):
    # Eager (and torch.compile on CPU) give x's class to results computed from x.
    def f(x, y):
        return x * 2 + y, (x + 1).sum(), y * 3

    x, y = torch.arange(4.0).as_subclass(cls), torch.ones(4)
    cpu = f(x, y)
    xt, yt = x.to("tpu"), y.to("tpu")
    eager = f(xt, yt)
    jitted = torchjax.jit(f)
    for _ in range(2):  # a trace, then a cache hit
        out = jitted(xt, yt)
        assert _classes(out) == _classes(eager) and _classes(out)[:2] == [cls.__name__] * 2
        assert [isinstance(r, cls) for r in out] == [isinstance(r, cls) for r in cpu]
        for r, c in zip(out, cpu):
            torch.testing.assert_close(
                r.cpu().as_subclass(torch.Tensor), c.as_subclass(torch.Tensor)
            )
    assert jitted.trace_count == 1 and jitted.cache_hits == 1


def test_a_plain_and_a_subclass_argument_trace_apart():
    f = torchjax.jit(lambda x: x + 1)
    plain = torch.ones(3, device="tpu")
    mine = torch.ones(3).as_subclass(_MyTensor).to("tpu")
    assert not isinstance(f(plain), _MyTensor)
    assert isinstance(f(mine), _MyTensor)
    assert f.trace_count == 2 and "classes" in f.last_retrace_reason
    assert not isinstance(f(plain), _MyTensor)


def test_user_torch_function_runs_while_tracing_and_a_jitted_module_keeps_the_class():
    _Logged.calls.clear()
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4).as_subclass(_Logged)
    ref = lin(x)
    ref.sum().backward()
    cpu_grad = lin.weight.grad.clone()
    lin.weight.grad = None
    lin = lin.to("tpu")
    _Logged.calls.clear()
    out = torchjax.jit(lin)(x.to("tpu"))
    assert type(out).__name__ == "_Logged" and torch.nn.functional.linear in _Logged.calls
    out.sum().backward()
    torch.testing.assert_close(
        out.detach().cpu().as_subclass(torch.Tensor), ref.detach().as_subclass(torch.Tensor)
    )
    torch.testing.assert_close(lin.weight.grad.cpu(), cpu_grad)


_LAID_OUT = {
    "transposed": lambda x: x.t() * 2,
    "permuted": lambda x: x.reshape(2, 3, 2).permute(2, 0, 1).exp(),
    "sliced transposed": lambda x: x[1:].t().neg(),
    "contiguous": lambda x: x.sin(),
    "tuple": lambda x: (x.t() + 1, x * 3, x.t().contiguous()),
}


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
@pytest.mark.parametrize("compiler", ["jit", "dynamo"])
@pytest.mark.parametrize("name", sorted(_LAID_OUT))
def test_outputs_have_the_strides_eager_gives(name, compiler, grad):
    # (y.t() * 2).t().view(-1) works on CPU, eager or compiled: the output keeps the
    # strides the op gives it.
    fn = _LAID_OUT[name]
    x = torch.arange(12.0).reshape(4, 3)
    want = fn(x.clone().requires_grad_(grad))
    jitted = torchjax.jit(fn) if compiler == "jit" else torch.compile(fn, backend="tpu")
    got = jitted(x.to("tpu").requires_grad_(grad))
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    assert len(got) == len(want) >= 1
    for g, w in zip(got, want):
        assert g.stride() == w.stride()
        assert g.requires_grad == w.requires_grad
        torch.testing.assert_close(g.detach().cpu(), w.detach())
        flat = g.t() if g.dim() == 2 else g.permute(1, 2, 0) if g.dim() == 3 else g
        if w.dim() == 2 and w.t().is_contiguous():
            torch.testing.assert_close(flat.reshape(-1).detach().cpu(), w.t().reshape(-1).detach())
            flat.view(-1)  # a view, as on CPU


def test_channels_last_conv_output_keeps_its_memory_format_and_gradients():
    torch.manual_seed(0)
    cpu = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    want = cpu(x)
    got = torchjax.jit(tpu)(x.to("tpu"))
    assert got.stride() == want.stride()
    assert got.is_contiguous(memory_format=torch.channels_last)
    got.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(tpu.weight.grad.cpu(), cpu.weight.grad, rtol=1e-4, atol=1e-4)


def _detached_target(x, w):
    y = x @ w
    return ((y - (y.detach() + 1)) ** 2).mean()


def _no_grad_scale(x, w):
    with torch.no_grad():
        s = w * 2
    return (w * s * x[0, 0]).sum()


def _constant_input(x, w):
    return (x.exp() * w.sum()).sum() + (x * x).sum()


class _DetachModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        y = self.lin(x)
        return (y * y.detach().sigmoid()).sum()


@pytest.mark.parametrize("fn", [_detached_target, _no_grad_scale, _constant_input])
@pytest.mark.parametrize("compiler", ["jit", "dynamo"])
def test_backward_outside_stops_where_torch_autograd_stops(fn, compiler):
    # jax differentiates every path; torch not through detach(), no_grad blocks or
    # tensors that do not require grad: the compiled VJP must give CPU's gradient.
    wrap = torchjax.jit if compiler == "jit" else (lambda f: torch.compile(f, backend="tpu"))
    grads = {}
    for dev, f in (("cpu", fn), ("tpu", wrap(fn))):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 4, generator=g).to(dev)
        w = torch.randn(4, 3, generator=g).to(dev).requires_grad_()
        f(x, w).backward()
        grads[dev] = w.grad.cpu()
    assert grads["cpu"].abs().sum() > 0
    torch.testing.assert_close(grads["tpu"], grads["cpu"], rtol=1e-5, atol=1e-5)


def _set_to_argument(x):
    y = torch.empty(0, device=x.device)
    y.set_(x)
    y.add_(1)
    return x.sum()


def _set_to_local(x):
    y = x.clone()
    torch.empty(0, device=x.device).set_(y).mul_(2)
    return y


def _set_to_a_view(x):
    torch.empty(0, device=x.device).set_(x[1]).add_(5)
    return x * 1


@pytest.mark.parametrize("fn", [_set_to_argument, _set_to_local, _set_to_a_view])
@pytest.mark.parametrize("compiler", ["jit", "dynamo"])
def test_set_to_a_tensor_aliases_it_in_a_trace(fn, compiler):
    # set_'s source carries no alias mark in its schema: the trace's gradient stop
    # replaced it by a stand-in, so the tensor set to it wrote to a copy.
    wrap = torchjax.jit if compiler == "jit" else (lambda f: torch.compile(f, backend="tpu"))
    x = torch.arange(12.0).reshape(3, 4)
    got_x = x.to("tpu")
    want = fn(x)  # writes x, as the call writes got_x
    got = wrap(fn)(got_x)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got_x.cpu(), x)


def test_jitted_module_with_detach_gives_cpu_gradients():
    cpu = _DetachModule()
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    cpu(x).backward()
    torchjax.jit(tpu)(x.to("tpu")).backward()
    for p, q in zip(tpu.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-5)


def test_outputs_that_need_no_grad_come_back_without_one():
    def f(x, w):
        return x @ w, x.sum(), (x @ w).detach(), torch.ones(2, device=x.device)

    x = torch.randn(3, 4)
    w = torch.randn(4, 2).requires_grad_()
    want = f(x, w)
    got = torchjax.jit(f)(x.to("tpu"), w.to("tpu").detach().requires_grad_())
    assert (
        [t.requires_grad for t in got]
        == [t.requires_grad for t in want]
        == [
            True,
            False,
            False,
            False,
        ]
    )
    assert [t.grad_fn is None for t in got] == [t.grad_fn is None for t in want]


def test_in_place_write_to_a_non_leaf_argument_as_on_cpu():
    # CPU lets a function write a non-leaf argument in place (a leaf requiring grad
    # refuses): the write reaches the caller's tensor and gradients flow through it.
    def f(x, w):
        x.mul_(2)
        return (x @ w).sum()

    results = {}
    for dev, fn in (("cpu", f), ("tpu", torchjax.jit(f))):
        g = torch.Generator().manual_seed(0)
        x0 = torch.randn(5, 4, generator=g).to(dev).requires_grad_()
        w = torch.randn(4, 3, generator=g).to(dev).requires_grad_()
        x = x0 * 1
        fn(x, w).backward()
        results[dev] = [x.detach().cpu(), x0.grad.cpu(), w.grad.cpu()]
        leaf = torch.randn(5, 4).to(dev).requires_grad_()
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            fn(leaf, w)
    for got, want in zip(results["tpu"], results["cpu"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


_LOSSES = {
    "mse_loss": lambda y, t: F.mse_loss(y, t),
    "cross_entropy": lambda y, t: F.cross_entropy(y, t.argmax(-1)),
    "smoothed cross_entropy": lambda y, t: F.cross_entropy(y, t.argmax(-1), label_smoothing=0.1),
    "bce_with_logits": lambda y, t: F.binary_cross_entropy_with_logits(y, t.sigmoid()),
    "celu and trace": lambda y, t: F.celu(y).sum() + torch.trace(y[:, :3]),
}


@pytest.mark.parametrize("compiler", ["jit", "dynamo"])
@pytest.mark.parametrize("name", sorted(_LOSSES))
def test_losses_made_of_decomposed_ops_give_cpu_gradients(name, compiler):
    # These ops run as other ops below autograd, whose intermediates never require grad:
    # the compiled VJP must stop only where the traced code's own tensors do.
    loss = _LOSSES[name]
    wrap = torchjax.jit if compiler == "jit" else (lambda f: torch.compile(f, backend="tpu"))
    grads = {}
    for dev, f in (("cpu", loss), ("tpu", wrap(loss))):
        g = torch.Generator().manual_seed(0)
        y = torch.randn(4, 5, generator=g).to(dev).requires_grad_()
        t = torch.randn(4, 5, generator=g).to(dev)
        f(y, t).backward()
        grads[dev] = y.grad.cpu()
    assert grads["cpu"].abs().sum() > 0
    torch.testing.assert_close(grads["tpu"], grads["cpu"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiler", ["jit", "dynamo"])
def test_embedding_padding_row_gets_no_gradient_when_compiled(compiler):
    grads = {}
    for dev in ("cpu", "tpu"):
        torch.manual_seed(0)
        m = torch.nn.Embedding(10, 4, padding_idx=2).to(dev)
        f = (
            m
            if dev == "cpu"
            else torchjax.jit(m)
            if compiler == "jit"
            else torch.compile(m, backend="tpu")
        )
        out = f(torch.tensor([[1, 2, 3], [2, 2, 9]]).to(dev))
        (out * torch.arange(4.0, device=dev)).sum().backward()
        grads[dev] = m.weight.grad.cpu()
    assert grads["cpu"][2].abs().sum() == 0 and grads["cpu"].abs().sum() > 0
    torch.testing.assert_close(grads["tpu"], grads["cpu"])


def test_cpu_arguments_written_in_place_keep_the_write():
    # Note [CPU tensors a compiled call writes]: the program's input is a tpu copy.
    def bump(count, x):
        count.add_(1)
        return x * count.to(x.device)

    jitted = torchjax.jit(bump)
    count = torch.zeros(())
    outs = [jitted(count, torch.ones(2, device="tpu")).cpu().tolist() for _ in range(3)]
    assert outs == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert count.device.type == "cpu" and count.item() == 3.0
    assert jitted.trace_count == 1


def test_cpu_tensors_in_the_state_are_guarded_and_writes_repeat():
    # Note [CPU tensors in the state]: a CPU tensor the function reads is baked into the
    # program, so a value changed in place traces again; one the function writes in place
    # traces on every call (with a warning), as that alone repeats the write.
    scale = torch.tensor(2.0)
    scaled = torchjax.jit(lambda x: x * scale.to(x.device))
    x = torch.ones(2, device="tpu")
    assert scaled(x).cpu().tolist() == [2.0, 2.0]
    scale.fill_(5.0)
    assert scaled(x).cpu().tolist() == [5.0, 5.0]
    assert scaled(x).cpu().tolist() == [5.0, 5.0]
    assert scaled.trace_count == 2

    class Counted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls += 1
            return self.lin(x)

    model = Counted()
    model.lin.to("tpu")
    jitted = torchjax.jit(model)
    with pytest.warns(UserWarning, match="writes a CPU tensor in place"):
        jitted(torch.ones(1, 2, device="tpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per function
        for _ in range(2):
            jitted(torch.ones(1, 2, device="tpu"))
    assert model.calls.device.type == "cpu" and model.calls.item() == 3.0
    assert jitted.trace_count == 3


def test_backward_inside_fills_and_accumulates_argument_grads_as_eager():
    # Note [Gradients of arguments]: the traced stand-in got the .grad and the caller's
    # argument kept None, silently.
    def run(device, compile_):
        w = torch.ones(3, device=device, requires_grad=True)
        x = torch.arange(3.0, device=device, requires_grad=True)

        def step(x):
            loss = (w * x * x).sum()
            loss.backward()
            return loss

        fn = torchjax.jit(step) if compile_ else step
        grads = []
        for _ in range(3):  # created, then accumulated
            fn(x)
            grads.append((w.grad.cpu().clone(), x.grad.cpu().clone()))
        return grads

    for (tw, tx), (cw, cx) in zip(run("tpu", True), run("cpu", False)):
        assert torch.equal(tw, cw) and torch.equal(tx, cx)


def test_a_leaf_argument_updated_under_no_grad_inside_stays_a_leaf():
    def sgd(y):
        (y * y).sum().backward()
        with torch.no_grad():
            y -= 0.1 * y.grad
        return (y * y).sum()

    y = torch.arange(3.0, device="tpu", requires_grad=True)
    ye = torch.arange(3.0, requires_grad=True)
    step = torchjax.jit(sgd)
    for _ in range(2):
        got, want = step(y), sgd(ye)
        assert y.is_leaf and y.grad_fn is None
        torch.testing.assert_close(got.cpu(), want.detach())
        torch.testing.assert_close(y.detach().cpu(), ye.detach())
        torch.testing.assert_close(y.grad.cpu(), ye.grad)


class _Slots:
    __slots__ = ("count",)  # no __dict__: the state walk does not see inside


def test_write_to_a_tensor_outside_the_state_is_refused_and_the_tensor_kept():
    # Note [Writes that escape a trace]: a tensor the state walk cannot see is not
    # state; its in-place write stored a tracer in it, and every later read failed.
    hidden = _Slots()
    hidden.count = torch.full((), 5.0, device="tpu")
    m = torch.nn.Linear(3, 3).to("tpu")

    def forward(x):
        hidden.count += 1
        return m(x)

    with pytest.raises(RuntimeError, match="register_buffer") as refused:
        torchjax.jit(forward)(torch.ones(3, device="tpu"))
    assert "shape (), float32" in str(refused.value)
    assert hidden.count.item() == 5.0
    hidden.count += 1  # still an ordinary tensor
    assert hidden.count.item() == 6.0
    # A lazily filled tensor (torch.zeros) comes back unfilled, and reads as zeros.
    hidden.count = torch.zeros(2, device="tpu")
    with pytest.raises(RuntimeError, match="register_buffer"):
        torchjax.jit(lambda x: hidden.count.add_(x) * 1)(torch.ones(2, device="tpu"))
    assert hidden.count.cpu().tolist() == [0.0, 0.0]
    # Registered, the same write is state: written back after the call.
    m.register_buffer("steps", torch.zeros((), device="tpu"))
    step = torchjax.jit(lambda x: m.steps.add_(1) * x)
    step(torch.ones((), device="tpu"))
    step(torch.ones((), device="tpu"))
    assert m.steps.item() == 2.0 and step.trace_count == 1


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.scale = torch.tensor(2.0)  # a plain attribute, not a buffer
        self.table = [torch.ones(2)]  # a list of tensors, too

    def forward(self, x):
        return self.lin(x) * self.scale + self.table[0]


def test_plain_tensor_attributes_of_modules_are_state_as_in_eager():
    # Note [Tensors kept as plain module attributes] (torchjax/compile/_state.py): they
    # were constants of the program, and a change to them after the trace was not seen.
    torch.manual_seed(0)
    m = _Scaled().to("tpu")
    m.scale, m.table = m.scale.to("tpu"), [m.table[0].to("tpu")]
    x = torch.ones(1, 2, device="tpu")
    for jm in (torchjax.jit(m), torchjax.jit(lambda x: m(x))):
        checks = 0
        m.scale.fill_(2.0)
        torch.testing.assert_close(jm(x).cpu(), m(x).cpu())
        m.scale.fill_(100.0)  # in place: a new value of the same input
        m.table[0].mul_(3)
        torch.testing.assert_close(jm(x).cpu(), m(x).cpu())
        assert jm.trace_count == 1
        checks += 1
        m.scale = torch.tensor(7.0, device="tpu")  # reassigned: traced again
        torch.testing.assert_close(jm(x).cpu(), m(x).cpu())
        assert jm.trace_count == 2
        checks += 1
        assert checks == 2
        m.table[0].fill_(1.0)


def test_a_modules_own_registries_are_not_remembered_as_plain_attributes():
    # Parameters and buffers are walked already: remembering ``_parameters`` and
    # ``_buffers`` too would walk every module's dicts once more on every call.
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).to("tpu").eval()
    run = torchjax.jit(m)
    run(torch.ones(3, 2, device="tpu"))
    assert run.trace_count == 1 and run.attributes == {}
    m.scale = torch.ones((), device="tpu")  # a plain attribute of the Sequential
    run = torchjax.jit(m)
    run(torch.ones(3, 2, device="tpu"))
    assert [name for _, name in run.attributes.values()] == ["scale"]


def test_a_plain_attribute_written_inside_is_written_back_as_in_eager():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            self.count += 1
            return self.lin(x)

    m = Counter().to("tpu")
    m.count = torch.full((), 5.0, device="tpu")
    run = torchjax.jit(m)
    run(torch.ones(3, device="tpu"))
    run(torch.ones(3, device="tpu"))
    assert m.count.item() == 7.0 and run.trace_count == 1
    m.count += 1  # still an ordinary tensor
    assert m.count.item() == 8.0


@pytest.mark.parametrize("op", ["t_", "unsqueeze_", "squeeze_", "resize_", "transpose_"])
def test_in_place_metadata_change_of_an_argument_is_refused(op):
    # The caller's tensor kept its shape while the function's result was another tensor
    # (Note [Arguments restrided in place] in torchjax/compile/_refusals.py).
    calls = {
        "t_": lambda x: x.t_(),
        "unsqueeze_": lambda x: x.unsqueeze_(0),
        "squeeze_": lambda x: x[:1].squeeze_(0) * 1 + x.squeeze_(),
        "resize_": lambda x: x.resize_(3),
        "transpose_": lambda x: x.transpose_(0, 1),
    }
    x = torch.arange(6.0, device="tpu").view(2, 3)
    if op == "squeeze_":
        x = x.view(1, 2, 3)
    shape = tuple(x.shape)
    with pytest.raises(RuntimeError, match="sizes or strides of tensor argument 0"):
        torchjax.jit(calls[op])(x)
    assert tuple(x.shape) == shape
    # Views made inside the function and changed in place are fine.
    out = torchjax.jit(lambda x: x[0].unsqueeze_(0) * 2)(x)
    assert tuple(out.shape) == (1,) + shape[1:]


def test_escape_watches_nest_each_with_its_own_epoch():
    # A watch inside another gave the outer one the inner's epoch: a storage made in the
    # outer trace before the inner one began counted as made before the outer trace.
    import jax
    import jax.numpy as jnp
    import numpy as np

    from torchjax.tensor._storage import Storage, escapes_watched

    def traced(x):
        with escapes_watched() as outer:
            made_in_outer = Storage(np.zeros(2, np.float32))  # a concrete array
            with escapes_watched() as inner:
                pass
            made_in_outer.replace(x)  # a traced write to the outer trace's own storage
        assert outer == [] and inner == []
        return x

    jax.make_jaxpr(traced)(jnp.ones(2, jnp.float32))


def test_leaves_behind_a_partial_or_a_keyword_default_are_state():
    # functools.partial keeps its function and arguments in slots, not its __dict__:
    # the walk missed them and the leaf's gradient was lost. Keyword-only defaults too.
    def train(device, wrap):
        w = torch.arange(3.0).to(device).requires_grad_()
        scaled = functools.partial(lambda h, w: (h * w).sin(), w=w)

        def by_default(h, *, k=w):
            return h * k

        def step(x):
            (scaled(x) + by_default(x)).sum().backward()

        wrap(step)(torch.ones(3).to(device))
        return w.grad

    want = train("cpu", lambda f: f)
    got = train("tpu", torchjax.jit)
    torch.testing.assert_close(got.cpu(), want)


def test_backward_into_a_leaf_the_walk_cannot_see_is_refused():
    # A leaf reached through a container the function builds around a closure's closure
    # is a constant of the program: backward assigned it the trace's value, a tracer
    # (Note [Gradients that escape a trace] in torchjax/compile/_escaped_grads.py).
    w = torch.ones(3, device="tpu", requires_grad=True)

    def make():
        def inner(h):
            return h * w

        return lambda h: inner(h)

    hidden = make()

    def step(x):
        calls = [hidden]
        y = (lambda h: calls[0](h))(x)
        y.sum().backward()
        return y.detach()

    with pytest.raises(RuntimeError, match=r"\.grad of a tpu tensor that is not part of its state"):
        torchjax.jit(step)(torch.ones(3, device="tpu"))
    assert w.grad is None  # as before the call, and readable
    (w * 2).sum().backward()
    assert w.grad.cpu().tolist() == [2.0, 2.0, 2.0]
    # torch.autograd.grad accumulates nothing: not refused.
    out = torchjax.jit(lambda x: torch.autograd.grad((hidden(x) * x).sum(), x)[0])(
        torch.ones(3, device="tpu", requires_grad=True)
    )
    assert out.cpu().tolist() == [2.0, 2.0, 2.0]
