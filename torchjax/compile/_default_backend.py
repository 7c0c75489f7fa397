"""``torch.compile(model)`` without ``backend=`` on tpu tensors: the "tpu" backend.

# Note [The default torch.compile backend on tpu]
torch 2.13's inductor registers its own code generation for a device named "tpu"
(Pallas kernels for the torch_tpu package), so ``torch.compile(m)`` of a model on our
"tpu" tensors failed inside inductor ("No module named 'torch_tpu'", or kernels run on
tensors they cannot read). A user who forgets ``backend="tpu"``, or a library that
compiles with the default (transformers' flex-attention and generation paths), should
get a working program, so each graph the default backend receives whose inputs or
intermediate values are tpu tensors is compiled by the "tpu" backend instead (the same
graph and example inputs Dynamo would hand ``backend="tpu"``); inductor's ``mode`` and
``options`` name inductor settings and are ignored, as the "tpu" backend does. Graphs
on other devices reach inductor unchanged. Chosen over an error because the error could
only tell the user to pass ``backend="tpu"``, which is what this does; the process-wide
change is recorded (Note [Process-wide changes]) and undone by ``torchjax.uninstall()``.
"""

from __future__ import annotations

import torch

from torchjax._compat.torch_dynamo import install_inductor_route


def _is_tpu(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "tpu"


def _on_tpu(gm, example_inputs) -> bool:
    """Whether the graph touches a tpu tensor: an input, or a value it computes (a
    graph that makes its tensors with ``device="tpu"`` takes no tensor inputs)."""
    if any(_is_tpu(x) for x in example_inputs):
        return True
    # Dynamo's graphs carry FakeTensors as "example_value"; AOT-traced ones as "val".
    nodes = gm.graph.nodes if hasattr(gm, "graph") else ()
    meta = (n.meta.get(k) for n in nodes for k in ("val", "example_value"))
    return any(_is_tpu(v) for v in meta)


def route(gm, example_inputs):
    """The "tpu" backend's compiled graph for a tpu graph; None leaves it to inductor."""
    if not _on_tpu(gm, example_inputs):
        return None
    from torchjax.compile._dynamo import backend

    return backend(gm, example_inputs)


def install() -> None:
    install_inductor_route(route)
