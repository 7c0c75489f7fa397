"""The differentiable call of a captured module call (Note [Captured calls that need a
graph] in torchjax/compile/_captured.py), and its double backward: the call made again
op by op, under autograd.

Note [Double backward of a captured call]
A captured call's backward is one compiled program: its gradients are values, with no
graph of their own. In eager, ``backward(create_graph=True)`` (a gradient penalty,
``torch.autograd.grad(loss, params, create_graph=True)``) gives gradients that are
functions of the parameters, the inputs and the incoming gradients, and a second
backward through them differentiates the call twice. Whether the backward will be asked
for a graph is not known when the forward runs, so capture cannot be refused then. So a
backward with a graph runs the call again, op by op, from its arguments (the module's
own ``__call__``, nothing captured inside it), and differentiates that with
``torch.autograd.grad(..., create_graph=True)``, the leaves' hooks set aside as the
traced backward sets them aside (they run once, when the engine hands the gradients on).
The forward made again is eager's (fused eager's ops, eager's bits), so are its
gradients and their graph. It is made only where running the call again is the call:
a forward that writes state or arguments (a cache, a buffer), draws random numbers,
returns views (of its arguments, or outputs sharing storage), took CPU tensors, or
whose state or tensor arguments were written since, raises instead, naming
``torchjax.fused(capture=False)``, where such a call records op by op and its double
backward is eager's.
"""

from __future__ import annotations

import warnings

import torch

from torchjax._compat.torch import pytree
from torchjax.compile._autograd import accumulating
from torchjax.compile._vjp import VJPCall


class CapturedVJPCall(VJPCall):
    """``VJPCall`` of a captured module call: its double backward made op by op (Note
    [Double backward of a captured call])."""

    def __init__(self, entry, call):
        super().__init__(entry, call)
        self.versions = [t._version for t in self._inputs()]

    def _inputs(self):
        program, call = self.entry.vjp, self.call
        return program.state_inputs(call.walk) + [call.tensors[k] for k in program.diff_dyn]

    def grads_with_graph(self, grads):
        """The gradients of the call's inputs for the output gradients ``grads`` (one
        per output of the differentiable call, None where none came), with their graph:
        the call made again op by op, differentiated under ``create_graph=True``."""
        entry, call = self.entry, self.call
        why = _not_again(entry, call)
        inputs = self._inputs()
        if why is None and any(t._version != v for t, v in zip(inputs, self.versions)):
            why = "a parameter, buffer or tensor argument it read was written in place since"
        if why is not None:
            raise RuntimeError(
                f"torchjax fused eager: the backward with create_graph=True of a captured "
                f"call of {entry.name} runs the call again op by op, and cannot here: {why}. "
                "Run this code under torchjax.fused(capture=False) (or plain eager), where "
                "the call records op by op and its double backward is eager's."
            )
        call.jitted.refuse(call.key)  # its later calls run op by op, eager's bits
        warnings.warn(
            f"torchjax fused eager: a captured call of {entry.name} was differentiated with "
            "create_graph=True; it ran again op by op for a graph, so second-order "
            "gradients through it may differ from eager's in the last bits (the order of "
            "their sums); its later calls run op by op. Use torchjax.fused(capture=False) "
            "around such code for eager's bits.",
            UserWarning,
            stacklevel=2,
        )
        args, kwargs = call.tree
        with torch.enable_grad():
            out = call.jitted.op_by_op(args, kwargs)
        flat = pytree.tree_flatten(out)[0]
        outs = [flat[i] for i in entry.out_pos]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if not pairs:
            return [None] * len(inputs)
        with accumulating(inputs):  # their hooks run once, when the engine hands these on
            return torch.autograd.grad(
                [o for o, _ in pairs],
                inputs,
                [g for _, g in pairs],
                create_graph=True,
                allow_unused=True,
            )


def _not_again(entry, call) -> str | None:
    """Why running ``call`` again is not the call (Note [Double backward of a captured
    call]), or None."""
    if entry.written or entry.created or entry.args_written:
        return "its forward writes state or arguments"
    if entry.rng_ending.needed or entry.host_states:
        return "its forward draws random numbers"
    if entry.aliases is not None or entry.n_out != len(entry.out_pos) or entry.vjp.rebased:
        return "it returns views of its arguments or state, or outputs sharing storage"
    if call.host:
        return "it took CPU tensors"
    return None
