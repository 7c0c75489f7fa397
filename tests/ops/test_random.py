"""Tests for torchjax/ops/random.py.

Random values differ from CPU torch's (another generator), so samplers are checked for
shape, dtype, device, range and statistics (generous bounds on 10k samples), and the RNG
state for determinism: same seed -> same values, successive draws differ, get/set state
and fork_rng replay.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchjax

N = 10_000
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _cpu(t):
    assert t.device.type == "tpu"
    return t.cpu().double()


# ---------------------------------------------------------------------------------------
# samplers: shape, dtype, range, statistics


@pytest.mark.parametrize("dtype", FLOATS)
def test_uniform(dtype):
    t = torch.empty(N, dtype=dtype, device="tpu").uniform_(-2, 3)
    assert t.dtype == dtype and t.shape == (N,)
    c = _cpu(t)
    assert c.min() >= -2 and c.max() <= 3
    assert abs(c.mean() - 0.5) < 0.1 and abs(c.std() - 5 / 12**0.5) < 0.1
    r = torch.rand(N, dtype=dtype, device="tpu")
    assert r.dtype == dtype and 0 <= _cpu(r).min() and _cpu(r).max() <= 1


@pytest.mark.parametrize("dtype", FLOATS)
def test_normal_(dtype):
    t = torch.empty(N, dtype=dtype, device="tpu").normal_(2.0, 3.0)
    assert t.dtype == dtype
    c = _cpu(t)
    assert abs(c.mean() - 2) < 0.2 and abs(c.std() - 3) < 0.2
    r = torch.randn(100, 100, dtype=dtype, device="tpu")
    assert r.shape == (100, 100) and abs(_cpu(r).std() - 1) < 0.1


def test_normal_overloads():
    mean = torch.full((N,), 5.0, device="tpu")
    std = torch.full((N,), 0.5, device="tpu")
    for t, m, s in [
        (torch.normal(mean, 2.0), 5, 2),
        (torch.normal(1.0, std), 1, 0.5),
        (torch.normal(mean, std), 5, 0.5),
        (torch.normal(-1.0, 3.0, (N,), device="tpu"), -1, 3),
    ]:
        assert t.device.type == "tpu" and t.shape == (N,) and t.dtype == torch.float32
        c = _cpu(t)
        assert abs(c.mean() - m) < 0.1 * max(s, 1) and abs(c.std() - s) < 0.1 * max(s, 1)
    b = torch.normal(torch.zeros(3, 1, device="tpu"), torch.ones(1, 4, device="tpu"))
    assert b.shape == (3, 4)
    out = torch.empty(0, device="tpu")
    assert torch.normal(mean, std, out=out) is out and out.shape == (N,)
    assert torch.normal(mean.double(), 1.0).dtype == torch.float64
    with pytest.raises(RuntimeError, match="std >= 0.0"):
        torch.normal(mean, -1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bool])
def test_bernoulli(dtype):
    t = torch.empty(N, dtype=dtype, device="tpu").bernoulli_(0.3)
    assert t.dtype == dtype
    c = _cpu(t)
    assert set(c.unique().tolist()) <= {0.0, 1.0} and abs(c.mean() - 0.3) < 0.05
    p = torch.linspace(0, 1, N, device="tpu")
    t = torch.empty(N, dtype=dtype, device="tpu").bernoulli_(p)
    c = _cpu(t)
    assert c[0] == 0 and c[-1] == 1 and abs(c.mean() - 0.5) < 0.05
    assert abs(c[: N // 2].mean() - 0.25) < 0.05


def test_bernoulli_functional():
    p = torch.full((N,), 0.8, device="tpu")
    t = torch.bernoulli(p)
    assert t.dtype == torch.float32 and abs(_cpu(t).mean() - 0.8) < 0.05
    t = torch.bernoulli(torch.ones(N, device="tpu"), 0.1)
    assert abs(_cpu(t).mean() - 0.1) < 0.05
    assert torch.bernoulli(torch.zeros(4, device="tpu")).sum().item() == 0
    with pytest.raises(RuntimeError, match="bernoulli_ expects p to be in"):
        torch.empty(3, device="tpu").bernoulli_(1.5)
    # A probability tensor is checked on the device: raised at the next sync, with the
    # value; NaN is outside [0, 1] too, as in torch.
    for bad in (2.0, -0.5, float("nan")):
        out = torch.bernoulli(torch.tensor([0.5, bad], device="tpu"))
        with pytest.raises(RuntimeError, match=rf"aten::bernoulli.*got {bad}"):
            out.cpu()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bfloat16])
def test_random_(dtype):
    t = torch.empty(N, dtype=dtype, device="tpu").random_(3, 10)
    assert t.dtype == dtype
    c = _cpu(t)
    assert set(c.unique().tolist()) == set(range(3, 10))
    c = _cpu(torch.empty(N, dtype=dtype, device="tpu").random_(5))
    assert set(c.unique().tolist()) == set(range(5))
    c = _cpu(torch.empty(N, dtype=dtype, device="tpu").random_())
    hi = (
        2**24
        if dtype == torch.float32
        else 2**8
        if dtype == torch.bfloat16
        else (torch.iinfo(dtype).max)
    )
    assert c.min() >= 0 and c.max() <= hi and c.max() > hi / 2
    with pytest.raises(RuntimeError, match="random_ expects 'from' to be less than 'to'"):
        torch.empty(3, dtype=dtype, device="tpu").random_(5, 5)


def test_random_int64_wide_ranges():
    lo = 2**40
    c = torch.empty(N, dtype=torch.int64, device="tpu").random_(lo, lo + 4).cpu()
    assert set(c.unique().tolist()) == {lo, lo + 1, lo + 2, lo + 3}
    c = torch.empty(N, dtype=torch.int64, device="tpu").random_(-(2**63), None).cpu()
    assert c.min() < -(2**61) and c.max() > 2**61  # the full int64 range
    c = torch.randint(-(2**40), 2**40, (N,), device="tpu").cpu()
    assert c.dtype == torch.int64 and c.min() < -(2**38) and c.max() > 2**38
    b = torch.empty(N, dtype=torch.bool, device="tpu").random_().cpu()
    assert 0.4 < b.double().mean() < 0.6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_continuous_distributions(dtype):
    e = _cpu(torch.empty(N, dtype=dtype, device="tpu").exponential_(2.0))
    assert e.min() >= 0 and abs(e.mean() - 0.5) < 0.05
    g = _cpu(torch.empty(N, dtype=dtype, device="tpu").geometric_(0.25))
    assert g.min() >= 1 and (g == g.round()).all() and abs(g.mean() - 4) < 0.3
    c = _cpu(torch.empty(N, dtype=dtype, device="tpu").cauchy_(1.0, 2.0))
    assert abs(c.median() - 1) < 0.2  # the mean does not exist
    q = c.quantile(torch.tensor([0.25, 0.75], dtype=torch.float64))
    assert abs(q[0] + 1) < 0.3 and abs(q[1] - 3) < 0.3
    ln = _cpu(torch.empty(N, dtype=dtype, device="tpu").log_normal_(0.5, 0.25))
    assert ln.min() > 0 and abs(ln.log().mean() - 0.5) < 0.03 and abs(ln.log().std() - 0.25) < 0.03


def test_geometric_int_dtype():
    g = torch.empty(N, dtype=torch.int64, device="tpu").geometric_(0.5)
    assert g.dtype == torch.int64 and g.cpu().min() >= 1


def test_distribution_errors():
    t = torch.empty(3, device="tpu")
    with pytest.raises(RuntimeError, match="exponential_ expects lambda > 0.0"):
        t.exponential_(-1)
    with pytest.raises(RuntimeError, match="geometric_ expects p to be in"):
        t.geometric_(1.5)
    # Integer tensors: CPU's kernels refuse them (Note [Dtype inputs torch refuses]).
    for fill in (lambda t: t.normal_(), lambda t: t.uniform_()):
        with pytest.raises(NotImplementedError) as want:
            fill(torch.empty(3, dtype=torch.int64))
        with pytest.raises(NotImplementedError) as got:
            fill(torch.empty(3, dtype=torch.int64, device="tpu"))
        assert str(got.value).startswith(str(want.value))


def test_randperm():
    for n in (0, 1, 7, 1000):
        p = torch.randperm(n, device="tpu")
        assert p.dtype == torch.int64 and p.device.type == "tpu"
        assert sorted(p.cpu().tolist()) == list(range(n))
    assert torch.randperm(10, dtype=torch.int32, device="tpu").dtype == torch.int32
    assert torch.randperm(1000, device="tpu").cpu().tolist() != list(range(1000))
    out = torch.empty(0, dtype=torch.int64, device="tpu")
    assert torch.randperm(5, out=out) is out and out.shape == (5,)


@pytest.mark.parametrize("out_dtype", [torch.float64, torch.int32])
def test_multinomial_out_dtype_refused_before_the_weights(out_dtype):
    # CPU checks the out's dtype after the input's rank and dtype and before it reads a
    # weight: valid, invalid and uninitialised weights all get the same refusal.
    for weights in ([[1.0, 2.0]], [[0.0, 0.0]], [[-1.0, float("nan")]]):
        w = torch.tensor(weights, dtype=torch.float64)
        with pytest.raises(RuntimeError) as cpu:
            torch.multinomial(w, 2, out=torch.empty(1, 2, dtype=out_dtype))
        with pytest.raises(RuntimeError) as got:
            torch.multinomial(w.to("tpu"), 2, out=torch.empty(1, 2, dtype=out_dtype, device="tpu"))
        assert str(got.value).startswith(str(cpu.value)), (cpu.value, got.value)
    # The rank check still comes first, as on CPU (in the words of torch's meta function).
    with pytest.raises(RuntimeError, match="dimensions must be 1 or 2, but got 3"):
        torch.multinomial(
            torch.ones(1, 2, 3, device="tpu"), 2, out=torch.empty(2, dtype=out_dtype, device="tpu")
        )
    out = torch.empty(0, dtype=torch.long, device="tpu")
    assert torch.multinomial(torch.ones(1, 2, device="tpu"), 2, out=out) is out
    assert sorted(out.cpu().flatten().tolist()) == [0, 1]


def test_multinomial():
    w = torch.tensor([1.0, 0.0, 3.0, 6.0], device="tpu")
    s = torch.multinomial(w, N, replacement=True)
    assert s.dtype == torch.int64 and s.shape == (N,)
    counts = torch.bincount(s.cpu(), minlength=4).double() / N
    assert counts[1] == 0 and abs(counts[0] - 0.1) < 0.03 and abs(counts[3] - 0.6) < 0.03
    s = torch.multinomial(w, 3)
    assert sorted(s.cpu().tolist()) == [0, 2, 3]
    rows = torch.multinomial(torch.rand(5, 8, device="tpu") + 0.01, 8)
    assert rows.shape == (5, 8)
    assert all(sorted(r) == list(range(8)) for r in rows.cpu().tolist())
    # Without replacement the first draw is proportional to the weights.
    firsts = torch.multinomial(w.expand(N, 4).contiguous(), 1).cpu().flatten()
    assert abs((firsts == 3).double().mean() - 0.6) < 0.03
    with pytest.raises(RuntimeError, match="cannot sample n_sample > prob_dist"):
        torch.multinomial(w, 5)
    # CPU's category limit, raised at the op with CPU's text (and the op's name),
    # before any sampling.
    many = torch.ones(2**24 + 1)
    with pytest.raises(RuntimeError) as cpu:
        torch.multinomial(many, 3)
    with pytest.raises(RuntimeError) as got:
        torch.multinomial(many.to("tpu"), 3)
    assert str(got.value) == f"{cpu.value} (in aten::multinomial.default)"
    # With replacement and several samples the distribution checks are CUDA's device
    # asserts: raised at the next sync, naming the op and the bad value, or at the op in
    # immediate mode.
    bad = torch.multinomial(torch.tensor([1.0, -1.0], device="tpu"), 3, True)
    with pytest.raises(RuntimeError, match=r"element < 0 \(in aten::multinomial: got -1.0"):
        bad.cpu()
    torch.tpu.set_sync_checks(True)
    try:
        with pytest.raises(RuntimeError, match="sum of probabilities <= 0"):
            torch.multinomial(torch.zeros(2, 3, device="tpu"), 2, True)
    finally:
        torch.tpu.set_sync_checks(False)


_INF, _NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    "probs", [[1.0, -1.0], [1.0, _INF], [1.0, _NAN], [0.0, 0.0], [[1.0, 1.0], [0.0, 0.0]]]
)
@pytest.mark.parametrize("num_samples, replacement", [(1, False), (2, False), (1, True)])
def test_multinomial_checks_every_backend_reads_raise_at_the_op(probs, num_samples, replacement):
    # ATen's device-generic path reads these back at the op (Note [Device-side checks]):
    # raised there, with CPU's exception and text.
    with pytest.raises(RuntimeError) as cpu:
        torch.multinomial(torch.tensor(probs), num_samples, replacement)
    with pytest.raises(RuntimeError) as got:
        torch.multinomial(torch.tensor(probs, device="tpu"), num_samples, replacement)
    assert str(got.value) == str(cpu.value)


def test_multinomial_without_replacement_draws_zero_weights_last_as_cpu():
    # Fewer positive weights than samples is no error for torch: the zero-weight
    # categories come after the positive ones.
    w = torch.tensor([[0.0, 2.0, 0.0, 1.0]] * 4)
    cpu = torch.multinomial(w, 3)
    got = torch.multinomial(w.to("tpu"), 3).cpu()
    assert got.shape == cpu.shape == (4, 3)
    assert all(set(r[:2]) == {1, 3} and r[2] in (0, 2) for r in got.tolist())


def test_like_factories():
    x = torch.zeros(50, 40, dtype=torch.float64, device="tpu")
    for t in (torch.rand_like(x), torch.randn_like(x)):
        assert t.device.type == "tpu" and t.dtype == torch.float64 and t.shape == x.shape
    assert torch.rand_like(x, dtype=torch.float16).dtype == torch.float16
    r = torch.randint_like(x, 10).cpu()
    assert r.dtype == torch.float64 and set(r.unique().tolist()) == set(range(10))
    r = torch.randint_like(x.long(), 3, 6).cpu()
    assert r.dtype == torch.int64 and set(r.unique().tolist()) == {3, 4, 5}
    assert torch.randint(5, (3,), device="tpu", dtype=torch.int32).dtype == torch.int32
    assert torch.rand(0, device="tpu").shape == (0,)
    assert torch.randn((), device="tpu").shape == ()


# ---------------------------------------------------------------------------------------
# determinism and RNG state


def _draws():
    return [
        torch.rand(5, device="tpu").cpu(),
        torch.randn(5, device="tpu").cpu(),
        torch.randint(0, 100, (5,), device="tpu").cpu(),
        torch.randperm(8, device="tpu").cpu(),
        F.dropout(torch.ones(8, device="tpu"), 0.5).cpu(),
    ]


def test_manual_seed_reproduces():
    torch.manual_seed(1234)
    a = _draws()
    torch.manual_seed(1234)
    b = _draws()
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    torch.manual_seed(1235)
    assert not torch.equal(torch.rand(5, device="tpu").cpu(), a[0])


def test_successive_draws_differ():
    torch.manual_seed(0)
    a, b = torch.rand(100, device="tpu").cpu(), torch.rand(100, device="tpu").cpu()
    assert not torch.equal(a, b)
    x = torch.empty(100, device="tpu")
    first = x.normal_().cpu()
    assert not torch.equal(first, x.normal_().cpu())


def test_get_set_rng_state_replays():
    torch.manual_seed(7)
    torch.rand(3, device="tpu")
    state = torch.tpu.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    a = _draws()
    torch.tpu.set_rng_state(state)
    b = _draws()
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_fork_rng_restores_state():
    torch.manual_seed(3)
    before = torch.tpu.get_rng_state()
    with torch.random.fork_rng(device_type="tpu"):
        torch.rand(10, device="tpu")
        torch.manual_seed(99)
        torch.randn(10, device="tpu")
    assert torch.equal(torch.tpu.get_rng_state(), before)
    a = torch.rand(4, device="tpu").cpu()
    torch.manual_seed(3)
    assert torch.equal(torch.rand(4, device="tpu").cpu(), a)


# Note [CPU generators on tpu]: a CPU generator's draw on tpu is the CPU draw.
_GENERATOR_DRAWS = {
    "randn": lambda d, g: torch.randn(2, 3, device=d, generator=g),
    "rand_bf16": lambda d, g: torch.rand(4, device=d, generator=g, dtype=torch.bfloat16),
    "randint": lambda d, g: torch.randint(3, 10, (5,), device=d, generator=g),
    "randperm": lambda d, g: torch.randperm(7, device=d, generator=g),
    "normal_": lambda d, g: torch.empty(3, device=d).normal_(2.0, 0.5, generator=g),
    "normal.Tensor_float": lambda d, g: torch.normal(torch.zeros(3, device=d), 2.0, generator=g),
    "bernoulli": lambda d, g: torch.bernoulli(torch.full((6,), 0.5, device=d), generator=g),
    "bernoulli_.float": lambda d, g: torch.empty(6, device=d).bernoulli_(0.3, generator=g),
    "multinomial": lambda d, g: torch.multinomial(torch.ones(2, 5, device=d), 3, generator=g),
    "rand_like": lambda d, g: torch.rand_like(torch.ones(3, device=d), generator=g),
    "randint_like": lambda d, g: torch.randint_like(torch.ones(3, device=d), 9, generator=g),
    "exponential_": lambda d, g: torch.empty(3, device=d).exponential_(generator=g),
    "cauchy_": lambda d, g: torch.empty(3, device=d).cauchy_(generator=g),
    "log_normal_": lambda d, g: torch.empty(3, device=d).log_normal_(generator=g),
    "geometric_": lambda d, g: torch.empty(3, device=d).geometric_(0.4, generator=g),
    "random_": lambda d, g: torch.empty(3, dtype=torch.int32, device=d).random_(generator=g),
    "uniform_ of a view": lambda d, g: torch.zeros(3, 4, device=d)[:, 1].uniform_(generator=g),
}


@pytest.mark.parametrize("name", sorted(_GENERATOR_DRAWS))
def test_cpu_generator_draws_what_cpu_draws(name):
    draw = _GENERATOR_DRAWS[name]
    g_cpu, g_tpu = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    for _ in range(2):  # the generator advances as on CPU
        want, got = draw("cpu", g_cpu), draw("tpu", g_tpu)
        assert got.device.type == "tpu" and got.dtype == want.dtype
        assert torch.equal(got.cpu(), want)
    assert torch.equal(g_tpu.get_state(), g_cpu.get_state())


def test_cpu_generator_under_jit_raises():
    g = torch.Generator().manual_seed(0)

    @torchjax.jit
    def noisy(x):
        return x + torch.randn(x.shape, device=x.device, generator=g)

    with pytest.raises(RuntimeError, match=r"aten::normal_: generator= cannot drive.*jit"):
        noisy(torch.ones(3, device="tpu"))


def test_tpu_generator_cannot_be_created():
    # torch raises from C++ (no getNewGenerator for a Python backend) before torchjax
    # runs; the README names the alternative, a CPU generator.
    with pytest.raises(NotImplementedError, match="getNewGenerator"):
        torch.Generator(device="tpu")


def test_out_variants_and_views():
    out = torch.empty(0, device="tpu")
    assert torch.rand(3, 2, out=out) is out and out.shape == (3, 2)
    out = torch.empty(0, dtype=torch.int64, device="tpu")
    torch.randint(2**40, 2**40 + 3, (100,), out=out)
    assert out.shape == (100,) and set(out.cpu().unique().tolist()) <= {2**40, 2**40 + 1, 2**40 + 2}
    out = torch.empty(0, dtype=torch.int64, device="tpu")
    torch.randint(4, (50,), out=out)
    assert set(out.cpu().unique().tolist()) <= set(range(4))
    out = torch.empty(0, device="tpu")
    torch.bernoulli(torch.full((10,), 0.5, device="tpu"), out=out)
    assert out.shape == (10,)
    x = torch.zeros(3, 4, device="tpu")
    x[1].normal_()
    x[:, 0].uniform_(5, 6)
    c = x.cpu()
    assert (c[[0, 2], 1:] == 0).all() and (c[1, 1:] != 0).all()
    assert (c[:, 0] >= 5).all() and (c[:, 0] <= 6).all()


def test_normal_out_without_a_generator():
    # torch's meta kernel for aten::normal.out refuses every call; CPU accepts them.
    out = torch.empty(0, device="tpu")
    self = torch.zeros(200, 50, device="tpu").t()
    assert torch.ops.aten.normal.out(self, 2.0, 0.5, out=out) is out
    c = _cpu(out)
    assert out.shape == (50, 200) and abs(c.mean() - 2) < 0.05 and abs(c.std() - 0.5) < 0.05


# ---------------------------------------------------------------------------------------
# Note [Random draws in size buckets]: same values as a draw at the exact shape

_DRAWS = {
    "uniform_": lambda x: x.uniform_(-2, 3),
    "uniform": lambda x: torch.ops.aten.uniform(x, -1.0, 2.0),
    "normal_": lambda x: x.normal_(1.5, 2.0),
    "normal_functional": lambda x: torch.ops.aten.normal_functional(x, 0.5, 3.0),
    "bernoulli_": lambda x: x.bernoulli_(0.3),
    "bernoulli.p": lambda x: torch.ops.aten.bernoulli.p(x, 0.7),
    "random_": lambda x: x.random_(),
    "random_.from": lambda x: x.random_(-3, 1000),
    "random_.to": lambda x: x.random_(7),
    "random.from": lambda x: (
        torch.ops.aten.random.from_(x, 2, 90)
        if hasattr(torch.ops.aten.random, "from_")
        else getattr(torch.ops.aten.random, "from")(x, 2, 90)
    ),
    "exponential_": lambda x: x.exponential_(2.0),
    "geometric_": lambda x: x.geometric_(0.2),
    "cauchy_": lambda x: x.cauchy_(0.5, 2.0),
    "log_normal_": lambda x: x.log_normal_(0.1, 0.5),
}
_INTEGER_DRAWS = {"random_", "random_.from", "random_.to", "random.from", "bernoulli_"}


# Integer tensors only for the samplers that take them (CPU refuses the others).
_DRAW_CASES = [
    (op, dtype)
    for op in _DRAWS
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64)
    if dtype != torch.int64 or op in _INTEGER_DRAWS
]


@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 3, 5), (1,), (300,)], ids=str)
@pytest.mark.parametrize("op,dtype", _DRAW_CASES)
def test_bucketed_draws_equal_draws_at_the_exact_shape(op, dtype, shape, monkeypatch):
    from torchjax.ops import _seeded

    assert _seeded.bucket(torch.ops.aten.uniform_.default, shape) is not None or shape == (1,)

    def draw():
        torch.manual_seed(7)
        x = torch.zeros(shape, dtype=dtype, device="tpu")
        out = _DRAWS[op](x)
        return out.cpu(), x.cpu(), torch.rand(3, device="tpu").cpu()  # the state after

    bucketed = draw()
    monkeypatch.setattr(_seeded, "BUCKET_LIMIT", 0)
    exact = draw()
    for got, want in zip(bucketed, exact):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_complex_draws_are_bucketed_with_the_same_values(monkeypatch):
    from torchjax.ops import _seeded

    def draw():
        torch.manual_seed(3)
        return torch.randn(3, 5, dtype=torch.complex64, device="tpu").cpu()

    bucketed = draw()
    monkeypatch.setattr(_seeded, "BUCKET_LIMIT", 0)
    torch.testing.assert_close(bucketed, draw(), rtol=0, atol=0)


def test_draws_at_many_sizes_compile_one_sampler_per_bucket():
    from torchjax.ops import cached_compute

    torch.manual_seed(0)  # every size below lands in the 64 bucket
    info = cached_compute.cache_info(torch.ops.aten.uniform_.default)
    torch.empty(33, device="tpu").uniform_(-1, 1)
    before = info.traces
    for n in range(34, 65):
        t = torch.empty(n, device="tpu").uniform_(-1, 1)
        assert t.shape == (n,) and -1 <= t.cpu().min() and t.cpu().max() <= 1
    assert before > 0 and info.traces == before  # 31 sizes, no new sampler program


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_draws_stay_below_their_upper_bound(dtype):
    # Drawn in float32 and rounded to nearest, one bfloat16 draw in about 500 was the
    # excluded bound itself (CPU never gives it): rand == 1.0, uniform_(-2, 3) == 3,
    # randint(0, 5000) == 5000 in float16, exponential_ == inf.
    n = 1 << 20
    torch.manual_seed(0)
    assert torch.rand(n, dtype=dtype, device="tpu").max().item() < 1
    u = torch.empty(n, dtype=dtype, device="tpu").uniform_(-2, 3).cpu()
    assert u.max().item() < 3 and u.min().item() >= -2
    r = torch.randint(0, 5000, (n,), dtype=dtype, device="tpu").cpu()
    assert r.max().item() < 5000 and r.min().item() >= 0
    assert torch.isfinite(torch.empty(n, dtype=dtype, device="tpu").exponential_().cpu()).all()
    small = torch.rand(n, dtype=dtype, device="tpu").cpu()
    assert (small == 0).sum().item() < 16 and small.unique().numel() > 256  # not a coarse grid


# Arguments CPU refuses before drawing: the same exception and text on tpu.
_REFUSED_DRAWS = {
    "randperm int8 past 127": lambda d: torch.randperm(129, dtype=torch.int8, device=d),
    "randperm int8 at 127": lambda d: torch.randperm(128, dtype=torch.int8, device=d),
    "randperm uint8 past 255": lambda d: torch.randperm(257, dtype=torch.uint8, device=d),
    "randperm float16 past 2049": lambda d: torch.randperm(2050, dtype=torch.float16, device=d),
    "randperm bool": lambda d: torch.randperm(3, dtype=torch.bool, device=d),
    "normal negative std tensor": lambda d: torch.normal(
        torch.zeros(4, device=d), torch.full((4,), -1.0, device=d)
    ).cpu(),
    "normal nan std tensor": lambda d: torch.normal(
        torch.zeros(4, device=d), torch.full((4,), float("nan"), device=d)
    ).cpu(),
    "normal_ nan std": lambda d: torch.zeros(4, device=d).normal_(0, float("nan")).cpu(),
    "uniform_ to inf": lambda d: torch.zeros(4, device=d).uniform_(0, float("inf")),
    "uniform_ from -inf float64": lambda d: torch.zeros(4, dtype=torch.float64, device=d).uniform_(
        float("-inf"), 0
    ),
    "uniform_ float16 span past max": lambda d: torch.zeros(
        4, dtype=torch.float16, device=d
    ).uniform_(-6e4, 6e4),
    "uniform_ float32 span past max": lambda d: torch.zeros(4, device=d).uniform_(-1e38, 3e38),
    "uniform_ complex64 to inf": lambda d: torch.zeros(4, dtype=torch.complex64, device=d).uniform_(
        0, float("inf")
    ),
    "bernoulli_ int64 p": lambda d: torch.empty(4, device=d).bernoulli_(
        torch.tensor([0, 1, 1, 0], device=d)
    ),
    "bernoulli_ bool p": lambda d: torch.empty(4, device=d).bernoulli_(
        torch.tensor([False, True, True, False], device=d)
    ),
}


@pytest.mark.parametrize("case", list(_REFUSED_DRAWS))
def test_draw_arguments_cpu_refuses_are_refused_with_its_text(case):
    def outcome(device):
        try:
            out = _REFUSED_DRAWS[case](device)
        except (RuntimeError, NotImplementedError) as e:
            return type(e), str(e)
        return None, (out.shape, out.dtype)

    want, got = outcome("cpu"), outcome("tpu")
    assert got[0] is want[0], (got, want)
    assert got[1] == want[1] if want[0] is None else got[1].startswith(want[1]), (got, want)


def test_bfloat16_uniform_stays_inside_bounds_it_cannot_hold():
    # -6e4 lies between two bfloat16 values: rounding down went below it.
    torch.manual_seed(0)
    x = torch.zeros(1 << 20, dtype=torch.bfloat16, device="tpu").uniform_(-6e4, 6e4)
    x = x.cpu().double()
    assert x.min().item() >= -6e4 and x.max().item() < 6e4
