"""Python floats that change between calls of a ``torch.compile(backend="tpu")`` graph are
traced inputs, not static values (Note [Traced Python floats] in
torchjax/ops/traced_scalars.py): a learning-rate schedule compiles nothing per step, the
results are CPU's, and a graph that needs the number itself falls back to static values."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import torchjax

VALUES = (0.5, 0.3, 0.125, 0.7, 1.9)  # the first is Dynamo's specialised constant


def _traces():
    return torchjax.compile.dynamo_stats()["traces"]


def _compiled_calls(fn, make_args, values=VALUES):
    """``fn`` compiled, called once per value (a Python float argument): the tpu
    results, CPU eager's, and how many programs were traced."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tpu")
    before = _traces()
    got, want = [], []
    for s in values:
        cpu_args = make_args()
        tpu_args = [a.to("tpu") if isinstance(a, torch.Tensor) else a for a in cpu_args]
        got.append(compiled(*tpu_args, s))
        want.append(fn(*cpu_args, s))
    return got, want, _traces() - before


def _x(dtype):
    gen = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return lambda: [(torch.randn(4, 8, generator=gen) * 3).to(dtype)]
    return lambda: [torch.randint(-50, 50, (4, 8), generator=gen, dtype=dtype)]


# (name, dtype, fn, exact): a single op gives CPU's bits; a compiled chain of ops may
# round 1-2 ulp differently (XLA fuses it), with static floats as with traced ones.
@pytest.mark.parametrize(
    "case",
    [
        ("bf16 * s", torch.bfloat16, lambda x, s: x * s, True),
        ("f16 / s", torch.float16, lambda x, s: x / s, True),
        ("f64 * s", torch.float64, lambda x, s: x * s - s / 3, True),
        ("int64 * s", torch.int64, lambda x, s: x * s, True),
        ("int32 + s", torch.int32, lambda x, s: x + s, True),
        ("bf16 add alpha", torch.bfloat16, lambda x, s: torch.add(x, x.flip(0), alpha=s), True),
        ("f32 sub alpha", torch.float32, lambda x, s: torch.sub(x, x.flip(0), alpha=s), False),
        ("f32 addcmul", torch.float32, lambda x, s: torch.addcmul(x, x, x, value=-s), True),
        ("bf16 lerp", torch.bfloat16, lambda x, s: torch.lerp(x, x.flip(1), s), True),
        ("f32 clamp", torch.float32, lambda x, s: x.clamp(min=-s, max=s), True),
        ("f32 chain", torch.float32, lambda x, s: (x * (1 - s * 0.01) + s) / (1 - s * s), False),
    ],
    ids=lambda c: c[0],
)
def test_a_changing_float_is_traced_once_and_gives_cpus_values(case):
    _, dtype, fn, exact = case
    got, want, traces = _compiled_calls(fn, _x(dtype))
    assert len(got) == len(want) == len(VALUES)
    for g, w in zip(got, want):
        assert g.device.type == "tpu" and g.dtype == w.dtype, (g.dtype, w.dtype)
        tol = dict(rtol=0, atol=0) if exact else dict(rtol=2.5e-7, atol=1e-6)
        torch.testing.assert_close(g.cpu(), w, **tol)
    # One program for the first (specialised) value, one for every later value: a
    # static float made one per value (5 here).
    assert traces == 2, traces


@pytest.mark.parametrize(
    "case",
    [
        # F.dropout's p is a float argument (not a Scalar): the number itself
        ("dropout p", lambda x, s: F.dropout(x, p=s / 4, training=False) + s),
        # int() of the float: a size, a Python value
        ("int()", lambda x, s: x[: int(s * 2) + 1] * s),
        # Python's float power: torch checks the base's sign on the number (a negative
        # base fails in Dynamo's own fake run, with any backend)
        ("power", lambda x, s: x * (2 - s) ** 2),
        # a tensor to the power of the float: ATen picks sqrt, rsqrt, x * x... by value
        ("tensor power", lambda x, s: x.abs().pow(s)),
    ],
    ids=lambda c: c[0],
)
def test_a_graph_that_needs_the_number_falls_back_to_static_values(case):
    _, fn = case
    got, want, traces = _compiled_calls(fn, _x(torch.float32))
    assert len(got) == len(want) == len(VALUES)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.cpu(), w)
    # static values: one program per value (and at most one attempt traced in vain per
    # graph), never a wrong number
    assert len(VALUES) <= traces <= 2 * len(VALUES), traces


