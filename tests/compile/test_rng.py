"""Randomness of compiled programs: draws and RNG states as eager leaves them (Note
[Compiled draws are eager's draws] in torchjax/compile/_jit.py, Note [Seeds set inside a
trace] in torchjax/tensor/random.py, Note [CPU generators a trace moves] in
torchjax/compile/_host_rng.py)."""

import pytest
import torch

import torchjax


def _state():
    """tpu:0's (seed, counter) and the next value of CPU's generator, which moves it."""
    return torch.tpu.get_rng_state().view(torch.int64).tolist(), torch.rand(2)


def _calls(fn, x, n=3, seed=5):
    """``fn(x)`` ``n`` times after ``torch.manual_seed(seed)``: the results on CPU and
    the states after each call."""
    torch.manual_seed(seed)
    got = []
    for _ in range(n):
        out = fn(x)
        out = out if isinstance(out, tuple) else (out,)
        got.append(([o.cpu() for o in out], _state()))
    return got


def _assert_same(got, want):
    for (outs, (tpu, cpu)), (outs_w, (tpu_w, cpu_w)) in zip(got, want, strict=True):
        for o, w in zip(outs, outs_w, strict=True):
            torch.testing.assert_close(o, w, rtol=0, atol=0)
        assert tpu == tpu_w
        torch.testing.assert_close(cpu, cpu_w, rtol=0, atol=0)


def _seeded(x):
    torch.manual_seed(0)
    return x + torch.randn(3, device=x.device)


def test_manual_seed_inside_jit_repeats_eager_values_and_states():
    # CPU repeats its seeded draws on every call; eager tpu does too, and jit must.
    cpu = [_seeded(torch.zeros(3)) for _ in range(2)]
    torch.testing.assert_close(cpu[0], cpu[1], rtol=0, atol=0)
    x = torch.zeros(3, device="tpu")
    want = _calls(_seeded, x)
    torch.testing.assert_close(want[0][0][0], want[1][0][0], rtol=0, atol=0)
    f = torchjax.jit(_seeded)
    _assert_same(_calls(f, x), want)
    assert f.trace_count == 1


def test_draws_before_and_after_a_seed_inside_jit():
    def fn(x):
        a = torch.rand(2, device="tpu")
        torch.tpu.manual_seed(1)  # tpu only: CPU's generator keeps its stream
        b = torch.randn(3, device="tpu")
        c = torch.rand(0, device="tpu")  # an empty draw still takes a key in eager
        d = torch.rand(4, device="tpu")
        return x + a.sum(), b, c, d

    x = torch.zeros(1, device="tpu")
    want = _calls(fn, x)
    f = torchjax.jit(fn)
    _assert_same(_calls(f, x), want)
    assert f.trace_count == 1


def test_unseeded_jit_draws_are_eager_draws():
    def fn(x):
        y = x + torch.randn(3, device="tpu")
        return torch.nn.functional.dropout(y, 0.5, training=True), torch.rand(2, device="tpu")

    x = torch.ones(3, device="tpu")
    want = _calls(fn, x)
    assert not torch.equal(want[0][0][1], want[1][0][1])  # new values on each call
    _assert_same(_calls(torchjax.jit(fn), x), want)


def test_fork_rng_inside_jit_matches_eager():
    def fn(x):
        with torch.random.fork_rng(device_type="tpu"):
            torch.manual_seed(0)
            a = torch.randn(3, device="tpu")
        return x + a, torch.randn(3, device="tpu")

    x = torch.zeros(3, device="tpu")
    want = _calls(fn, x)
    f = torchjax.jit(fn)
    _assert_same(_calls(f, x), want)
    assert f.trace_count == 1


def test_set_rng_state_of_a_state_saved_outside_jit():
    torch.manual_seed(11)
    torch.rand(5, device="tpu")
    saved = torch.tpu.get_rng_state()

    def fn(x):
        torch.tpu.set_rng_state(saved)
        return x + torch.rand(3, device="tpu"), torch.tpu.get_rng_state().view(torch.int64)

    x = torch.zeros(3, device="tpu")
    want = _calls(lambda x: fn(x)[0], x)
    f = torchjax.jit(fn)
    _assert_same(_calls(lambda x: f(x)[0], x), want)
    # Inside the trace the state read is the one set, as in eager.
    assert fn(x)[1].tolist() == [11, 2]


