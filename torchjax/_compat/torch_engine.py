"""Private PyTorch API of the autograd engine's entry from Python (part of
torchjax/_compat, split from torch.py by subject)."""

from __future__ import annotations

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

    why = "tpu nodes run on the thread that calls backward (no tpu engine thread)"
    for owner, name in (
        (torch.autograd.graph, "torch.autograd.graph._engine_run_backward"),
        (torch.autograd, "torch.autograd._engine_run_backward"),
    ):
        _patches.replace_attr(
            owner, _ENTRY, run_backward, name=name, why=why, package="torch", written_for="2.13"
        )


def install_custom_backward_outputs(after) -> None:
    """Pass what every custom ``torch.autograd.Function``'s backward returns through
    ``after(node, result)``, whose return the engine then takes.

    The engine runs a custom Function's backward through its node's
    ``BackwardCFunction.apply`` (``apply_boxed`` when the Function sets
    ``boxed_grads_call``), looked up on the node's class at each call; both are replaced
    on ``torch.autograd.function.BackwardCFunction`` (an internal class: Note
    [Process-wide changes], undone by ``torchjax.uninstall()``)."""
    from torchjax import _patches

    cls = torch.autograd.function.BackwardCFunction
    if _patches.is_recorded("torch.autograd.function.BackwardCFunction.apply"):
        return
    originals = {name: cls.__dict__[name] for name in ("apply", "apply_boxed")}

    def wrap(original):
        @functools.wraps(original)
        def method(self, *args):
            return after(self, original(self, *args))

        return method

    _patches.replace_attrs(
        cls,
        {name: wrap(original) for name, original in originals.items()},
        name="torch.autograd.function.BackwardCFunction.apply",
        why="a custom Function's gradient on another device than its tpu input was accepted",
        package="torch",
        written_for="2.13",
    )


def edge_input_device(node, input_nr: int) -> torch.device:
    """The device of the tensor that flows into input ``input_nr`` of autograd node
    ``node`` (the engine's ``InputMetadata``; ``Node._input_metadata`` is private)."""
    return node._input_metadata[input_nr].device


def edge_input_shape(node, input_nr: int) -> tuple:
    """The shape the engine expects at input ``input_nr`` of ``node`` (its
    ``InputMetadata``)."""
    return tuple(node._input_metadata[input_nr].shape)
