"""A ``_foreach_*`` op's single Python float is a value of its executable (Note [Compiled
foreach] in torchjax/ops/foreach.py): torch.optim's foreach steps under an LR schedule
(the default on tpu tensors) keep one executable per op, where each new float was a new
key until ``MAX_FLOAT_VARIANTS`` and then ran element by element. Values against CPU
PyTorch; a float an op needs as a number (``pow``'s exponent) still gets it."""

import pytest
import torch

from torchjax.ops import executables
from torchjax.ops.cached_compute import cache_info

aten = torch.ops.aten
TPU = "tpu"
STEPS = 7


def _adamw_one_cycle(params):
    # lr and beta1 change every step: _foreach_mul_ (weight decay), _foreach_lerp_.
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
    return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=50)


def _sgd_lambda(params):
    # _foreach_add_(params, grads, alpha=-lr): a keyword float.
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3, foreach=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))


def _rmsprop_step(params):
    opt = torch.optim.RMSprop(params, lr=1e-2, momentum=0.5, foreach=True)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)


def _train(device, make, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = model.to(device, dtype)
    x, y = torch.randn(5, 6).to(device, dtype), torch.randn(5, 3).to(device, dtype)
    opt, sched = make(model.parameters())
    keys = []
    for _ in range(STEPS):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        sched.step()
        keys.append(_foreach_keys())
    return [p.detach().cpu() for p in model.parameters()], keys


def _foreach_keys():
    return {
        f: (info.keys, info.calls)
        for f, info in cache_info().items()
        if f._opname.startswith("_foreach_") and info.calls
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", [_adamw_one_cycle, _sgd_lambda, _rmsprop_step])
def test_scheduled_foreach_steps_keep_their_executables(make, dtype):
    executables.clear_caches()
    got, keys = _train(TPU, make, dtype)
    want, _ = _train("cpu", make, dtype)
    for g, w in zip(got, want, strict=True):
        # bfloat16: the forward's and backward's products round as XLA's do, not CPU's.
        tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(g, w, **tol)
    assert keys[-1], "no foreach op ran compiled"
    # No new key after the second step (a new float was a new key before), and every op
    # ran compiled in every later step (none fell back element by element).
    assert {f: k for f, (k, _) in keys[-1].items()} == {f: k for f, (k, _) in keys[1].items()}
    for before, after in zip(keys[1:], keys[2:]):
        assert all(after[f][1] > calls for f, (_, calls) in before.items()), keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_single_floats_compute_as_python_floats(dtype):
    # A 0-d element promotes with a Python float as with a weak scalar (its own dtype).
    executables.clear_caches()
    torch.manual_seed(0)
    # Half types: numels CPU's vectorised loops take whole (its scalar loop over the
    # last ``numel % 32`` elements rounds add's ``alpha * other`` first: Note
    # [Half-precision inputs are rounded first]).
    ts = [torch.randn(4, 8).to(dtype), torch.randn(64).to(dtype)]
    if dtype == torch.float32:
        ts.append(torch.tensor(2.0, dtype=dtype))
    gs = [torch.randn_like(t) for t in ts]
    tt, tg = [t.to(TPU) for t in ts], [g.to(TPU) for g in gs]
    outs = []
    for i in range(STEPS):
        lr = 0.1 / (i + 1)
        for lists in ((ts, gs), (tt, tg)):
            torch._foreach_add_(lists[0], lists[1], alpha=-lr)
            torch._foreach_mul_(lists[0], 1 - lr)
            torch._foreach_lerp_(lists[0], lists[1], lr)
        outs.append((torch._foreach_div(ts, 1.0 + lr), torch._foreach_div(tt, 1.0 + lr)))
    # float32 within rounding: the suite compiles without LLVM's FMA contraction, which
    # CPU's add with alpha has (Note [Compile speed in the suite] in tests/conftest.py).
    exact = {"rtol": 0, "atol": 0} if dtype != torch.float32 else {}
    for want, got in [(ts, tt)] + outs:
        for w, g in zip(want, got, strict=True):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g.cpu(), w, **exact)
    for op in (aten._foreach_mul_.Scalar, aten._foreach_lerp_.Scalar, aten._foreach_add_.List):
        assert cache_info(op).keys == 1, op


def test_an_exponent_is_still_a_number():
    # aten::pow picks sqrt, x * x ... by its exponent: the trace asks for the number, and
    # the overload takes its floats as static values from then on.
    executables.clear_caches()
    ts = [torch.rand(4) + 0.5, torch.rand(2, 3) + 0.5]
    tt = [t.to(TPU) for t in ts]
    ran = 0
    for e in (0.5, 2.0, -0.5, 3.0, 1.5):
        for w, g in zip(torch._foreach_pow(ts, e), torch._foreach_pow(tt, e), strict=True):
            torch.testing.assert_close(g.cpu(), w)
            ran += 1
    assert ran == 10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_in_place_mul_rounds_its_number_as_cpu(dtype):
    # Note [In-place foreach mul rounds its number]: CPU's in-place _foreach_mul_ reads a
    # half list's number in its dtype; the out-of-place op and Tensor.mul_ do not.
    torch.manual_seed(0)
    ran = 0
    for s in (0.0623, 0.99, 0.31, 1 - 1e-2 * 0.1):
        x = [torch.randn(64).to(dtype), torch.tensor(1.7, dtype=dtype)]
        calls = {
            "Scalar": lambda lst, s=s: torch._foreach_mul_(lst, s),
            "ScalarList": lambda lst, s=s: torch._foreach_mul_(lst, [s] * len(lst)),
            "out of place": lambda lst, s=s: lst.__setitem__(
                slice(None), torch._foreach_mul(lst, [s] * len(lst))
            ),
        }
        for call in calls.values():
            want, got = [t.clone() for t in x], [t.to(TPU) for t in x]
            call(want)
            call(got)
            for w, g in zip(want, got, strict=True):
                torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)
                ran += 1
    assert ran == 24


def test_integer_lists_keep_static_numbers():
    # An integer list's float makes torch's cast error, as on CPU.
    ts = [torch.arange(4), torch.arange(3)]
    with pytest.raises(RuntimeError) as want:
        torch._foreach_add_(ts, 1.5)
    with pytest.raises(RuntimeError) as got:
        torch._foreach_add_([t.to(TPU) for t in ts], 1.5)
    assert str(got.value).startswith(str(want.value))
