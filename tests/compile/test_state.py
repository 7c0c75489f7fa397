"""The state walk of torchjax.jit (torchjax/compile/_state.py)."""

from __future__ import annotations

import weakref

import torch

import torchjax  # noqa: F401  (registers the "tpu" device)
from torchjax.compile import _state
from torchjax.tensor._tensor import JaxTensor


class _Int(int):
    pass


class _Holder:
    def __init__(self, **kw):
        vars(self).update(kw)


def test_exact_types_and_subclasses_walk_alike():
    """Note [The walk's exact-type fast path]: objects of the leaf types and JaxTensors
    found by their exact type, their subclasses and look-alikes by ``isinstance``, give
    the walk ``isinstance`` alone gives."""
    lin = torch.nn.Linear(2, 2).to("tpu")
    t = torch.ones(3, device="tpu")
    assert type(t) is JaxTensor
    sub = torch.nn.Parameter(torch.zeros(2, device="tpu"))  # a JaxTensor subclass instance
    holder = _Holder(
        n=_Int(3),  # a leaf by isinstance only
        tensor=t,
        param=sub,
        proxy=weakref.proxy(lin),  # a Module by isinstance (its __class__), not its type
        kinds=[int, torch.float32, torch.device("cpu"), None, "s", 2.5],
        nested={"t": t[1:]},  # a view: the same storage, another tensor
    )
    w = _state.walk([holder], False)
    found = {id(s) for s in w.storages}
    expected = {id(x._storage) for x in (t, sub, lin.weight, lin.bias)}
    assert found == expected
    assert {id(x) for x in w.every} == {id(x) for x in (t, sub, lin.weight, lin.bias)} | {
        id(holder.nested["t"])
    }
    assert w.modules == [lin]
    assert w.host == []


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = _Holder(hidden=4, name="net")
        self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        self.head = torch.nn.Linear(4, 2, bias=False)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long).cpu())  # a CPU one

    def forward(self, x):
        return self.head(self.inner(x) * self.scale)

    def other(self, x, extra):
        return self.forward(x) + extra


_FOUND = (
    "storages", "tensors", "every", "grad_flags", "modules", "configs", "attribute_tokens",
    "module_refs", "host", "scalars",
)  # fmt: skip


def _found(w) -> tuple:
    """What a walk found, by identity (and value for flags, tokens and scalars)."""
    return tuple(
        tuple(x if isinstance(x, (bool, int, tuple)) or x is None else id(x) for x in getattr(w, n))
        for n in _FOUND
    )


def test_walks_in_a_block_share_what_they_find_under_a_module():
    """Note [A module walked once within a block]: walks of two bound methods of one module
    (as a compiled generate's prefill and loop) in ``shared_walks()`` find what walks
    outside it find, the second taking the first's findings under the module."""
    net = _Net().to("tpu")
    net.steps = net.steps.cpu()
    extra = torch.ones(2, device="tpu")
    roots = ([net.forward], [net.other, extra], [net.head.weight, net.other, extra])
    plain = [_found(_state.walk(r, False)) for r in roots]
    made = []
    of = _state._Found.of
    try:
        _state._Found.of = staticmethod(lambda m: made.append(m) or of(m))
        with _state.shared_walks():
            shared = [_found(_state.walk(r, False)) for r in roots]
            # Found once for the first two; the third walk had reached a weight of the
            # module first, so walks the module itself (the findings would repeat it).
            assert made == [net, net]
            # A walk with gradients (a train step's) walks for itself.
            assert _found(_state.walk(roots[0], True)) == _found(_state.walk(roots[0], True))
            assert made == [net, net]
    finally:
        _state._Found.of = of
    assert shared == plain
    assert len(plain[0][0]) == 6 and len(plain[0][8]) == 1  # 6 tpu storages, 1 CPU buffer


def test_a_shared_walk_is_walked_again_after_python_ran():
    """Within the block, a compiled function's Python running (a trace, an eager run) may
    change the module: the next walk walks it again (Note [A module walked once within a
    block]); outside a block every walk is its own."""
    net = _Net().to("tpu")
    with _state.shared_walks():
        first = _state.walk([net.forward], False)
        net.head.weight = torch.nn.Parameter(torch.zeros(2, 4, device="tpu"))  # what a trace did
        net.register_buffer("late", torch.ones(1, device="tpu"))
        _state.python_ran()
        second = _state.walk([net.forward], False)
    assert net.head.weight._storage in second.storages
    assert net.head.weight._storage not in first.storages
    assert any(t is net.late for t in second.every)
    assert len(second.storages) == len(first.storages) + 1
    assert _found(second) == _found(_state.walk([net.forward], False))
    # Another module, or the module dropped and a new one at its address: walked anew.
    with _state.shared_walks():
        a = _found(_state.walk([net.forward], False))
        b = _found(_state.walk([_Net().to("tpu").forward], False))
    assert a != b


def test_compiled_calls_in_a_block_match_eager():
    """Two compiled functions of one module called in a block (the shared walk), then the
    module's weight replaced outside it: eager values, and a new trace for the new
    weight."""
    net = _Net().to("tpu").eval()
    f, g = torchjax.jit(net.forward), torchjax.jit(net.other)
    x, extra = torch.randn(3, 4, device="tpu"), torch.ones(2, device="tpu")
    checked = 0
    for replaced in (False, True):
        if replaced:
            with torch.no_grad():
                net.head.weight = torch.nn.Parameter(net.head.weight * 3)
        for _ in range(2):
            with torch.no_grad(), _state.shared_walks():
                got = (f(x), g(x, extra))
            want = (net(x), net.other(x, extra))
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0)
            checked += 1
    assert checked == 4 and f.trace_count == 2 and g.trace_count == 2


def test_a_trace_in_a_block_ends_what_walks_share():
    """A trace runs the function's Python, which may change its modules: a walk after it in
    the block finds what the trace left (Note [A module walked once within a block])."""
    net = _Net().to("tpu")

    def swap(x):
        net.head.weight = torch.nn.Parameter(torch.zeros(2, 4, device="tpu"))
        return x + 1

    x = torch.ones(3, device="tpu")
    with _state.shared_walks():
        before = _state.walk([net.forward], False)
        old = net.head.weight
        torchjax.jit(swap)(x)  # traced: its Python ran
        after = _state.walk([net.forward], False)
    assert old._storage in before.storages and old._storage not in after.storages
    assert net.head.weight._storage in after.storages
    assert _found(after) == _found(_state.walk([net.forward], False))
