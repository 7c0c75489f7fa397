"""tpu optimizers take torch.optim's foreach path by default (Note [tpu parameters take
torch.optim's foreach path] in torchjax/device/_optim_foreach.py), with CPU's numbers bit
for bit, each ``_foreach_*`` op one executable (one recorded node in fused eager).

Parameters get the same seeded gradients on CPU and tpu every step, so what is compared
is the optimizer alone. Their sizes are multiples of 64 elements: CPU's kernels run a
tensor's last elements through a scalar loop that rounds some bfloat16 results apart
from its vectorised loop (``add`` with ``alpha`` rounds ``alpha * other`` to bfloat16
there first), and torchjax computes as the vectorised loop does.

The reference is CPU torch's default, the single-tensor loop, wherever torch's own
foreach and single-tensor paths give the same bits on CPU; where they differ on CPU too,
it is CPU torch with ``foreach=True`` (the path tpu now takes, as CUDA does). They differ
for NAdam, RAdam and ASGD in float32 (their foreach paths compute the per-step scalars in
another order) and, in bfloat16, for SGD with momentum, RMSprop, Adagrad, Adadelta,
NAdam, RAdam and ASGD (among the reasons: CPU's in-place foreach ``mul_`` rounds its
number to bfloat16 first, Note [In-place foreach mul rounds its number] in
torchjax/ops/foreach.py). ``test_references_are_cpus_two_paths`` checks the rule's picks
on a few of them.

In float32 the CPU reference runs with a correctly rounded ``sqrt``: CPU's float32 ``sqrt``
is SLEEF's, not correctly rounded, and XLA's is (docs/numerics.md), so every optimizer
that takes a square root differs there in the last bit of a few elements whichever path
it takes. Every other op of the reference is CPU's own kernel; the plain CPU run is
checked to be within that last bit.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch import optim
from torch.utils._python_dispatch import TorchDispatchMode

import torchjax

TPU = "tpu"
aten = torch.ops.aten
STEPS = 4

# (optimizer, options). ``lr_tensor``: lr given as a 0-d CPU tensor.
CASES = [
    (optim.Adam, {}),
    (optim.Adam, dict(amsgrad=True)),
    (optim.Adam, dict(maximize=True)),
    (optim.Adam, dict(weight_decay=0.1)),
    (optim.AdamW, {}),
    (optim.AdamW, dict(amsgrad=True, weight_decay=0.1)),
    (optim.AdamW, dict(maximize=True)),
    (optim.SGD, dict(lr=0.1)),
    (optim.SGD, dict(lr=0.1, momentum=0.9)),
    (optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)),
    (optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.5, maximize=True)),
    (optim.SGD, dict(lr=0.1, momentum=0.9, lr_tensor=True)),
    (optim.RMSprop, {}),
    (optim.RMSprop, dict(centered=True, momentum=0.9, weight_decay=0.1)),
    (optim.RMSprop, dict(maximize=True, momentum=0.5)),
    (optim.Adagrad, {}),
    (optim.Adagrad, dict(lr_decay=0.1, weight_decay=0.1, maximize=True)),
    (optim.Adamax, {}),
    (optim.Adamax, dict(weight_decay=0.1, maximize=True)),
    (optim.NAdam, {}),
    (optim.NAdam, dict(weight_decay=0.1, decoupled_weight_decay=True)),
    (optim.NAdam, dict(maximize=True, momentum_decay=0.01)),
    (optim.RAdam, {}),
    (optim.RAdam, dict(weight_decay=0.1, decoupled_weight_decay=True)),
    (optim.RAdam, dict(maximize=True)),
    (optim.Adadelta, {}),
    (optim.Adadelta, dict(weight_decay=0.1, maximize=True)),
    (optim.ASGD, {}),
    (optim.ASGD, dict(weight_decay=0.1, maximize=True)),
    (optim.Rprop, {}),
    (optim.Rprop, dict(maximize=True)),
]
DTYPES = [torch.float32, torch.bfloat16]


def _id(cls, options):
    return "-".join([cls.__name__, *(f"{k}={v}" for k, v in options.items())])


def _cases():
    return [
        pytest.param(cls, options, dtype, id=f"{_id(cls, options)}-{str(dtype)[6:]}")
        for dtype in DTYPES
        for cls, options in CASES
    ]


# The module and name of each optimizer's two implementations (AdamW's are Adam's).
_IMPL = {
    optim.Adam: ("adam", "adam"),
    optim.AdamW: ("adam", "adam"),
    optim.SGD: ("sgd", "sgd"),
    optim.RMSprop: ("rmsprop", "rmsprop"),
    optim.Adagrad: ("adagrad", "adagrad"),
    optim.Adamax: ("adamax", "adamax"),
    optim.NAdam: ("nadam", "nadam"),
    optim.RAdam: ("radam", "radam"),
    optim.Adadelta: ("adadelta", "adadelta"),
    optim.ASGD: ("asgd", "asgd"),
    optim.Rprop: ("rprop", "rprop"),
}


@contextlib.contextmanager
def _paths(cls):
    """The implementations ``cls``'s steps run, in order ("foreach" / "single"): torch's
    functional API looks them up in its module at every step."""
    import importlib

    module_name, name = _IMPL[cls]
    module = importlib.import_module(f"torch.optim.{module_name}")
    taken = []
    originals = {}
    for path, attr in (("foreach", f"_multi_tensor_{name}"), ("single", f"_single_tensor_{name}")):
        original = originals[attr] = getattr(module, attr)

        @functools.wraps(original)
        def spy(*args, _path=path, _original=original, **kwargs):
            taken.append(_path)
            return _original(*args, **kwargs)

        setattr(module, attr, spy)
    try:
        yield taken
    finally:
        for attr, original in originals.items():
            setattr(module, attr, original)


def _sqrt(x):
    # float64 holds every float32 square root's rounding exactly: one correct rounding.
    return x.double().sqrt().to(x.dtype) if x.dtype == torch.float32 else x.sqrt()


class _RoundedSqrt(TorchDispatchMode):
    """CPU torch with float32 ``sqrt`` (and the foreach ``sqrt``) correctly rounded."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.sqrt.default:
            return _sqrt(args[0])
        if func is aten.sqrt_.default:
            return args[0].copy_(_sqrt(args[0]))
        if func is aten._foreach_sqrt.default:
            return [_sqrt(t) for t in args[0]]
        if func is aten._foreach_sqrt_.default:
            for t in args[0]:
                t.copy_(_sqrt(t))
            return None
        return func(*args, **kwargs)


