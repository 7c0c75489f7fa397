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
