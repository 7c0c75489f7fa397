"""torchjax.jit(...).repeat: a step that works in place, run many times as one program
(torchjax/compile/_repeat.py)."""

import pytest
import torch

import torchjax


def test_repeat_carries_argument_and_state_writes():
    acc = torch.zeros(3, device="tpu")  # state found in the closure

    @torchjax.jit
    def step(x, n):
        x.mul_(2)
        acc.add_(x)
        n.add_(1)

    x, n = torch.ones(3, device="tpu"), torch.zeros((), dtype=torch.long, device="tpu")
    step.repeat(5, x, n)
    assert torch.equal(x.cpu(), torch.full((3,), 32.0))
    assert int(n) == 5
    assert torch.equal(acc.cpu(), torch.full((3,), 2.0 + 4 + 8 + 16 + 32))
    assert step.trace_count == 1
    step.repeat(2, x, n)  # the same signature: no new trace
    assert int(n) == 7 and step.trace_count == 1


def test_trace_runs_the_python_code_but_not_the_program():
    seen = []

    @torchjax.jit
    def step(x, n):
        seen.append(tuple(x.shape))  # Python runs at trace time only
        x.mul_(2)
        n.add_(1)

    x, n = torch.ones(3, device="tpu"), torch.zeros((), dtype=torch.long, device="tpu")
    torchjax.reset_stats()
    step.trace(x, n)
    # Traced, not run: the arguments are untouched and no program was compiled.
    assert seen == [(3,)] and step.trace_count == 1 and step.cache_hits == 0
    assert torch.equal(x.cpu(), torch.ones(3)) and int(n) == 0
    assert torchjax.stats()["compiles"] == 0
    step.trace(x, n)  # already traced: nothing happens
    assert seen == [(3,)] and step.trace_count == 1
    step.repeat(3, x, n)  # the loop is the only program compiled
    assert torch.equal(x.cpu(), torch.full((3,), 8.0)) and int(n) == 3
    assert seen == [(3,)] and step.trace_count == 1


def test_repeat_when_asks_after_the_trace_and_looks_the_call_up_once(monkeypatch):
    from torchjax.compile import _jit

    seen = []

    @torchjax.jit
    def step(x, n):
        seen.append(tuple(x.shape))
        x.mul_(2)
        n.add_(1)

    lookups = []
    lookup = _jit.Jitted._lookup
    monkeypatch.setattr(
        _jit.Jitted, "_lookup", lambda self, a, k: lookups.append(1) or lookup(self, a, k)
    )
    x, n = torch.ones(3, device="tpu"), torch.zeros((), dtype=torch.long, device="tpu")
    # A new signature: traced (Python ran) but, refused, not run.
    assert not step.repeat(3, x, n, when=lambda: len(seen) == 2)
    assert seen == [(3,)] and int(n) == 0 and torch.equal(x.cpu(), torch.ones(3))
    # Traced before: asked at once, then run; one lookup of the call.
    lookups.clear()
    assert step.repeat(3, x, n, when=lambda: seen == [(3,)])
    assert len(lookups) == 1 and int(n) == 3 and torch.equal(x.cpu(), torch.full((3,), 8.0))
    assert step.trace_count == 1 and seen == [(3,)]
    y = torch.ones(2, device="tpu")  # a new signature, accepted: traced once, then run
    assert step.repeat(2, y, n, when=lambda: True)
    assert seen == [(3,), (2,)] and step.trace_count == 2 and int(n) == 5
    assert torch.equal(y.cpu(), torch.full((2,), 4.0))


def test_repeat_stops_when_until_is_set():
    @torchjax.jit
    def step(x, stop):
        x.add_(1)
        stop.copy_(x.sum() >= 3)

    x = torch.zeros(1, device="tpu")
    stop = torch.zeros((), dtype=torch.bool, device="tpu")
    step.repeat(10, x, stop, until=stop)
    assert float(x) == 3.0 and bool(stop)
    step.repeat(10, x, stop, until=stop)  # already set: no iteration
    assert float(x) == 3.0
    with pytest.raises(ValueError, match="until= must be a 0-d tensor passed as an argument"):
        step.repeat(10, x, stop, until=torch.zeros((), device="tpu"))


def test_repeat_draws_new_random_values_each_iteration_and_replays_under_seed():
    @torchjax.jit
    def step(buf, i):
        buf.index_copy_(0, i.reshape(1), torch.rand(1, device="tpu"))
        i.add_(1)

    def draw():
        buf = torch.zeros(6, device="tpu")
        step.repeat(6, buf, torch.zeros((), dtype=torch.long, device="tpu"))
        return buf.cpu()

    torch.manual_seed(0)
    first = draw()
    assert len(set(first.tolist())) == 6 and bool(((first > 0) & (first < 1)).all())
    torch.manual_seed(0)
    assert torch.equal(draw(), first)
    assert not torch.equal(draw(), first)


def test_programs_are_named_after_the_traced_function():
    """jax names a program, its compile events and a profile's rows after the function it
    jits: a torchjax.jit program carries the traced function's name, not one shared name."""
    import jax

    compiled = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:

        @torchjax.jit
        def scale_step(x):
            x.mul_(3)

        lin = torch.nn.Linear(4, 4).to("tpu")
        x = torch.ones(2, 4, device="tpu")
        scale_step(x)
        scale_step.repeat(2, x)
        torchjax.jit(lin)(x).sum().backward()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    step = "test_programs_are_named_after_the_traced_function.<locals>.scale_step"
    assert f"jit({step})" in compiled and f"jit({step}_repeated)" in compiled, compiled
    assert "jit(Linear)" in compiled and "jit(Linear_backward)" in compiled, compiled
    assert "jit(jaxpr_as_fun)" not in compiled


