"""Device-side value checks (torchjax/device/_checks.py) and the eager engine counters
(torchjax.stats()): raised at the next sync, or at the op in immediate mode; no host
reads on op paths."""

import os
import subprocess
import sys
import textwrap
import threading

import jax
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchjax
from tests._models import tiny_llama
from torchjax.device import _checks

TPU = "tpu"


@pytest.mark.parametrize(
    "sync",
    [
        lambda t: t.item(),
        lambda t: t.cpu(),
        lambda t: repr(t),
        lambda t: t.tolist(),
        lambda t: torch.tpu.synchronize(),
    ],
    ids=["item", "cpu", "repr", "tolist", "synchronize"],
)
def test_out_of_range_raises_at_each_sync_point(sync):
    w = torch.randn(5, 3, device=TPU)
    out = torch.index_select(w, 0, torch.tensor([1, 7], device=TPU))  # no raise, no read
    assert _checks.pending() >= 1
    with pytest.raises(IndexError, match=r"index 7 is out of bounds for dimension 0 with size 5"):
        sync(out.sum())
    assert _checks.pending() == 0
    sync(out.sum())  # reported once


def test_first_failure_in_program_order_after_folding():
    # More checks than the fold threshold: folded on the device, order kept.
    w = torch.randn(5, 3, device=TPU)
    good = torch.tensor([0, 4], device=TPU)
    for _ in range(_checks._FOLD_AT + 3):
        torch.index_select(w, 0, good)
    torch.index_select(w, 0, torch.tensor([-9], device=TPU))
    x = torch.gather(w, 0, torch.tensor([[7, 0, 0]], device=TPU))
    for _ in range(_checks._FOLD_AT):
        torch.index_select(w, 0, good)
    assert _checks.pending() < _checks._FOLD_AT + 2
    with pytest.raises(IndexError, match="index -9 is out of bounds"):
        x.cpu()


def test_immediate_mode_raises_at_the_op():
    torch.tpu.set_sync_checks(True)
    try:
        w = torch.randn(5, 3, device=TPU)
        with pytest.raises(RuntimeError, match="index 7 is out of bounds.*aten::gather"):
            torch.gather(w, 0, torch.tensor([[7, 0, 0]], device=TPU))
        torch.gather(w, 0, torch.tensor([[4, 0, 0]], device=TPU))  # valid: no raise
    finally:
        torch.tpu.set_sync_checks(False)


def test_a_check_made_at_the_op_raises_there_after_earlier_ones():
    # Integer division by a zero tensor raises at the op, as on CPU (CUDA defers no such
    # check); the read it makes is a synchronisation point, so a failure queued before
    # it comes first, as a CUDA host read reports an earlier device assert.
    a = torch.tensor([4, 6], device=TPU)
    with pytest.raises(RuntimeError) as cpu:
        torch.remainder(a.cpu(), torch.tensor([1, 0]))
    with pytest.raises(RuntimeError) as got:
        torch.remainder(a, torch.tensor([1, 0], device=TPU))
    assert str(got.value) == str(cpu.value) == "ZeroDivisionError"
    assert _checks.pending() == 0
    torch.index_select(torch.randn(5, 3, device=TPU), 0, torch.tensor([8], device=TPU))
    with pytest.raises(IndexError, match="index 8 is out of bounds"):
        torch.remainder(a, torch.tensor([1, 0], device=TPU))


def test_out_of_range_embedding_raises_at_the_end_of_backward():
    emb = nn.Embedding(5, 3).to(TPU)
    loss = emb(torch.tensor([1, 7], device=TPU)).sum()  # no raise, no read
    assert _checks.pending() >= 1
    reads = torchjax.stats()["host_reads"]
    with pytest.raises(IndexError, match=r"index out of range in self \(index 7, 5 rows\)"):
        loss.backward()
    assert _checks.pending() == 0
    assert torchjax.stats()["host_reads"] == reads + 1
    # The next backward pass (valid indices) raises nothing.
    emb(torch.tensor([1, 4], device=TPU)).sum().backward()
    assert emb.weight.grad is not None


def test_backward_end_names_the_op():
    emb = nn.Embedding(5, 3).to(TPU)
    loss = emb(torch.tensor([9], device=TPU)).sum()
    with pytest.raises(IndexError) as info:
        loss.backward()
    assert "aten::embedding" in str(info.value)


