"""Activation checkpointing inside compiled programs.

Note [Checkpointed regions in compiled programs]
``torch.utils.checkpoint`` keeps a region's inputs instead of its activations and runs
the region again in backward. In a ``torchjax.jit`` function that runs ``backward()``
both runs are traced into one program, and the second computes the same
operations on the same arrays as the first: XLA's common-subexpression elimination
merged each recomputed value with its forward twin, so every activation stayed live
from forward to backward and checkpointing saved no memory at all (measured: the
compiled step of an 8-block MLP needed the same 344 MiB of temporaries with and without
checkpointing).

So when the recomputation starts, the region's tensor inputs are passed through one
``lax.optimization_barrier`` (as ``jax.checkpoint`` does for its own recomputation): XLA
treats the barrier's outputs as new values, nothing downstream of them can be merged
with the forward's operations, and the forward's activations die where the forward last
uses them. The barrier is an identity: the values, and so the gradients, are unchanged.

The barrier also takes values the backward has just computed: the inputs of the newest
operations traced when the recomputation starts (the gradients flowing into the region).
Without them the recomputation depends on forward values only, and XLA's TPU scheduler,
free to place it anywhere after them, ran every layer's recomputation at the end of the
forward: all of them live at once, as many activations as no checkpointing (seen on a
v5e: all 31 recomputed flash-attention calls of a 16-layer Llama's step scheduled before
its first backward kernel, 16.5 GB of temporaries at batch 4 against pure JAX's 3.6). A
recomputation that waits for a gradient runs where the backward reaches its region, as
``jax.checkpoint``'s does: its transpose passes the output cotangents through the
barrier with the saved inputs.
Only traced tensors (a tracer behind them) are passed through; in eager the region's
activations are freed by the recompute's design and nothing changes. The recomputation
sees its inputs as contiguous tpu tensors of the same values, shapes and dtypes (the
barrier makes new arrays), with the same ``requires_grad``:

- non-reentrant checkpoint (``use_reentrant=False``): the inputs come back through an
  identity autograd function, so they carry a graph as the saved inputs did (the
  recompute's graph is never run backward; it only decides which tensors are saved);
- reentrant checkpoint: the inputs are new leaves, as ``detach_variable`` makes them;
  torch reads the region's input gradients from their ``.grad``.

The hooks into torch are in torchjax/_compat/torch_checkpoint.py.
"""

from __future__ import annotations

import jax
import torch
from jax import lax

from torchjax._compat.jax import newest_traced_values
from torchjax._compat.torch_checkpoint import install_recompute_inputs
from torchjax.tensor._tensor import JaxTensor, wrap


def _traced(value) -> bool:
    return type(value) is JaxTensor and isinstance(value._value(), jax.core.Tracer)


class _Barrier(torch.autograd.Function):
    @staticmethod
    def forward(ctx, after, *tensors):
        # ``after``: jax values the barrier waits for, its outputs for them unused.
        arrays, _ = lax.optimization_barrier((tuple(t._value() for t in tensors), after))
        outs = tuple(wrap(a, t._device_index) for a, t in zip(arrays, tensors))
        # A Function's outputs all require grad when one input does; an input that did
        # not must come back without, or the recomputation saves tensors the forward
        # did not (a product with a constant input saves one operand, not both) and
        # torch's checkpoint refuses it.
        needs = ctx.needs_input_grad[1:]
        ctx.mark_non_differentiable(*(o for o, n in zip(outs, needs) if not n))
        return outs

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)


def barrier(values: list, connected: bool) -> list:
    """``values`` with its traced tensors passed through one optimization barrier;
    ``connected``: the new tensors hang off the old ones in autograd's graph, else they
    are leaves with the old ones' ``requires_grad``."""
    at = [i for i, v in enumerate(values) if _traced(v)]
    if not at:
        return values
    olds = [values[i] for i in at]
    after = tuple(newest_traced_values())  # the backward's newest values
    if connected:
        # Backward runs without grad mode; the recomputation runs with it.
        with torch.enable_grad():
            news = _Barrier.apply(after, *olds)
    else:
        with torch.no_grad():
            news = _Barrier.apply(after, *olds)
        for new, old in zip(news, olds):
            new.requires_grad_(old.requires_grad)
    out = list(values)
    for i, new in zip(at, news):
        out[i] = new
    return out


def install() -> None:
    install_recompute_inputs(barrier)
