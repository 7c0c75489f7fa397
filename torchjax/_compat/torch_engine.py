"""Private PyTorch API of the autograd engine's entry from Python (part of
torchjax/_compat, split from torch.py by subject)."""

from __future__ import annotations

import contextlib
import functools

import torch

_ENTRY = "_engine_run_backward"


def install_backward_entry(wrapper) -> None:
    """Run every ``backward()`` and ``torch.autograd.grad`` through ``wrapper(original,
    *args, **kwargs)``, ``original`` being torch's function.

    torch 2.13 enters the C++ engine from ``torch.autograd.graph._engine_run_backward``,
    which ``torch.autograd`` imports under the same name and calls from ``backward`` and
    ``grad``; both names are replaced (Note [Process-wide changes], undone by
    ``torchjax.uninstall()``)."""
    from torchjax import _patches

    if _patches.is_recorded("torch.autograd.graph._engine_run_backward"):
        return
    original = getattr(torch.autograd.graph, _ENTRY)

    @functools.wraps(original)
    def run_backward(*args, **kwargs):
        return wrapper(original, *args, **kwargs)

    why = "a backward before the tpu device existed left the engine without a tpu queue"
    for owner, name in (
        (torch.autograd.graph, "torch.autograd.graph._engine_run_backward"),
        (torch.autograd, "torch.autograd._engine_run_backward"),
    ):
        _patches.replace_attr(
            owner, _ENTRY, run_backward, name=name, why=why, package="torch", written_for="2.13"
        )


def grad_of(original, root, leaf):
    """``torch.autograd.grad(root, leaf, grad_outputs=root, allow_unused=True)`` through
    ``original`` (torch's ``_engine_run_backward``: outputs, grad_outputs, retain_graph,
    create_graph, inputs, allow_unused, accumulate_grad)."""
    return original((root,), (root,), False, False, (leaf,), True, accumulate_grad=False)


def lacks_device_queue(error: RuntimeError) -> bool:
    """Whether ``error`` is the engine's assert for a device that has no ready queue
    (``Engine::ready_queue``, torch/csrc/autograd/engine.cpp)."""
    return "device_ready_queues_" in str(error)


@contextlib.contextmanager
def without_dispatch_modes():
    """The dispatch modes of the current stack off (a fake or tracing mode among them)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield
