"""Gradients a custom ``torch.autograd.Function`` returns for tpu tensors.

Note [Gradient devices of custom Functions]
torch's autograd engine checks each gradient a node returns against the input it flows
into (``validate_outputs``, torch/csrc/autograd/engine.cpp): its count, shape, dtype,
layout and device. The device check is skipped when that input is a tensor subclass or
the gradient is a Python-dispatch tensor, and every tpu tensor is both, so a custom
Function whose backward returned a CPU tensor for a tpu input was accepted: the CPU
gradient went on into the tpu graph and a tpu leaf got a CPU ``.grad``, where CUDA
raises "Function XBackward returned an invalid gradient at index 0 - expected device
cuda:0 but got cpu". Nodes whose gradients torch's formulas compute from tpu tensors
are on tpu by construction; a custom Function's come from user code, through
``BackwardCFunction.apply``, whose results pass through ``check`` here (installed by
torchjax/device/_registration.py through _compat/torch_engine.py). Where a gradient and
its input are on different devices and one of them is tpu, the engine's own rule is
applied: a 0-d gradient is moved to the input's device, any other raises torch's
RuntimeError, word for word (device types only: which tpu index an array is placed on
is torchjax's business, under a mesh). A wrong count or shape is left to the engine, whose check
of those comes first. Under torchjax.jit and torch.compile(backend="tpu") the backward
runs inside the trace and meets the same check. Cost: one pass over the gradients and
the node's edges per custom Function backward; nothing elsewhere.
"""

from __future__ import annotations

import torch

from torchjax._compat.torch_engine import (
    edge_input_device,
    edge_input_shape,
    install_custom_backward_outputs,
)

_TPU = "tpu"


def _expandable(shape: tuple, to: tuple) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``to`` (the engine then sums the
    gradient down to ``shape``)."""
    if len(shape) > len(to):
        return False
    return all(a in (1, b) for a, b in zip(shape[::-1], to[::-1]))


def check(node, result):
    """``result`` of ``node``'s backward, its gradients checked against the devices of
    the inputs they flow into (Note [Gradient devices of custom Functions])."""
    grads = result if isinstance(result, tuple) else (result,)
    needs = node.needs_input_grad  # one per forward input, tensor or not
    if len(grads) < len(needs):
        return result  # the engine's count check raises
    edges = node.next_functions  # one per tensor input; None where it needs no grad
    valid = [j for j, (target, _) in enumerate(edges) if target is not None]
    wanted = [i for i, need in enumerate(needs) if need]
    if len(valid) != len(wanted):
        return result
    moved = None
    for i, j in zip(wanted, valid):
        grad = grads[i]
        if not isinstance(grad, torch.Tensor):
            continue
        target, nr = edges[j]
        device = edge_input_device(target, nr)
        kinds = (grad.device.type, device.type)
        if kinds[0] == kinds[1] or _TPU not in kinds:
            continue  # tpu:i against tpu:j is torchjax's placement, not a user's mistake
        shape = edge_input_shape(target, nr)
        if tuple(grad.shape) != shape and not _expandable(shape, tuple(grad.shape)):
            continue  # the engine's shape check raises first
        if grad.dim() != 0:
            raise RuntimeError(
                f"Function {type(node).__name__} returned an invalid gradient at index {j} "
                f"- expected device {device} but got {grad.device}"
            )
        moved = list(grads) if moved is None else moved
        moved[i] = grad.to(device)
    return result if moved is None else tuple(moved)


def install() -> None:
    install_custom_backward_outputs(check)
