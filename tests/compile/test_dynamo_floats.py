"""Python floats that change between calls of a ``torch.compile(backend="tpu")`` graph are
traced inputs, not static values (Note [Traced Python floats] in
torchjax/ops/traced_scalars.py): a learning-rate schedule compiles nothing per step, the
results are CPU's, and a graph that needs the number itself falls back to static values."""

import copy

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
        ("f32 addcmul", torch.float32, lambda x, s: torch.addcmul(x, x, x, value=-s), True),
        ("bf16 lerp", torch.bfloat16, lambda x, s: torch.lerp(x, x.flip(1), s), True),
        ("f32 clamp", torch.float32, lambda x, s: x.clamp(min=-s, max=s), True),
        ("f32 pow", torch.float32, lambda x, s: x.abs().pow(s), False),
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
    for value in VALUES:
        cpu.scaling = tpu.scaling = value
        torch.testing.assert_close(compiled(x.to("tpu")).cpu(), cpu(x), rtol=1e-6, atol=1e-6)
    assert _traces() - before == 2
