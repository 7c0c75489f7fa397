"""Dynamo graphs that copy tpu values to the host: the copies, and what uses them, run
as eager Python; the rest of the graph stays compiled.

Note [Host copies in compiled graphs]
``y.cpu()``, ``y.to("cpu")`` or ``torch.tensor([x[0], x[1]])`` (a CPU tensor made of
tpu scalars) in a function given to ``torch.compile(backend="tpu")`` puts a copy to the
host inside Dynamo's graph, as it does for inductor on CUDA, whose graph returns the
CPU tensor. A torchjax.jit program takes and returns device arrays: traced, the copy
needs the value itself and raised DataDependentError. So the backend splits such a
graph, in its order, with torch.fx's ``split_module``: a node whose value is a tensor
off the device computed from a tpu value (a copy to the host), and every node that
uses one, run as eager Python (the GraphModule of their part, called as written); each
run of the other nodes is one torchjax.jit program. The parts run in the graph's order,
as the function's lines do (an in-place update whose result nothing uses still comes
before the copy after it). The results are
eager's: a copy to the host reads the value there, as eager reads it. A graph with no
such copy is one program, as before.
"""

from __future__ import annotations

import torch
from torch.fx.passes.split_module import split_module

from torchjax._compat.torch import pytree

DEVICE_TYPE = "tpu"


def host_nodes(gm: torch.fx.GraphModule) -> set:
    """The nodes of ``gm`` that copy a tpu value to the host, and those using them."""
    host = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        inputs = node.all_input_nodes
        if any(i in host for i in inputs) or (
            _has(node, lambda d: d != DEVICE_TYPE) and any(_on_device(i) for i in inputs)
        ):
            host.add(node)
    return host


def _has(node, device_test) -> bool:
    return any(
        isinstance(v, torch.Tensor) and device_test(v.device.type)
        for v in pytree.tree_leaves(node.meta.get("example_value"))
    )


def _on_device(node) -> bool:
    return _has(node, lambda d: d == DEVICE_TYPE)


class _Program(torch.nn.Module):
    """A compiled part of a split graph, called where its GraphModule was."""

    def __init__(self, compiled):
        super().__init__()
        self.compiled = compiled

    def forward(self, *args):
        return self.compiled(*args)


def split(gm: torch.fx.GraphModule, host: set, compile_part) -> tuple:
    """``gm`` as a GraphModule calling its parts in order: ``host`` nodes' parts as they
    are, the others' as ``compile_part(part)``. Returns it and the compiled parts."""
    part, kinds, last = {}, [], None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        on_host = node in host
        if on_host is not last:
            kinds.append(on_host)
            last = on_host
        part[node] = len(kinds) - 1
    # In the graph's order, not split_module's default of data dependence: a part whose
    # only effect is an in-place update (``p.add_(1)`` before ``p.cpu()``) has no users
    # and would otherwise run last.
    outer = split_module(gm, gm, lambda node: part[node], keep_original_order=True)
    compiled = []
    for name, module in list(outer.named_children()):
        index = int(name.rsplit("_", 1)[1])
        if not kinds[index]:
            compiled.append(compile_part(module))
            setattr(outer, name, _Program(compiled[-1]))
    return outer, compiled
