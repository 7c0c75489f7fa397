"""A repeated op sequence in fused eager mode finds its recorded steps (Note [Replaying a
recorded sequence] in torchjax/ops/fused_replay.py): no trace, same values as eager."""

import threading
import weakref

import jax
import pytest
import torch

import torchjax
from torchjax.ops import executables
from torchjax.ops import fused as F
from torchjax.ops import fused_replay as R

TPU = "tpu"


@pytest.fixture(autouse=True)
def _fresh_executables():
    executables.clear_caches()


def _inputs(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 16, generator=g).to(TPU) for _ in range(n)]


def _chain(x, w, b):
    for _ in range(20):
        x = x * w
        x = x + b
    return x


def _recorded(fn, *args):
    """``fn(*args)`` in fused mode: its value (CPU) and the segment's last step."""
    with torchjax.fused():
        out = fn(*args)
        step = out._storage.lazy.segment.step
        return out.cpu(), step


def test_a_repeated_sequence_finds_its_steps_without_tracing(monkeypatch):
    x, w, b = _inputs()
    want = _chain(x, w, b).cpu()
    first, step = _recorded(_chain, x, w, b)
    traced = []
    shapes = F._shapes
    monkeypatch.setattr(F, "_shapes", lambda run, dyn: traced.append(run) or shapes(run, dyn))

    def refuse(*args, **kwargs):
        raise AssertionError("a JAX trace while a known sequence is recorded")

    monkeypatch.setattr(jax, "make_jaxpr", refuse)
    monkeypatch.setattr(jax, "eval_shape", refuse)
    torchjax.reset_stats()
    again, same = _recorded(_chain, x, w, b)
    stats = torchjax.stats()
    # Every op found its step: the output avals were not asked for, nothing was traced,
    # and the segment ended on the step the first run ended on (its program's key).
    assert traced == []
    assert same is step and step.depth == 40
    assert stats["fused_ops"] == 40 and stats["fused_segments"] == 1
    assert stats["fused_compiles"] == 0 and stats["compiles"] == 0
    assert torch.equal(first, want) and torch.equal(again, want)


def test_the_wiring_is_part_of_the_step():
    # x * y and x * x run one executable (same shapes and dtypes); aliasing an input
    # is another wiring, so another step and another program.
    x, y = _inputs(1, 2)

    def f(a, b):
        return a * b + a

    want_xy, want_xx = f(x, y).cpu(), f(x, x).cpu()
    got_xy, step_xy = _recorded(f, x, y)
    got_xx, step_xx = _recorded(f, x, x)
    assert step_xy is not step_xx
    assert _recorded(f, x, y)[1] is step_xy
    assert torch.equal(got_xy, want_xy) and torch.equal(got_xx, want_xx)


def test_a_full_segment_replays_in_pieces(monkeypatch):
    monkeypatch.setattr(F, "MAX_NODES", 16)
    x, w, b = _inputs(2)
    want = _chain(x, w, b).cpu()
    with torchjax.fused():
        first = _chain(x, w, b).cpu()
    torchjax.reset_stats()
    with torchjax.fused():
        again = _chain(x, w, b).cpu()
    stats = torchjax.stats()
    assert stats["fused_segments"] == 3 and stats["fused_compiles"] == 0
    assert torch.equal(first, want) and torch.equal(again, want)


def test_an_executable_forgets_its_edges_past_the_limit(monkeypatch):
    monkeypatch.setattr(R, "MAX_EDGES", 3)
    runs = set()
    add = R.add
    monkeypatch.setattr(R, "add", lambda run, key, step: runs.add(run) or add(run, key, step))
    x, w, b = _inputs(3)
    want = _chain(x, w, b).cpu()
    for _ in range(3):
        got, _ = _recorded(_chain, x, w, b)
        assert torch.equal(got, want)
    # mul and add are at 20 places of the sequence each: their edges were dropped and
    # entered again, never more than one past the limit.
    assert len(runs) == 2
    assert all(len(run.fused_steps) <= 4 for run in runs)


def test_steps_hold_their_functions_weakly():
    # An edge of a live executable holds the step before it, and so the whole path: the
    # functions of executables the budget dropped must not stay alive through it (jax
    # keeps its traces and compiled code per function).
    x, w, b = _inputs(4)
    _, step = _recorded(_chain, x, w, b)
    nodes = R.nodes(step)
    assert len(nodes) == 40
    assert all(isinstance(node[0], weakref.ReferenceType) for node in nodes)
    assert all(node[0]() is not None for node in nodes)  # the executables are alive


def test_threads_replaying_one_sequence_at_once():
    inputs = [_inputs(10 + i) for i in range(2)]
    want = [_chain(*xs).cpu() for xs in inputs]
    got = [[], []]
    barrier = threading.Barrier(2)

    def worker(i):
        barrier.wait()  # both threads record the same steps at once
        for _ in range(3):
            got[i].append(_recorded(_chain, *inputs[i])[0])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w, g in zip(want, got):
        assert len(g) == 3 and all(torch.equal(w, v) for v in g)