def test_backward_with_nothing_pending_reads_nothing():
    # The plain path: no pending check, no read at the end of backward().
    w = torch.randn(4, 3, device=TPU, requires_grad=True)
    torch.tpu.synchronize()
    reads = torchjax.stats()["host_reads"]
    (w * 2).sum().backward()
    assert torchjax.stats()["host_reads"] == reads
    assert _checks.pending() == 0


def test_valid_checks_are_read_once_at_the_end_of_backward():
    emb = nn.Embedding(5, 3).to(TPU)
    torch.tpu.synchronize()
    reads = torchjax.stats()["host_reads"]
    emb(torch.tensor([0, 4], device=TPU)).sum().backward()
    assert _checks.pending() == 0 and torchjax.stats()["host_reads"] == reads + 1
    assert emb.weight.grad.cpu().sum().item() == 6.0


def test_a_backward_outside_the_checks_graph_reports_them_too():
    # Pending checks of a no_grad forward are reported by the next backward pass.
    w = torch.randn(5, 3, device=TPU)
    with torch.no_grad():
        torch.index_select(w, 0, torch.tensor([8], device=TPU))
    x = torch.ones(2, device=TPU, requires_grad=True)
    with pytest.raises(IndexError, match="index 8 is out of bounds"):
        (x * 3).sum().backward()
    (x * 3).sum().backward()  # reported once


def test_immediate_mode_from_the_environment():
    code = textwrap.dedent(
        """
        import torch, torchjax
        w = torch.randn(5, 3, device="tpu")
        try:
            torch.nn.functional.embedding(torch.tensor([5], device="tpu"), w)
        except IndexError as e:
            print("at the op:", e)
        """
    )
    env = dict(os.environ, TORCHJAX_SYNC_CHECKS="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert "at the op: aten::embedding: index out of range in self (index 5, 5 rows)" in (
        out.stdout
    ), out.stderr[-2000:]


def _eager_error(fn, *args):
    with pytest.raises(Exception) as info:
        fn(*args)
        torch.tpu.synchronize()
    return info.type, str(info.value)


def test_jitted_index_out_of_range_raises_at_the_next_sync_as_eager():
    # Note [Device checks of compiled programs]: the check is an output of the program,
    # queued by the call and raised at the next sync, with eager's exception and text.
    def f(x, i):
        return x[i] * 2

    jitted = torchjax.jit(f)
    x = torch.arange(5.0, device=TPU)
    bad = torch.tensor([7], device=TPU)
    expected = _eager_error(f, x, bad)
    assert expected[0] is IndexError
    assert "index 7 is out of bounds for dimension 0 with size 5" in expected[1]
    out = jitted(x, bad)  # no read, no raise: as eager, at the next sync
    assert _checks.pending() == 1
    with pytest.raises(IndexError) as info:
        out.cpu()
    assert (info.type, str(info.value)) == expected
    # A good call raises nothing; the cached program still checks the next bad one.
    assert jitted(x, torch.tensor([3], device=TPU)).cpu().tolist() == [6.0]
    jitted(x, torch.tensor([-6], device=TPU))
    assert jitted.trace_count == 1
    with pytest.raises(IndexError, match="index -6 is out of bounds"):
        torch.tpu.synchronize()


def test_jitted_embedding_out_of_range_raises():
    emb = nn.Embedding(4, 3).to(TPU)
    ids = torch.tensor([[1, 9]], device=TPU)
    expected = _eager_error(emb, ids)
    jitted = torchjax.jit(emb)
    with torch.no_grad():
        out = jitted(ids)
        with pytest.raises(IndexError) as info:
            print(out)
        assert (info.type, str(info.value)) == expected
        good = jitted(torch.tensor([[1, 3]], device=TPU))
    torch.testing.assert_close(good.cpu(), emb(torch.tensor([[1, 3]], device=TPU)).cpu())


def test_jitted_check_raises_by_the_call_in_immediate_mode():
    jitted = torchjax.jit(lambda w, i: torch.index_select(w, 0, i))
    w = torch.randn(5, 3, device=TPU)
    torch.tpu.set_sync_checks(True)
    try:
        with pytest.raises(IndexError, match="index 7 is out of bounds.*aten::index_select"):
            jitted(w, torch.tensor([7], device=TPU))
        jitted(w, torch.tensor([4], device=TPU))
    finally:
        torch.tpu.set_sync_checks(False)