def _model(dtype, device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
    return model.to(dtype).to(device)


def _steps(cls, options, dtype, device, *, fused=False, rounded=False, steps=STEPS, **extra):
    """Params and optimizer state (on CPU) after ``steps`` steps with seeded gradients,
    and the implementations the steps took."""
    options = dict(options, **extra)
    if options.pop("lr_tensor", False):
        options["lr"] = torch.tensor(options["lr"])
    model = _model(dtype, device)
    opt = cls(model.parameters(), **options)
    gen = torch.Generator().manual_seed(1)
    mode = _RoundedSqrt() if rounded else contextlib.nullcontext()
    with _paths(cls) as taken, mode:
        for _ in range(steps):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen).to(dtype).to(device)
            with torchjax.fused(fused):
                opt.step()
    params = [p.detach().cpu() for p in model.parameters()]
    state = [
        {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
        for p in model.parameters()
    ]
    return (params, state), taken


def _equal(a, b) -> bool:
    (pa, sa), (pb, sb) = a, b
    if not all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True)):
        return False
    for x, y in zip(sa, sb, strict=True):
        if x.keys() != y.keys():
            return False
        for k in x:
            if isinstance(x[k], torch.Tensor):
                if x[k].dtype != y[k].dtype or not torch.equal(x[k], y[k]):
                    return False
            elif x[k] != y[k]:
                return False
    return True


def _reference(cls, options, dtype):
    """CPU's default (single-tensor) result, or its foreach=True one where the two
    differ on CPU, and which it is."""
    rounded = dtype == torch.float32
    default, taken = _steps(cls, options, dtype, "cpu", rounded=rounded)
    assert set(taken) == {"single"}, taken  # CPU's default
    if options.get("lr_tensor") and cls is not optim.SGD:
        # Adam with a tensor lr and capturable=False takes the single-tensor loop on
        # every device (torch's own rule), so there is no other path to compare.
        return default, "single"
    foreach, _ = _steps(cls, options, dtype, "cpu", rounded=rounded, foreach=True)
    return (default, "single") if _equal(default, foreach) else (foreach, "foreach")


