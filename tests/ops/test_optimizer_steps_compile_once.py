"""An eager training step compiles nothing after its first steps, though torch.optim
passes new Python floats every step (Note [Python floats as values of an op's program]
in torchjax/ops/cached_compute.py), plain and fused; and the floats that a lowering
needs as numbers still get them. Values against CPU PyTorch."""

import re

import pytest
import torch

import torchjax
from torchjax.ops import cached_compute, executables

aten = torch.ops.aten
TPU = "tpu"
STEPS = 7


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2), None


def _adam_one_cycle(params):
    # OneCycleLR changes lr and beta1 (the weight of exp_avg.lerp_) every step.
    opt = torch.optim.Adam(params, lr=1e-2, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=50)


def _sgd_lambda(params):
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))


def _sgd_nesterov(params):
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)


def _train(device, make, fused):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(
        device
    )
    x, y = torch.randn(5, 6).to(device), torch.randn(5, 3).to(device)
    opt, sched = make(model.parameters())
    compiles = []
    for _ in range(STEPS):
        before = torchjax.stats()["compiles"]
        with torchjax.fused(fused):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            if sched is not None:
                sched.step()
        params = [p.detach().cpu() for p in model.parameters()]  # runs the step
        compiles.append(torchjax.stats()["compiles"] - before)
    return compiles, params


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("make", [_adamw, _adam_one_cycle, _sgd_lambda, _sgd_nesterov])
def test_optimizer_steps_compile_nothing_after_the_second(make, fused):
    executables.clear_caches()  # float keys counted since a clean start
    compiles, got = _train(TPU, make, fused)
    _, want = _train("cpu", make, False)
    assert compiles[0] > 0  # the run compiled what it counts
    assert compiles[2:] == [0] * (STEPS - 2), compiles
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_the_step_size_is_one_executable_argument():
    # addcdiv_'s value (Adam's -step_size): one key and one trace for any value.
    executables.clear_caches()
    p, m, d = torch.randn(4, 3), torch.randn(4, 3), torch.rand(4, 3) + 0.5
    tp, tm, td = p.to(TPU), m.to(TPU), d.to(TPU)
    for v in (-0.1, -0.2, 0.3, 1e-3, -7.5, 2.0):
        tp.addcdiv_(tm, td, value=v)
        p.addcdiv_(m, d, value=v)
        assert torch.equal(tp.cpu(), p)
    info = cached_compute.cache_info(aten.addcdiv.default)
    assert (info.keys, info.traces, info.op_by_op) == (1, 1, 0)


def test_a_weight_passed_positionally_takes_the_fast_path_as_an_argument():
    executables.clear_caches()
    a, b = torch.randn(8), torch.randn(8)
    ta, tb = a.to(TPU), b.to(TPU)
    for w in (0.1, 0.25, 0.7, 0.9, 0.95, 0.99):
        assert torch.equal(torch.lerp(ta, tb, w).cpu(), torch.lerp(a, b, w))
    info = cached_compute.cache_info(aten.lerp.Scalar)
    assert (info.keys, info.traces, info.calls) == (1, 1, 6)


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64], ids=["int64", "complex64"])
def test_floats_an_integer_or_complex_op_reads_stay_static(dtype):
    # An integer addcmul truncates a float value (CPU's kernel reads it as the integer
    # type); complex arithmetic scales by complex(value): values the lowering needs.
    ints = dtype == torch.int64
    g = torch.Generator().manual_seed(0)
    if ints:
        make = lambda: torch.randint(-5, 5, (6,), generator=g)  # noqa: E731
    else:
        make = lambda: torch.randn(6, dtype=dtype, generator=g)  # noqa: E731
    s, t1, t2 = make(), make(), make()
    executables.clear_caches()
    ran = 0
    for v in (2.5, -1.75, 0.5):
        got = torch.addcmul(s.to(TPU), t1.to(TPU), t2.to(TPU), value=v).cpu()
        want = torch.addcmul(s, t1, t2, value=v)
        if ints:
            assert torch.equal(got, want)
        else:
            # complex64 products round differently from CPU's vectorised complex multiply
            # in the last bit on most inputs (a 1-ulp difference of the op, not of the
            # key): compared at one float32 ulp of the result's scale
            torch.testing.assert_close(got, want, rtol=2**-22, atol=2**-21)
        ran += 1
    assert ran == 3
    # each value a static key of the one op (the reads this test is about)
    info = cached_compute.cache_info(aten.addcmul.default)
    assert info.keys == 3 and info.op_by_op == 0


def test_alpha_is_checked_against_the_result_type_on_every_call():
    x = torch.randn(3).half()
    tx = x.to(TPU)
    torch.testing.assert_close(torch.add(tx, tx, alpha=2.5).cpu(), torch.add(x, x, alpha=2.5))
    with pytest.raises(RuntimeError) as cpu_error:
        torch.add(x, x, alpha=1e10)
    # The executable of this key exists: the check is still made, with CPU's text.
    with pytest.raises(RuntimeError, match=re.escape(str(cpu_error.value))):
        torch.add(tx, tx, alpha=1e10)