def _start(buf, i, stop, seed, noise):
    """A first call: the state ``_count`` carries, written in place (and ``noise``, which
    the step only reads: the seed, plus a draw times zero)."""
    buf.fill_(0)
    buf[0] = seed.sum()
    i.fill_(1)
    stop.zero_()
    noise.copy_(seed + torch.rand(2, device="tpu") * 0)


def _count(buf, i, stop, noise):
    buf.index_copy_(0, i.reshape(1), buf.gather(0, (i - 1).reshape(1)) + 1 + noise[:1])
    i.add_(1)
    stop.copy_(i >= 4)


def _tensors(n=6):
    return (
        torch.full((n,), -1.0, device="tpu"),
        torch.zeros((), dtype=torch.long, device="tpu"),
        torch.zeros((), dtype=torch.bool, device="tpu"),
    )


def test_a_first_call_runs_in_the_loops_program(monkeypatch):
    """Note [A first call in the loop's program]: ``repeat(..., first=...)`` makes the call
    once before the loop, inside the loop's program once both are traced (no program call
    of its own), with what the two calls made one after the other give: values, the RNG
    draws and the state the RNG is left in, the first call counted as a cache hit."""
    from torchjax.compile import _entry, _repeat

    start, step = torchjax.jit(_start), torchjax.jit(_count)
    seed = torch.tensor([2.0, 3.0], device="tpu")

    def run(fused):
        buf, i, stop = _tensors()
        noise = torch.zeros(2, device="tpu")
        if fused:
            ran = step.repeat(
                8, buf, i, stop, noise, until=stop, first=(start, (buf, i, stop, seed, noise), {})
            )
        else:
            start(buf, i, stop, seed, noise)
            ran = step.repeat(8, buf, i, stop, noise, until=stop)
        assert ran
        return buf.cpu(), int(i), bool(stop), noise.cpu(), torch.tpu.get_rng_state()

    torch.manual_seed(0)
    apart = run(fused=False)
    assert apart[0].tolist() == [5, 8, 11, 14, 0, 0] and apart[1:3] == (4, True)
    calls, alone = [], []
    monkeypatch.setattr(
        _entry.Entry, "run", lambda self, c, run=_entry.Entry.run: calls.append(1) or run(self, c)
    )
    monkeypatch.setattr(
        _repeat.First,
        "run_alone",
        lambda self, r=_repeat.First.run_alone: alone.append(1) or r(self),
    )
    checked = 0
    for _ in range(2):
        hits = start.cache_hits
        torch.manual_seed(0)
        fused = run(fused=True)
        for a, b in zip(fused, apart, strict=True):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        assert start.cache_hits == hits + 1 and start.trace_count == 1 and step.trace_count == 1
        checked += 1
    assert checked == 2 and calls == [] and alone == []


def test_a_first_call_runs_on_its_own_where_it_cannot_join(monkeypatch):
    """The first call runs as a call of its own, before the loop, where it writes state, or
    writes memory that the step takes as another tensor, or the step is not traced yet,
    or ``when`` turns the loop down (then it runs and the loop does not); the values are
    those of the two calls made one after the other."""
    from torchjax.compile import _repeat

    alone = []
    monkeypatch.setattr(
        _repeat.First,
        "run_alone",
        lambda self, r=_repeat.First.run_alone: alone.append(1) or r(self),
    )
    seed = torch.tensor([2.0, 3.0], device="tpu")
    kept = torch.zeros(2, device="tpu")

    def writes_state(buf, i, stop, seed, noise):
        _start(buf, i, stop, seed, noise)
        kept.add_(1)

    def writes_a_view(buf, i, stop, seed, noise):
        _start(buf, i, stop, seed, noise)

    checked = 0
    for name, first_fn in (("state", writes_state), ("view", writes_a_view), ("new", _start)):
        start, step = torchjax.jit(first_fn), torchjax.jit(_count)
        for n in range(2 if name != "new" else 1):  # traced, then warm (the new one: cold)
            buf, i, stop = _tensors()
            noise = torch.zeros(2, device="tpu")
            step_noise = noise[1:] if name == "view" else noise  # a view of its memory
            alone.clear()
            ran = step.repeat(
                8,
                buf,
                i,
                stop,
                step_noise,
                until=stop,
                first=(start, (buf, i, stop, seed, noise), {}),
            )
            assert ran and alone == [1], (name, n)
            want = [5, 9, 13, 17] if name == "view" else [5, 8, 11, 14]  # noise[1] or [0]
            assert buf.cpu().tolist() == [*want, 0, 0] and int(i) == 4
        checked += 1
    assert checked == 3 and kept.cpu().tolist() == [2.0, 2.0]
    # when= turns the loop down: the first call is made all the same, the loop is not.
    start, step = torchjax.jit(_start), torchjax.jit(_count)
    buf, i, stop = _tensors()
    noise = torch.zeros(2, device="tpu")
    args = (buf, i, stop, noise)
    step.repeat(8, *args, until=stop, first=(start, (buf, i, stop, seed, noise), {}))  # traced
    alone.clear()
    buf.fill_(-1)
    assert not step.repeat(
        8, *args, until=stop, when=lambda: False, first=(start, (buf, i, stop, seed, noise), {})
    )
    assert alone == [1] and buf.cpu().tolist() == [5, 0, 0, 0, 0, 0] and int(i) == 1