def test_jitted_check_made_at_the_op_raises_by_the_call():
    # Eager raises an integer division by zero at the op (CPU's text): the call of a
    # program holding it reads its flags and raises there.
    def f(a, b):
        return torch.remainder(a, b) + 1

    jitted = torchjax.jit(f)
    a, zero = torch.tensor([4, 6], device=TPU), torch.tensor([1, 0], device=TPU)
    expected = _eager_error(f, a, zero)
    with pytest.raises(RuntimeError) as info:
        jitted(a, zero)
    assert (info.type, str(info.value)) == expected == (RuntimeError, "ZeroDivisionError")
    assert jitted(a, torch.tensor([3, 4], device=TPU)).cpu().tolist() == [2, 3]


def test_jitted_train_step_reports_its_checks_after_writing_its_state():
    torch.manual_seed(0)
    emb = nn.Embedding(5, 3).to(TPU)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)

    @torchjax.jit
    def step(ids):
        loss = emb(ids).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step(torch.tensor([1, 2], device=TPU))
    step(torch.tensor([1, 9], device=TPU))  # the weights' buffers are donated
    with pytest.raises(IndexError, match=r"index out of range in self \(index 9, 5 rows\)"):
        torch.tpu.synchronize()
    # The weights the failed call wrote back (donated buffers replaced) stay usable.
    assert emb.weight.detach().cpu().shape == (5, 3)
    step(torch.tensor([0, 4], device=TPU)).item()


def test_repeated_step_carries_the_first_failing_iteration():
    @torchjax.jit
    def step(buf, pos, idx):
        p = pos.view(1)
        buf.index_add_(0, p, idx.index_select(0, p).float())
        pos.add_(1)

    buf, pos = torch.zeros(5, device=TPU), torch.tensor(0, device=TPU)
    idx = torch.tensor([5, 6, 7], device=TPU)
    with torch.no_grad():
        step.repeat(3, buf, pos, idx)
        torch.tpu.synchronize()  # three valid iterations
        assert buf.cpu().tolist() == [5.0, 6.0, 7.0, 0.0, 0.0]
        step.repeat(2, buf, pos, idx)  # positions 3 and 4: both out of range
    with pytest.raises(IndexError, match="index 3 is out of bounds.*aten::index_select"):
        torch.tpu.synchronize()


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 50)

    def forward(self, ids):
        return self.head(self.layer(self.emb(ids)))


def _decode_step(model, ids, past):
    # One greedy step with the KV cache: the next token stays on the device.
    out = model(ids, past_key_values=past, use_cache=True)
    return out.logits[:, -1:].argmax(-1), out.past_key_values


