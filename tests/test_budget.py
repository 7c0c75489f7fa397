"""The process-wide budget of cached executables (Note [Executable cache budget])."""

from types import SimpleNamespace

import pytest
import torch

import torchjax
from tests._child import completed, once_per_run, run_python
from torchjax import _budget
from torchjax.ops import executables

aten = torch.ops.aten

TPU = "tpu"


@pytest.fixture
def budget():
    before = _budget.BUDGET.max_entries, _budget.BUDGET.max_bytes, _budget.BUDGET.clear_jax
    yield
    torchjax.set_cache_budget(entries=before[0], bytes=before[1], clear_jax_caches=before[2])


def _chain(x):
    return (x @ x.t()).relu().sum()


def test_lru_order_and_eviction_by_count_and_bytes():
    b = _budget._Budget()
    b.max_entries, b.max_bytes = 2, None
    gone = []
    b.admit("a", lambda: gone.append("a"), 10)
    b.admit("b", lambda: gone.append("b"), 10)
    b.order.move_to_end("a")  # a hit: "b" is now the least recently used
    b.admit("c", lambda: gone.append("c"), 10)
    assert gone == ["b"] and list(b.order) == ["a", "c"] and b.evictions == 1
    b.set(10, 15)  # 20 bytes held: the oldest goes
    assert gone == ["b", "a"] and list(b.order) == ["c"] and b.bytes == 10
    b.set(0, None)  # nothing kept
    assert gone == ["b", "a", "c"] and not b.order and b.bytes == 0
    b.forget("missing")  # forgetting an unknown entry is a no-op


def test_set_cache_budget_refuses_bad_values(budget):
    with pytest.raises(ValueError, match="set_cache_budget: entries must be a non-negative int"):
        torchjax.set_cache_budget(entries=-1)
    with pytest.raises(ValueError, match="set_cache_budget: bytes must be"):
        torchjax.set_cache_budget(bytes=1.5)
    torchjax.set_cache_budget(entries=7)
    assert torchjax.stats()["executables"]["budget_entries"] == 7


def test_evicted_executables_compile_again_with_the_same_values(budget):
    torchjax.set_cache_budget(entries=2)
    shapes = [(5, 3), (6, 3), (7, 3)]
    cpu = [torch.randn(*s) for s in shapes]
    dev = [c.to(TPU) for c in cpu]
    for d, c in zip(dev, cpu):
        torch.testing.assert_close(_chain(d).cpu(), _chain(c))
    torchjax.reset_stats()
    got = _chain(dev[0])  # its executables were evicted by the later shapes
    s = torchjax.stats()
    torch.testing.assert_close(got.cpu(), _chain(cpu[0]))
    assert s["cache_misses"] >= 3  # mm, relu and sum traced again
    assert s["executables"]["evictions"] >= 3
    assert s["executables"]["entries"] <= 2
    torchjax.set_cache_budget(entries=64)
    torchjax.reset_stats()
    _chain(dev[0]), _chain(dev[0])
    s = torchjax.stats()
    assert s["cache_hits"] >= 3 and s["executables"]["evictions"] == 0


def test_jit_signatures_are_budget_entries(budget):
    torchjax.set_cache_budget(entries=1)
    f = torchjax.jit(lambda x: x * 2 + 1, warn_after=100)
    a, b = torch.randn(3), torch.randn(4)
    torch.testing.assert_close(f(a.to(TPU)).cpu(), a * 2 + 1)
    torch.testing.assert_close(f(b.to(TPU)).cpu(), b * 2 + 1)
    traces = f.trace_count
    torch.testing.assert_close(f(a.to(TPU)).cpu(), a * 2 + 1)  # evicted: traced again
    assert f.trace_count == traces + 1
    torchjax.set_cache_budget(entries=64)
    f(a.to(TPU))
    assert f.trace_count == traces + 1  # kept now


_CHILD = """
import ctypes, gc, importlib, json, os
import torch, torchjax

print("env budget:", torchjax.stats()["executables"]["budget_entries"], flush=True)

libc = ctypes.CDLL("libc.so.6")

def rss_mb():
    gc.collect()
    libc.malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024

torchjax.set_cache_budget(entries=16)
base = torch.randn(70, 8)
marks = {}
for i in range(60):
    x = base[: 3 + i].clone().to("tpu")
    got = float((x @ x.t()).relu().sum())
    want = float((base[: 3 + i] @ base[: 3 + i].t()).relu().sum())
    assert abs(got - want) <= 1e-3 * max(1.0, abs(want)), (i, got, want)
    if i + 1 in (10, 60):
        marks[i + 1] = rss_mb()
print("rss:", json.dumps({"marks": marks, "executables": torchjax.stats()["executables"]}))

# Last: what importing torchjax does with a garbage value (the budget module reads the
# environment when it is imported); the traceback ends the child.
os.environ["TORCHJAX_CACHE_ENTRIES"] = "lots"
importlib.reload(torchjax._budget)
"""


