"""Custom ``autograd.Function``s in Dynamo's graphs, replayable by the compiled backward.

Note [Custom functions in Dynamo graphs]
Dynamo captures a user's ``autograd.Function`` as one ``autograd_function_apply`` call
with two graphs: ``fwd`` returns the outputs and every value the backward uses (saved
with ``save_for_backward`` or kept on ``ctx``), ``bwd`` takes the gradients and those
values. torch's own implementation keeps the values in a Python closure. The tpu
backend's backward is torch's graph of the trace replayed in its own program (Note [The
compiled VJP is torch's autograd]); a closure would hand it the forward trace's values,
so the program would fall back to differentiating the forward, and the custom backward
would be lost. So the backend points those calls at ``apply``, the same computation
with the tensors among the values saved by ``save_for_backward``: they travel as the
program's residuals, and the user's backward runs.
"""

from __future__ import annotations

import torch

from torchjax._compat.torch import autograd_function_apply

_TENSOR = object()  # the place of a saved tensor among the saved values


class _Apply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fwd, bwd, options, *args):
        output, values = torch.fx.Interpreter(fwd).run(*args)
        if isinstance(output, list):
            output = tuple(output)
        ctx.bwd = bwd
        ctx.values = [_TENSOR if isinstance(v, torch.Tensor) else v for v in values]
        ctx.save_for_backward(*(v for v in values if isinstance(v, torch.Tensor)))
        outs = output if isinstance(output, tuple) else (output,)
        dirty = set(options.get("dirty_idx", ()))
        if dirty:
            ctx.mark_dirty(*(o for i, o in enumerate(outs) if i in dirty))
        constant = set(options.get("non_differentiable_idx", ()))
        if constant:
            ctx.mark_non_differentiable(*(o for i, o in enumerate(outs) if i in constant))
        return output

    @staticmethod
    def backward(ctx, *grads):
        tensors = iter(ctx.saved_tensors)
        values = [next(tensors) if v is _TENSOR else v for v in ctx.values]
        return (None, None, None, *torch.fx.Interpreter(ctx.bwd).run(*grads, *values))


def apply(fwd, bwd, *args, **options):
    """``autograd_function_apply(fwd, bwd, *args, **options)``, its saved tensors kept
    by ``save_for_backward``."""
    return _Apply.apply(fwd, bwd, options, *args)


def replace_in(gm: torch.fx.GraphModule) -> None:
    """Point ``gm``'s ``autograd_function_apply`` calls at ``apply``."""
    found = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is autograd_function_apply():
            node.target = apply
            found = True
    if found:
        gm.recompile()