def test_transformer_forward_decode_step_and_train_step_read_nothing_back():
    torch.manual_seed(0)
    model = _Tiny().to(TPU)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 50, (2, 8)).to(TPU)
    target = torch.randint(0, 50, (2, 8)).to(TPU)
    llama = tiny_llama().to(TPU)
    prompt = torch.randint(1, 128, (1, 6)).to(TPU)  # within its vocabulary

    def step():
        loss = F.cross_entropy(model(ids).reshape(-1, 50), target.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def reads(fn):
        torch.tpu.synchronize()  # nothing pending before, so each count is fn's own
        torchjax.reset_stats()
        with jax.transfer_guard_device_to_host("disallow"):
            out = fn()
        return torchjax.stats()["host_reads"], out

    with torch.no_grad():
        token, past = _decode_step(llama, prompt, None)  # prefill
        _decode_step(llama, token, past)  # compiles the step's programs
    step()
    with torch.no_grad():
        assert reads(lambda: model(ids))[0] == 0
        n, (token, past) = reads(lambda: _decode_step(llama, token, past))
        assert n == 0
    assert torchjax.stats()["ops"]["aten::embedding.default"]["op_by_op"] == 0
    # A train step: the one read is the end of backward() reporting the embedding's
    # index checks (Note [Device-side checks]); the forward, the optimizer step and
    # zero_grad read nothing.
    n, loss = reads(step)
    assert n == 1
    assert torchjax.stats()["ops"]["aten::embedding.default"]["calls"] >= 1
    assert _checks.pending() == 0  # read by the end of backward()
    assert loss.item() > 0  # the value's own read after the guard
    assert torchjax.stats()["host_reads"] == 2


def test_stats_count_compiles_hits_and_reads():
    x = torch.randn(3, 7, device=TPU)
    torchjax.reset_stats()
    x.atan2(x)
    first = torchjax.stats()
    x.atan2(x)
    second = torchjax.stats()
    assert first["ops"]["aten::atan2.default"]["traces"] in (0, 1)
    assert second["cache_hits"] == first["cache_hits"] + 1
    assert second["executions"] == first["executions"] + 1
    assert second["compiles"] == first["compiles"]
    x.sum().item()
    assert torchjax.stats()["host_reads"] == second["host_reads"] + 1
    torchjax.reset_stats()
    assert torchjax.stats()["executions"] == 0


def test_new_keys_from_two_threads():
    # Building and forgetting keys of one overload from two threads at once.
    x = torch.randn(4, 4, device=TPU)
    errors = []

    def work(k):
        try:
            for i in range(20):
                torch.rsub(x, x, alpha=float(k * 100 + i))  # a new float key each call
        except (KeyError, RuntimeError) as e:  # what a race in the caches raised
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def _carried_checks(jitted) -> int:
    """How many checks the program of ``jitted`` carries (the fold's inputs, or one)."""
    from tests._programs import equations

    for eqn in equations(jitted):
        if eqn.params.get("name") == "_first_failure":
            return len(eqn.invars) // 4
    (entry,) = jitted._entries.values()
    return entry.n_checks // 4


def _cache_writes(k, v, pos, x, y):
    # A static cache's writes: each layer's keys and values at the same position, the
    # second layer at a position of its own (equal in value, another array).
    k[0].index_copy_(0, pos, x)
    v[0].index_copy_(0, pos, y)
    other = pos + 0
    k[1].index_copy_(0, other, x)
    v[1].index_copy_(0, other, y)
    return k.sum() + v.sum()


@torch.no_grad()  # as in generation (with grad on, each op reads ``pos`` anew)
def test_a_trace_carries_one_range_check_per_distinct_index():
    # Note [Device checks of compiled programs]: the writes at ``pos`` check it once,
    # those at ``other`` once (4 before: one per write, folded).
    args = [torch.zeros(2, 4, 3), torch.zeros(2, 4, 3), torch.tensor([2])]
    args += [torch.ones(1, 3), torch.full((1, 3), 2.0)]
    expected = _cache_writes(*[a.clone() for a in args])
    jitted = torchjax.jit(_cache_writes)
    on_tpu = [a.to(TPU) for a in args]
    assert torch.equal(jitted(*on_tpu).cpu(), expected)
    assert torch.equal(on_tpu[0].cpu(), torch.zeros(2, 4, 3).index_fill_(1, torch.tensor([2]), 1))
    assert _carried_checks(jitted) == 2
    # Each distinct index is still checked: out of range, the first write's error.
    for pos in (4, -1):
        bad = [a.to(TPU) for a in args]
        bad[2] = torch.tensor([pos], device=TPU)
        assert _eager_error(_cache_writes, *[a.clone() for a in bad])[0] is IndexError
        jitted(*bad)
        with pytest.raises(IndexError, match=f"index {pos} is out of bounds for dimension 0"):
            torch.tpu.synchronize()
    assert jitted.trace_count == 1


def _known_writes(k, v, x, y):
    # A prefill into an empty static cache: each write's positions made afresh, known
    # while tracing and equal.
    k.index_copy_(0, torch.arange(2, device=k.device), x)
    v.index_copy_(0, torch.arange(2, device=v.device), y)
    return k.sum() + v.sum()


def test_equal_known_indices_are_checked_once():
    args = [torch.zeros(4, 3), torch.zeros(4, 3), torch.ones(2, 3), torch.full((2, 3), 2.0)]
    expected = _known_writes(*[a.clone() for a in args])
    jitted = torchjax.jit(_known_writes)
    assert torch.equal(jitted(*[a.to(TPU) for a in args]).cpu(), expected)
    assert _carried_checks(jitted) == 1
