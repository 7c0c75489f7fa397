"""Tests for torchjax/ops/executables.py: the one table of executables that single ops and
``_foreach_*`` ops share (keys, float variants, the budget, counters, clear_caches)."""

import pytest
import torch

import torchjax
from torchjax import _budget
from torchjax.ops import cached_compute, executables

aten = torch.ops.aten
TPU = "tpu"


def _params(*shapes):
    torch.manual_seed(0)
    cpu = [torch.randn(*s) for s in shapes]
    return cpu, [t.to(TPU) for t in cpu]


def test_foreach_and_single_ops_share_the_counters_and_clear_caches():
    func = aten._foreach_mul_.ScalarList
    executables.clear_caches(func)
    cpu, tpu = _params((3, 2), (5,))
    for step in range(3):
        torch._foreach_mul_(cpu, [1.5 + step, 0.5])
        torch._foreach_mul_(tpu, [1.5 + step, 0.5])
    for t, c in zip(tpu, cpu):
        torch.testing.assert_close(t.cpu(), c)
    info = cached_compute.cache_info(func)
    # Number lists are arguments: one key, one trace, three calls through it.
    assert (info.keys, info.traces, info.calls) == (1, 1, 3)
    executables.clear_caches(func)
    info = cached_compute.cache_info(func)
    assert (info.keys, info.traces, info.calls) == (0, 0, 0)
    torch._foreach_mul_(tpu, [2.0, 2.0])
    assert cached_compute.cache_info(func).traces == 1


def _table(func):
    (owner,) = [o for o in executables._OWNERS if o.func == func]
    return owner.table


def test_each_foreach_signature_is_a_budget_entry():
    func = aten._foreach_add.List
    executables.clear_caches(func)

    def run(n):
        cpu, tpu = _params((n,), (2, n))
        got = torch._foreach_add(tpu, tpu)
        for g, c in zip(got, torch._foreach_add(cpu, cpu)):
            torch.testing.assert_close(g.cpu(), c)

    for n in (4, 6):  # two input signatures of one key
        run(n)
    info = cached_compute.cache_info(func)
    assert (info.keys, info.traces) == (1, 2)
    runs = list(_table(func).runs.values())
    assert len(runs) == 2 and all(r in _budget.BUDGET.order for r in runs)
    # The budget evicting one (as it does past its size) drops it from the table: the
    # next call of that signature compiles again.
    evict, _ = _budget.BUDGET.order.pop(runs[0])
    evict()
    assert runs[0] not in _table(func).runs.values()
    run(4)
    run(6)
    assert cached_compute.cache_info(func).traces == 3


def test_foreach_float_variants_stop_compiling(monkeypatch):
    # A single float an op needs as a number (pow's exponent picks ATen's kernel) is part
    # of the key: after MAX_FLOAT_VARIANTS keys the overload's calls of that form run op
    # by op, as single ops do, and give the same values.
    monkeypatch.setattr(executables, "MAX_FLOAT_VARIANTS", 2)
    func = aten._foreach_pow.Scalar
    executables.clear_caches(func)
    cpu, tpu = _params((4,), (3, 3))
    cpu, tpu = [t.abs() + 0.5 for t in cpu], [t.abs() + 0.5 for t in tpu]
    for e in (0.5, 0.25, 0.125, 0.0625):
        for t, c in zip(torch._foreach_pow(tpu, e), torch._foreach_pow(cpu, e)):
            torch.testing.assert_close(t.cpu(), c)
    info = cached_compute.cache_info(func)
    assert info.keys == 2 and info.calls == 2


def test_foreach_floats_are_values(monkeypatch):
    # Any other single float (an alpha) is a value of the executable: one key for every
    # value (Note [Compiled foreach]).
    monkeypatch.setattr(executables, "MAX_FLOAT_VARIANTS", 2)
    func = aten._foreach_add_.List
    executables.clear_caches(func)
    cpu, tpu = _params((4,), (3, 3))
    other_cpu, other_tpu = _params((4,), (3, 3))
    for alpha in (0.5, 0.25, 0.125, 0.0625):
        torch._foreach_add_(cpu, other_cpu, alpha=alpha)
        torch._foreach_add_(tpu, other_tpu, alpha=alpha)
    for t, c in zip(tpu, cpu):
        torch.testing.assert_close(t.cpu(), c)
    info = cached_compute.cache_info(func)
    assert info.keys == 1 and info.calls == 4


def test_single_op_float_variants_use_the_shared_limit(monkeypatch):
    # nan_to_num's nan is a ``float`` argument, static (an op's number arguments are
    # not: Note [Python floats as values of an op's program]).
    monkeypatch.setattr(executables, "MAX_FLOAT_VARIANTS", 1)
    func = aten.nan_to_num.default
    executables.clear_caches(func)
    a = torch.tensor([float("nan"), 2.0, -1.0])
    for nan in (0.5, 0.25, 0.125):
        got = torch.nan_to_num(a.to(TPU), nan=nan)
        assert torch.equal(got.cpu(), torch.nan_to_num(a, nan=nan))
    info = cached_compute.cache_info(func)
    assert info.keys == 1 and info.op_by_op == 2


@pytest.mark.parametrize("inplace", [False, True])
def test_foreach_inside_torchjax_jit_runs_in_the_outer_program(inplace):
    # The table's executable carries compiler options, which jax refuses on a nested jit:
    # inside a trace the option-free twin runs, part of the outer program.
    cpu, tpu = _params((3,), (2, 2))

    def step(xs):
        if inplace:
            torch._foreach_mul_(xs, 3.0)
            return [x + 0 for x in xs]
        return torch._foreach_mul(xs, 3.0)

    got = torchjax.jit(step)(tpu)
    want = step(cpu)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w)