@pytest.mark.parametrize(
    "opt",
    [
        (torch.optim.AdamW, dict(weight_decay=0.1), dict(max_lr=0.05)),
        (torch.optim.SGD, dict(momentum=0.9), dict(max_lr=0.1)),
    ],
    ids=["AdamW", "SGD-momentum"],
)
def test_one_cycle_lr_train_step_compiles_a_fixed_number_of_programs(opt):
    # OneCycleLR sets lr (and AdamW's betas / SGD's momentum) every step: each step was a
    # new XLA program (15 steps: 16 traces); the floats are inputs now.
    opt_cls, opt_kwargs, sched_kwargs = opt
    steps = 12

    def train(device, backend):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        model = model.to(device)
        optimizer = opt_cls(model.parameters(), lr=0.01, **opt_kwargs)
        sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, total_steps=steps, **sched_kwargs)

        @torch.compile(backend=backend)
        def step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        gen = torch.Generator().manual_seed(1)
        before = _traces()
        losses = []
        for _ in range(steps):
            x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)
            losses.append(step(x.to(device), y.to(device)).item())
            sched.step()
        params = [p.detach().cpu() for p in model.parameters()]
        return losses, params, _traces() - before

    cpu_losses, cpu_params, _ = train("cpu", "eager")
    losses, params, traces = train("tpu", "tpu")
    torch.testing.assert_close(losses, cpu_losses, rtol=1e-5, atol=1e-6)
    for p, c in zip(params, cpu_params):
        torch.testing.assert_close(p, c, rtol=1e-5, atol=1e-5)
    # the first step's specialised floats, the graph with float inputs, Dynamo's
    # automatic-dynamic recompiles: a handful, not one per step
    assert 0 < traces <= 4, traces


def test_module_float_attribute_keeps_one_program_for_new_values():
    # A float attribute (attention's scaling) that changes: the recompiled graph takes it
    # as an input, and the values after it compile nothing.
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.scaling = 1.0

        def forward(self, x):
            return self.proj(x) * self.scaling

    cpu = Scaled()
    tpu = copy.deepcopy(cpu).to("tpu")
    torch._dynamo.reset()
    compiled = torch.compile(tpu, backend="tpu")
    x = torch.randn(2, 4)
    before = _traces()
    with torch.no_grad():  # inference: with grad, the backward would need the number
        for value in VALUES:
            cpu.scaling = tpu.scaling = value
            got = compiled(x.to("tpu")).cpu()
            torch.testing.assert_close(got, cpu(x), rtol=1e-6, atol=1e-6)
    assert _traces() - before == 2