@pytest.mark.parametrize("cls,options,dtype", _cases())
def test_default_is_foreach_and_equals_cpu_bit_for_bit(cls, options, dtype):
    want, _ = _reference(cls, options, dtype)
    got, taken = _steps(cls, options, dtype, TPU)
    assert taken == ["foreach"] * STEPS
    assert _equal(got, want)
    if dtype == torch.float32:
        # The reference's correctly rounded sqrt is the only change: CPU as it is lies
        # within a last bit.
        plain, _ = _steps(cls, options, dtype, "cpu")
        for g, p in zip(got[0], plain[0]):
            torch.testing.assert_close(g, p, rtol=1e-6, atol=1e-7)


# Both float dtypes, one case per optimizer family, in fused eager.
_FUSED = [
    (optim.Adam, dict(amsgrad=True)),
    (optim.AdamW, dict(weight_decay=0.1)),
    (optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)),
    (optim.RMSprop, dict(centered=True, momentum=0.9, weight_decay=0.1)),
    (optim.Adagrad, dict(lr_decay=0.1, weight_decay=0.1)),
    (optim.NAdam, {}),
    (optim.RAdam, {}),
    (optim.Adadelta, {}),
]


@pytest.mark.parametrize(
    "cls,options,dtype",
    [pytest.param(c, o, d, id=f"{_id(c, o)}-{str(d)[6:]}") for d in DTYPES for c, o in _FUSED],
)
def test_fused_eager_default_equals_cpu_bit_for_bit(cls, options, dtype):
    want, _ = _reference(cls, options, dtype)
    got, taken = _steps(cls, options, dtype, TPU, fused=True)
    assert taken == ["foreach"] * STEPS
    assert _equal(got, want)


def test_references_are_cpus_two_paths():
    # The rule of the module docstring, as measured on torch 2.13's CPU kernels: where
    # torch's own two paths agree the reference is the default.
    picked = {
        (str(d)[6:], _id(c, o)): _reference(c, o, d)[1]
        for d in DTYPES
        for c, o in [
            (optim.AdamW, {}),
            (optim.SGD, dict(lr=0.1)),
            (optim.SGD, dict(lr=0.1, momentum=0.9)),
            (optim.NAdam, {}),
        ]
    }
    assert picked == {
        ("float32", "AdamW"): "single",
        ("float32", "SGD-lr=0.1"): "single",
        ("float32", "SGD-lr=0.1-momentum=0.9"): "single",
        ("float32", "NAdam"): "foreach",
        ("bfloat16", "AdamW"): "single",
        ("bfloat16", "SGD-lr=0.1"): "single",
        ("bfloat16", "SGD-lr=0.1-momentum=0.9"): "foreach",
        ("bfloat16", "NAdam"): "foreach",
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize(
    "extra,path",
    [
        (dict(foreach=False), "single"),
        (dict(foreach=True), "foreach"),
        (dict(lr=torch.tensor(1e-3)), "single"),  # Adam's rule for a tensor lr
    ],
    ids=["foreach-False", "foreach-True", "lr-tensor"],
)
def test_explicit_choices_keep_their_path(extra, path, dtype):
    want, _ = _reference(optim.Adam, {}, dtype)
    got, taken = _steps(optim.Adam, {}, dtype, TPU, **extra)
    assert taken == [path] * STEPS
    if "lr" not in extra:
        assert _equal(got, want)
    else:
        cpu, _ = _steps(optim.Adam, {}, dtype, "cpu", rounded=dtype == torch.float32, **extra)
        assert _equal(got, cpu)


def test_differentiable_keeps_the_single_tensor_loop():
    # torch's rule: a differentiable step is never foreach. Parameters that do not
    # require grad, so that the step may write them with autograd on.
    results = []
    for device in ("cpu", TPU):
        p = torch.linspace(-1, 1, 64).to(device)
        p.grad = torch.linspace(0.5, -2, 64).to(device)
        opt = optim.Adam([p], lr=0.1, differentiable=True)
        with _paths(optim.Adam) as taken:
            for _ in range(2):
                opt.step()
        assert taken == ["single", "single"]
        results.append(p.cpu())
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-7)


def test_fused_true_stays_opt_in():
    # The default is not the fused kernel, whose numbers are CPU's fused kernel's.
    model = _model(torch.float32, TPU)
    assert optim.AdamW(model.parameters()).defaults["fused"] is None
    with _paths(optim.AdamW) as taken:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optim.AdamW(model.parameters(), fused=True).step()
    assert taken == []  # _fused_adam