@pytest.fixture(scope="module")
def budget_child(request, tmp_path_factory):
    # One child process for the tests that need a fresh interpreter (importing torch and
    # jax is ~10 s a child): the environment's budget at import, then resident memory over
    # 60 shapes, then a garbage value in the environment at the import of the budget.
    def make():
        return completed(run_python(_CHILD, env={"TORCHJAX_CACHE_ENTRIES": "5"}))

    return SimpleNamespace(**once_per_run(request, tmp_path_factory, "budget_child", make))


def _lines(out, prefix):
    return [line[len(prefix) :] for line in out.stdout.splitlines() if line.startswith(prefix)]


def test_environment_sets_the_budget_and_refuses_garbage(budget_child):
    ok = _lines(budget_child, "env budget: ")
    assert ok == ["5"], budget_child.stderr[-3000:]
    assert budget_child.returncode != 0
    assert "ValueError: torchjax: environment variable" in budget_child.stderr
    assert "TORCHJAX_CACHE_ENTRIES='lots' must be an integer" in budget_child.stderr


def test_resident_memory_after_60_shapes_stays_near_10(budget_child):
    # Before the budget: +16 MB per shape, never freed (+0.8 GB over these 50 shapes).
    # Bound: jax's own staging caches, cleared at each turnover of the budget (Note
    # [Executable cache budget]); measured +6 MB.
    import json

    rss = _lines(budget_child, "rss: ")
    assert len(rss) == 1, budget_child.stderr[-3000:]
    res = json.loads(rss[0])
    marks, ex = res["marks"], res["executables"]
    assert ex["entries"] <= 16 and ex["evictions"] > 100 and ex["jax_cache_clears"] >= 1
    assert marks["60"] - marks["10"] <= 32, marks


def test_each_turnover_clears_jax_staging_caches_unless_turned_off(budget, monkeypatch):
    # jax's trace_to_jaxpr cache has no bound: without the clears it holds a traced
    # jaxpr per library function and shape for good (Note [Executable cache budget]).
    import jax
    import jax.numpy as jnp
    from jax._src.interpreters import partial_eval as pe

    def new_shapes(first, count):
        for n in range(first, first + count):
            x = torch.randn(n, 5)
            got = ((x.to(TPU) * 2 + 1).tanh() - x.to(TPU)).sum()
            torch.testing.assert_close(got.cpu(), ((x * 2 + 1).tanh() - x).sum())

    # A turnover is max(entries, _TURNOVER) evictions; lowering the floor from 64 to 8
    # turns the budget over every ~2 shapes (5 executables each) instead of every ~13,
    # so a few shapes show several turnovers (each new executable is a compile).
    turnover = 8
    monkeypatch.setattr(_budget, "_TURNOVER", turnover)
    torchjax.set_cache_budget(entries=turnover, clear_jax_caches=True)
    torchjax.reset_stats()
    _budget.BUDGET.since_clear = 0  # count turnovers from here, whatever earlier tests did
    for n in range(1, 31):  # ~90 traced jaxprs that only a clear removes
        jax.make_jaxpr(jnp.sin)(jnp.ones(n))
    assert pe.trace_to_jaxpr.cache_info().currsize >= turnover * 4
    new_shapes(3, 6)
    ex = torchjax.stats()["executables"]
    assert ex["evictions"] >= 2 * turnover
    assert ex["jax_cache_clears"] == ex["evictions"] // turnover
    assert pe.trace_to_jaxpr.cache_info().currsize < turnover * 4
    with pytest.raises(ValueError, match="clear_jax_caches must be a bool"):
        torchjax.set_cache_budget(clear_jax_caches=1)
    torchjax.set_cache_budget(clear_jax_caches=False)
    clears = torchjax.stats()["executables"]["jax_cache_clears"]
    evictions = torchjax.stats()["executables"]["evictions"]
    new_shapes(50, 6)
    assert torchjax.stats()["executables"]["evictions"] - evictions >= 2 * turnover
    assert torchjax.stats()["executables"]["jax_cache_clears"] == clears


def test_a_byte_budget_measures_each_new_executable(budget):
    def tanh_runs():
        owners = [o for o in executables._OWNERS if o.func == aten.tanh.default]
        return [r for o in owners for r in o.table.runs.values()]

    executables.clear_caches(aten.tanh.default)
    torchjax.set_cache_budget(entries=64, bytes=10**9)
    x = torch.randn(13, 7)
    got = torch.tanh(x.to(TPU))  # a new signature: measured after its first call
    torch.testing.assert_close(got.cpu(), torch.tanh(x))
    ex = torchjax.stats()["executables"]
    assert ex["budget_bytes"] == 10**9 and ex["entries"] >= 1
    # Measured once each: XLA:CPU reports 0 bytes of generated code, GPU/TPU the size.
    runs = tanh_runs()
    assert runs and all(r.nbytes is not None for r in runs)
    torchjax.set_cache_budget(bytes=None)
    assert torchjax.stats()["executables"]["budget_bytes"] is None