def test_seed_inside_a_repeated_step_and_draws_across_iterations():
    def step(acc):
        acc.add_(torch.rand(3, device="tpu"))

    def seeded_step(acc):
        acc.mul_(torch.rand(3, device="tpu"))
        torch.manual_seed(2)
        acc.add_(torch.rand(3, device="tpu"))

    for fn in (step, seeded_step):
        torch.manual_seed(3)
        acc = torch.ones(3, device="tpu")
        for _ in range(4):
            fn(acc)
        want = acc.cpu(), _state()
        torch.manual_seed(3)
        acc = torch.ones(3, device="tpu")
        with torch.no_grad():
            torchjax.jit(fn).repeat(4, acc)
        _assert_same([([acc.cpu()], _state())], [([want[0]], want[1])])


def test_cpu_generator_seeded_inside_jit():
    def fn(x, g):
        g.manual_seed(4)
        return x + torch.randn(3, generator=g).to(x.device)

    def calls(fn, g):
        # The generator moves between calls; each call seeds it again, as eager does.
        got = []
        for _ in range(3):
            out = fn(x, g).cpu()
            got.append((out, torch.rand(2, generator=g)))
        return got

    x = torch.zeros(3, device="tpu")
    want = calls(fn, torch.Generator())
    f = torchjax.jit(fn)
    for (o, after), (o_w, after_w) in zip(calls(f, torch.Generator()), want):
        torch.testing.assert_close(o, o_w, rtol=0, atol=0)
        torch.testing.assert_close(after, after_w, rtol=0, atol=0)
    assert f.trace_count == 1


def test_cpu_draws_inside_jit_are_new_on_every_call():
    # Without a seed a CPU draw would be a constant of the program: each call traces
    # again (and warns once), which draws anew as eager does.
    def fn(x, g):
        return x + torch.randn(3).to(x.device) + torch.rand(3, generator=g).to(x.device)

    x = torch.zeros(3, device="tpu")
    torch.manual_seed(6)
    g = torch.Generator().manual_seed(7)
    want = [fn(x, g).cpu() for _ in range(3)]
    f = torchjax.jit(fn)
    torch.manual_seed(6)
    g = torch.Generator().manual_seed(7)
    with pytest.warns(UserWarning, match="draws random numbers on CPU"):
        got = [f(x, g).cpu() for _ in range(3)]
    for o, w in zip(got, want):
        torch.testing.assert_close(o, w, rtol=0, atol=0)
    assert not torch.equal(got[0], got[1])


@pytest.mark.usefixtures("fresh_dynamo")
def test_torch_compile_seeded_and_unseeded_draws_match_eager():
    def unseeded(x):
        return x + torch.randn(3, device="tpu"), torch.rand(2, device="tpu")

    x = torch.zeros(3, device="tpu")
    for fn in (_seeded, unseeded):
        want = _calls(fn, x)
        _assert_same(_calls(torch.compile(fn, backend="tpu"), x), want)


def test_torch_seed_inside_jit_seeds_anew_on_every_call():
    # torch.seed() picks a seed at random: a program holding one would repeat it.
    def fn(x):
        torch.seed()
        return x + torch.rand(3, device="tpu")

    f = torchjax.jit(fn)
    x = torch.zeros(3, device="tpu")
    with pytest.warns(UserWarning, match="draws random numbers on CPU"):
        a, b = f(x).cpu(), f(x).cpu()
    assert not torch.equal(a, b)
    torch.manual_seed(0)  # leave the process seeded for the tests after this one


def test_torch_tpu_seed_inside_jit_is_refused():
    f = torchjax.jit(lambda x: (torch.tpu.seed(), x + 1)[1])
    with pytest.raises(RuntimeError, match=r"torch.tpu.seed\(\) inside torchjax.jit"):
        f(torch.zeros(3, device="tpu"))