def test_cpu_parameters_keep_the_single_tensor_default():
    _, taken = _steps(optim.AdamW, {}, torch.float32, "cpu", steps=2)
    assert taken == ["single", "single"]


# Optimizers whose foreach step runs nothing but ``_foreach_*`` ops on tpu (ASGD and
# Rprop also run per-tensor Python of their own).
_ONLY_FOREACH = [
    (optim.Adam, dict(amsgrad=True, weight_decay=0.1)),
    (optim.AdamW, {}),
    (optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)),
    (optim.RMSprop, dict(centered=True, momentum=0.9, weight_decay=0.1, maximize=True)),
    (optim.Adagrad, dict(lr_decay=0.1, weight_decay=0.1, maximize=True)),
    (optim.Adamax, dict(weight_decay=0.1, maximize=True)),
    (optim.NAdam, dict(weight_decay=0.1, decoupled_weight_decay=True)),
    (optim.RAdam, dict(maximize=True)),
    (optim.Adadelta, dict(weight_decay=0.1, maximize=True)),
]


def _step_counts(opt, model, fused):
    """What one more step did: torchjax.stats() differences, and each op's calls and
    op-by-op runs."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    torch.tpu.synchronize()
    before = torchjax.stats()
    # Recorded, not captured (a repeated captured step records nothing: Note [Captured
    # optimizer steps], tests/compile/test_captured_optim.py).
    with torchjax.fused(fused, capture=False):
        opt.step()
    torch.tpu.synchronize()
    after = torchjax.stats()
    ops = {}
    for name, c in after["ops"].items():
        b = before["ops"].get(name, {"calls": 0, "op_by_op": 0})
        calls, op_by_op = c["calls"] - b["calls"], c["op_by_op"] - b["op_by_op"]
        if calls or op_by_op:
            ops[name] = (calls, op_by_op)
    counts = {k: after[k] - before[k] for k in ("executions", "fused_ops", "fused_segments")}
    return counts, ops


@pytest.mark.parametrize(
    "cls,options", [pytest.param(c, o, id=_id(c, o)) for c, o in _ONLY_FOREACH]
)
def test_each_foreach_op_is_one_executable_and_one_recorded_node(cls, options):
    model = _model(torch.float32, TPU)
    opt = cls(model.parameters(), **options)
    for fused in (False, True, False, True):  # the first of each builds the programs
        counts, ops = _step_counts(opt, model, fused)
        if not fused:
            eager_counts, eager_ops = counts, ops
    # Eager: every op of the step a _foreach_* op, each one compiled call (no per-element
    # run), one execution each.
    assert eager_ops and all(name.startswith("aten::_foreach_") for name in eager_ops), eager_ops
    assert all(op_by_op == 0 for _, op_by_op in eager_ops.values()), eager_ops
    n = sum(calls for calls, _ in eager_ops.values())
    assert eager_counts["executions"] == n
    # Fused: each foreach op one recorded node for its whole lists, one program a step.
    assert counts == {"executions": 1, "fused_ops": n, "fused_segments": 1}
    assert ops == {}


def test_clip_grad_norm_defaults_to_foreach_bit_for_bit():
    for dtype in DTYPES:
        models = [_model(dtype, d) for d in ("cpu", TPU)]
        for model in models:
            gen = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen).to(dtype).to(p.device)
        want = torch.nn.utils.clip_grad_norm_(models[0].parameters(), 0.5)
        before = torchjax.stats()["ops"].get("aten::_foreach_norm.Scalar", {"calls": 0})
        got = torch.nn.utils.clip_grad_norm_(models[1].parameters(), 0.5)
        after = torchjax.stats()["ops"]["aten::_foreach_norm.Scalar"]
        assert after["calls"] == before["calls"] + 1  # the foreach default, compiled
        assert torch.equal(got.cpu(), want)
        for c, t in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(t.grad.cpu(), c.grad)


def test_clip_grad_norm_is_one_program_in_fused_eager():
    model = _model(torch.float32, TPU)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    for _ in range(2):  # the first builds the program
        torch.tpu.synchronize()
        before = torchjax.stats()
        with torchjax.fused():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        torch.tpu.synchronize()
        after = torchjax.stats()
    counts = {k: after[k] - before[k] for k in ("executions", "fused_segments")}
    assert counts == {"executions": 1, "fused_segments": 1}
