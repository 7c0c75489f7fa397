"""How a fused segment's program runs (torchjax/ops/fused_run.py): dead inputs donated,
a program that does not fit run op by op, a failed segment's values refused, not stale."""

import warnings

import jax
import pytest
import torch

import torchjax
from tests._models import tiny_llama
from torchjax.ops import executables, fused_run

TPU = "tpu"


@pytest.fixture(autouse=True)
def _fresh_executables():
    executables.clear_caches()


def _stat(name):
    return torchjax.stats()[name]


def _step(x, w):
    x.mul_(w).add_(1.5)  # the old value of x is dead once the segment runs
    return x


def test_an_overwritten_input_nothing_else_holds_is_donated():
    w = torch.full((64,), 1.25).to(TPU)
    expect = _step(torch.arange(64.0).to(TPU), w).cpu()
    x = torch.arange(64.0).to(TPU)
    before = _stat("fused_donations")
    with torchjax.fused():
        _step(x, w)
    torch.testing.assert_close(x.cpu(), expect, rtol=0, atol=0)
    assert _stat("fused_donations") - before == 1
    assert not w._storage.arr.is_deleted()  # read, not written: kept


@pytest.mark.parametrize("holder", ["clone", "to_jax"])
def test_an_input_held_elsewhere_is_not_donated_and_keeps_its_values(holder):
    w = torch.full((64,), 1.25).to(TPU)
    x = torch.arange(64.0).to(TPU)
    if holder == "clone":
        kept = x.clone()  # shares x's array (jax arrays are immutable)
        assert kept._storage.arr is x._storage.arr
        read = kept.cpu
    else:
        kept = torchjax.to_jax(x)
        read = lambda: torch.from_numpy(jax.device_get(kept).copy())  # noqa: E731
    before = _stat("fused_donations")
    with torchjax.fused():
        _step(x, w)
    x.cpu()
    assert _stat("fused_donations") - before == 0
    torch.testing.assert_close(read(), torch.arange(64.0), rtol=0, atol=0)
    torch.testing.assert_close(x.cpu(), torch.arange(64.0) * 1.25 + 1.5, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_adamw_step_donates_its_state_and_equals_eager(dtype):
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (1, 16)).to(TPU)

    def train(fused):
        torch.manual_seed(0)
        m = tiny_llama().to(TPU).to(dtype)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        n = len(list(m.parameters()))
        before = _stat("fused_donations")
        for _ in range(3):
            with torchjax.fused(fused, capture=False):
                m(ids, labels=ids, use_cache=False).loss.backward()
                opt.step()
                opt.zero_grad()
            torch.tpu.synchronize()
        return [p.detach().cpu() for p in m.parameters()], _stat("fused_donations") - before, n

    eager, _, _ = train(False)
    fused, donations, n = train(True)
    for a, b in zip(eager, fused):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    # The parameters and both moments, each step: written in place, dead after.
    assert donations >= 3 * 3 * n


def _failing_program(message, calls):
    real = fused_run.build

    def build(nodes, live, donated=()):
        program = real(nodes, live, donated)

        def failing(*args):
            calls.append(len(nodes))
            raise jax.errors.JaxRuntimeError(message)

        failing.lower = program.lower
        return failing

    return build


def test_a_segment_out_of_device_memory_runs_op_by_op_once_warned(monkeypatch):
    calls = []
    monkeypatch.setattr(
        fused_run, "build", _failing_program("RESOURCE_EXHAUSTED: Ran out of memory", calls)
    )
    w = torch.full((64,), 1.25).to(TPU)
    expect = [_step(torch.arange(64.0).to(TPU) + i, w).cpu() for i in range(2)]
    before = _stat("fused_op_by_op")
    outs = []
    with pytest.warns(ResourceWarning, match="does not fit in device memory"):
        for i in range(2):
            x = torch.arange(64.0).to(TPU) + i
            with torchjax.fused():
                _step(x, w)
            outs.append(x.cpu())
    for a, b in zip(expect, outs):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert _stat("fused_op_by_op") - before == 2
    assert calls == [2]  # the second time: op by op at once, the program not tried


def test_a_failed_segment_raises_and_its_values_are_refused_not_stale(monkeypatch):
    calls = []
    monkeypatch.setattr(fused_run, "build", _failing_program("INTERNAL: device failure", calls))
    w = torch.full((64,), 1.25).to(TPU)
    x = torch.arange(64.0).to(TPU)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: device failure"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)  # not taken for op by op
            with torchjax.fused():
                _step(x, w)
    assert calls == [2]
    with pytest.raises(RuntimeError, match="never computed.*INTERNAL: device failure"):
        x.cpu()
    # w was only read: its value is intact.
    torch.testing.assert_close(w.cpu(), torch.full((64,), 1.25), rtol=0, atol=0)


def _recorded_programs(monkeypatch):
    """The segment programs built from now on, each with the arguments of its calls."""
    seen = []
    real = fused_run.build

    def build(nodes, live, donated=()):
        program = real(nodes, live, donated)

        def run(*args):
            seen.append((program, args, donated))
            return program(*args)

        return run

    monkeypatch.setattr(fused_run, "build", build)
    return seen


def test_each_donated_input_aliases_its_own_new_value(monkeypatch):
    # ``a`` is read before ``b``, and b's new value is made before a's. jax gives each
    # output the first donated input of its shape and dtype left, so outputs in the
    # order made would alias a's buffer with b's new value, and XLA would copy whole
    # tensors to keep the old values it still reads.
    seen = _recorded_programs(monkeypatch)
    n = 1 << 16
    a, b = torch.arange(float(n)).to(TPU), torch.ones(n).to(TPU)
    want_a, want_b = torch.arange(float(n)) * 2 + 1, torch.ones(n) + 2
    with torchjax.fused():  # adds only: no output leaves through a fusion cut
        m = a + b
        b.add_(2)
        a.add_(m)
        del m
    torch.tpu.synchronize()
    torch.testing.assert_close(a.cpu(), want_a, rtol=0, atol=0)
    torch.testing.assert_close(b.cpu(), want_b, rtol=0, atol=0)
    ((program, args, donated),) = seen
    assert len(donated) == 2
    memory = program.lower(*args).compile().memory_analysis()
    assert memory.alias_size_in_bytes == 2 * 4 * n
    assert memory.temp_size_in_bytes <= 4 * n  # at most one tensor copied (b, read twice)


def _adamw_steps(params, fused, capture, steps=4):
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    for step in range(steps):
        torch.manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, dtype=p.dtype).to(TPU)
        with torchjax.fused(fused, capture=capture):
            opt.step()
        torch.tpu.synchronize()
    return [p.detach().cpu() for p in params]


def test_a_fused_adamw_step_updates_its_lists_in_place(monkeypatch):
    # Each moment and parameter aliases its own new value, and lerp's and addcmul's
    # nodes fuse (Note [Platform branches fuse]): beside its arguments the program
    # holds the denominators (sqrt's list and the division's, isolated), no more.
    seen = _recorded_programs(monkeypatch)
    n, size = 6, 1 << 14

    def params():
        torch.manual_seed(0)
        return [
            torch.nn.Parameter(torch.randn(size, dtype=torch.bfloat16).to(TPU)) for _ in range(n)
        ]

    want = _adamw_steps(params(), False, False)
    got = _adamw_steps(params(), True, False)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert seen
    lists = n * size * 2
    for program, args, donated in seen:
        assert donated
        memory = program.lower(*args).compile().memory_analysis()
        assert memory.alias_size_in_bytes == 3 * lists  # parameters, both moments
        assert memory.temp_size_in_bytes <= 2 * lists + 4096
