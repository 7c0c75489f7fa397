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

Note [Data-dependent ops in compiled graphs]
Dynamo breaks its graph at the ops whose output shape depends on values (``x[mask]``,
``torch.nonzero``, ``torch.unique``): they run eagerly between graphs. Others need values
without changing a shape Dynamo sees and stay in its graph: ``x[mask] = values`` (and
``x[mask] += 1``, whose read breaks the graph but whose write does not) is ``setitem``,
``index_put_``, whose values must be as many as the mask selects; inductor computes it on
CPU and CUDA. Traced by torchjax.jit it raised DataDependentError. Each compiled part is
a ``Part``: where its trace raises DataDependentError (the trace puts back what it
changed: Note [State after a trace whose program does not run], so nothing of the part
has run), the node that raised it (Note [Where a data-dependent op was written] in
torchjax/tensor/_errors.py) becomes a part of its own, run eagerly on the values as a
host part is, and the nodes before and after it are Parts again, compiled; the call then
runs the part split. One warning per graph names the op, its line and that it runs
eagerly. A node that cannot be found runs its whole part eagerly. Where the graph's
Python floats are still traced values (Note [Traced Python floats]), the error goes up
first: the graph is traced again with static numbers, which a split graph needs.
"""

from __future__ import annotations

import warnings

import torch
from torch.fx.passes.split_module import split_module

from torchjax._compat.torch import pytree
from torchjax.tensor import _errors
from torchjax.tensor._errors import DataDependentError

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


class Graph:
    """What the Parts of one Dynamo graph share: whether they may split now, and whether
    the graph has warned (Note [Data-dependent ops in compiled graphs])."""

    def __init__(self, compile_program, may_split=lambda: True):
        self.compile_program = compile_program
        self.may_split = may_split
        self.warned = False

    def part(self, gm: torch.fx.GraphModule) -> Part:
        return Part(gm, self)

    def warn(self, error: DataDependentError) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(str(error), UserWarning, stacklevel=2)


class Part:
    """A compiled part of a Dynamo graph: one program, or, once its trace met an op that
    needs values, the part split around that op (Note [Data-dependent ops in compiled
    graphs])."""

    def __init__(self, gm: torch.fx.GraphModule, graph: Graph):
        self.gm = gm
        self.graph = graph
        self.program = graph.compile_program(gm)
        self.split = None  # the GraphModule running the pieces, once split
        self.pieces: list[Part] = []

    def programs(self) -> list:
        """The compiled programs running this part now (for the backend's counters)."""
        if self.program is not None:
            return [self.program]
        return [p for piece in self.pieces for p in piece.programs()]

    def __call__(self, *args):
        if self.program is None:
            return self.split(*args)
        try:
            with _errors.compiled_graph():
                return self.program(*args)
        except DataDependentError as error:
            if not self.graph.may_split():
                raise
            node = next((n for gm, n in error.nodes if gm is self.gm), None)
            if node is None:  # not found: the part, as a whole
                self.split, self.pieces = self.gm, []
            else:
                self.split, self.pieces = split(self.gm, {node}, self.graph.part)
            self.program = None
            self.graph.warn(error)
        return self.split(*args)