def _eager_or_error(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the exception is the result compared
        return e


def _same_as_cpu(fn, make_args, values, device="tpu"):
    """``fn`` compiled on tpu against CPU eager for each value: equal results (NaNs
    equal) or the same exception type; the number of values compared."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tpu")
    for s in values:
        cpu_args = make_args()
        tpu_args = [a.to("tpu") if isinstance(a, torch.Tensor) else a for a in cpu_args]
        want = _eager_or_error(fn, *cpu_args, s)
        if isinstance(want, Exception):
            with pytest.raises(type(want)):
                compiled(*tpu_args, s)
            continue
        got = compiled(*tpu_args, s)
        assert got.device.type == device and got.dtype == want.dtype, (s, got, want)
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)
    return len(values)


def test_a_float_used_by_the_host_part_of_a_split_graph():
    # A host copy splits the graph; the float's value reached the host part as a dead
    # tracer: NaN (or LeakedTracerError). Such graphs take static numbers.
    def f(x, s):
        c = x.cpu()
        return c * s + (1 - s), x * s

    def g(x, s):
        return f(x, s)[0]

    assert _same_as_cpu(g, lambda: [torch.arange(3.0)], VALUES, device="cpu") == len(VALUES)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="tpu")
    for s in VALUES:
        host, dev = compiled(torch.arange(3.0).to("tpu"), s)
        want_host, want_dev = f(torch.arange(3.0), s)
        assert host.device.type == "cpu" and torch.equal(host, want_host)
        torch.testing.assert_close(dev.cpu(), want_dev, rtol=0, atol=0)


@pytest.mark.parametrize(
    "case",
    [
        ("add alpha", lambda x, y, s: torch.add(x, y, alpha=s)),
        ("lerp", lambda x, y, s: torch.lerp(x, y, s)),
        ("pow", lambda x, y, s: x.abs() ** s + y),
        ("celu", lambda x, y, s: F.celu(x, s) * y),
    ],
    ids=lambda c: c[0],
)
def test_gradients_through_a_changing_float(case):
    # autograd keeps the float for the backward, traced later, which read its number:
    # NeedsValue at .backward(). Graphs whose inputs require grad take static numbers.
    _, fn = case
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tpu")
    gen = torch.Generator().manual_seed(0)
    for s in VALUES:
        x0, y0 = torch.randn(5, generator=gen) + 2, torch.randn(5, generator=gen)
        cpu = [x0.clone().requires_grad_(), y0.clone().requires_grad_()]
        tpu = [x0.to("tpu").requires_grad_(), y0.to("tpu").requires_grad_()]
        fn(*cpu, s).sum().backward()
        compiled(*tpu, s).sum().backward()
        for t, c in zip(tpu, cpu):
            torch.testing.assert_close(t.grad.cpu(), c.grad, rtol=1e-6, atol=1e-6)


def test_pow_by_a_changing_float_keeps_atens_special_exponents():
    # ATen computes x ** 0.5 as sqrt, ** -0.5 as rsqrt, ** 2 as x * x...: at -inf and
    # -0.0 those differ from the general power, so the exponent's value is needed.
    def x():
        return [torch.tensor([-math.inf, -0.0, 0.0, 4.0, -2.0, math.inf])]

    values = (3.0, 0.5, -0.5, 2.0, -1.0, -2.0, 0.3)
    for dtype in (torch.float32, torch.float64):
        make = lambda dtype=dtype: [t.to(dtype) for t in x()]  # noqa: E731
        assert _same_as_cpu(lambda t, s: t**s, make, values) == len(values)


@pytest.mark.parametrize(
    "case",
    [
        ("round", lambda x, s: x * round(s)),
        ("round ndigits", lambda x, s: x * round(s, 1)),
        ("is_integer", lambda x, s: x * s if s.is_integer() else x - s),
        ("and", lambda x, s: x * s if (s > 0.2) & (s < 1) else x + s),
    ],
    ids=lambda c: c[0],
)
def test_symbolic_float_methods_the_node_lacks(case):
    # torch asked the traced float's node for methods it did not have (TypeError,
    # AttributeError): the graph now takes static numbers, as eager computes.
    _, fn = case
    values = (0.5, 0.3, 1.7, 2.0, 0.25)
    assert _same_as_cpu(fn, _x(torch.float32), values) == len(values)


@pytest.mark.parametrize(
    "case",
    [
        ("clamp max", torch.float32, lambda x, s: x.clamp(max=s)),
        ("bf16 add alpha", torch.bfloat16, lambda x, s: torch.add(x, x, alpha=s)),
    ],
    ids=lambda c: c[0],
)
def test_range_checks_of_a_changing_float(case):
    # A number that does not fit the result dtype raises in eager (c10's checked
    # conversion); the traced value skipped the check and gave inf or a wrapped value.
    _, dtype, fn = case
    values = (0.5, 1.5, 1e300, -2.7, 3.0, float("nan"))
    assert _same_as_cpu(fn, _x(dtype), values) == len(values)
