"""Private PyTorch API for moving modules to and from tpu in place: torch's tensor swap
and ``nn.Module._apply`` (part of torchjax/_compat, split from torch.py by subject)."""

from __future__ import annotations

import functools
import threading

import torch


# Note [Moving modules with live references]
# nn.Module._apply (module.to / .cpu / .half) moves a parameter in place, so tied
# weights and optimizer references keep pointing at it. For CPU <-> CUDA it does so with
# ``param.data = moved`` (set_data: the same TensorImpl gets the new storage). For a
# traceable wrapper subclass result (JaxTensor is one, for torch.compile) it always uses
# ``torch.utils.swap_tensors``, which refuses a tensor that anything else references:
# an autograd graph of an earlier forward whose output is alive, an RNN's flat-weights
# graph, a weakref. The swap itself (``torch._C._swap_tensor_impl``) is safe with such
# references: each holder keeps the TensorImpl it had, with its old data, as after
# set_data. torch's check exists for the gradient accumulator of the old TensorImpl,
# which it poisons so that a backward through the stale graph raises; this swap does
# the same for every such accumulator. It applies only when a tpu tensor is on either
# side; every other swap is torch's own.
def _poison_stale_accumulator(t: torch.Tensor) -> None:
    if not (t.requires_grad and t.is_leaf):
        return

    def stale(grad_outputs):
        raise RuntimeError(
            "Trying to execute AccumulateGrad node that was poisoned by swap_tensors: "
            "this graph was built before the module was moved to another device (e.g. "
            "`m.to('tpu')`) and its parameter no longer holds that data. Run forward again "
            "after moving the module."
        )

    torch.autograd.graph.get_gradient_edge(t).node.register_prehook(stale)


def _swap_with_references(t1: torch.Tensor, t2: torch.Tensor) -> None:
    import copyreg

    slots1 = set(copyreg._slotnames(t1.__class__))
    if slots1 != set(copyreg._slotnames(t2.__class__)):
        raise RuntimeError("Cannot swap t1 and t2 if they have different slots")
    for t in (t1, t2):
        if t._use_count() > 1:
            _poison_stale_accumulator(t)
    t1.__class__, t2.__class__ = t2.__class__, t1.__class__
    t1.__dict__, t2.__dict__ = t2.__dict__, t1.__dict__
    for slot in slots1:
        v1, v2 = getattr(t1, slot, _MISSING), getattr(t2, slot, _MISSING)
        for t, v in ((t1, v2), (t2, v1)):
            if v is _MISSING:
                if hasattr(t, slot):
                    delattr(t, slot)
            else:
                setattr(t, slot, v)
    torch._C._swap_tensor_impl(t1, t2)


_MISSING = object()


def install_swap_tensors(applies) -> None:
    """Wrap ``torch.utils.swap_tensors`` so that, when ``applies(t1, t2)``, tensors with
    other live references are swapped (Note [Moving modules with live references]).
    Undone by ``uninstall_swap_tensors``; written for torch 2.13 (its body is
    swap_attr over __class__, __dict__ and slots, then ``torch._C._swap_tensor_impl``)."""
    import torch.utils

    original = torch.utils.swap_tensors
    if getattr(original, "_torchjax_original", None) is not None:
        return

    def swap_tensors(t1, t2):
        if not applies(t1, t2):
            return original(t1, t2)
        return _swap_with_references(t1, t2)

    swap_tensors.__doc__ = original.__doc__
    swap_tensors._torchjax_original = original
    torch.utils.swap_tensors = swap_tensors
    from torchjax import _patches

    _patches.record(
        "torch.utils.swap_tensors",
        why="module.to('tpu') swaps parameters that other live references hold "
        "(Note [Moving modules with live references])",
        package="torch",
        written_for="2.13",
        undo=uninstall_swap_tensors,
    )


def uninstall_swap_tensors() -> None:
    import torch.utils

    original = getattr(torch.utils.swap_tensors, "_torchjax_original", None)
    if original is not None:
        torch.utils.swap_tensors = original


# Note [Moving modules off tpu]
# For a move off tpu (``model.cpu()``, ``model.to("cpu")``) ``Module._apply`` has neither
# of its in-place paths: the CPU result is not a traceable wrapper subclass (no swap),
# and a JaxTensor and a CPU tensor have no compatible shallow-copy type (no set_data).
# So it made a new Parameter per module: tied weights (an LM head and its embedding)
# came back as two parameters, and an optimizer built on tpu held the old ones. A module
# whose own parameters hold a tpu tensor is moved with torch's swap path instead (what
# ``torch.__future__.set_swap_module_params_on_conversion(True)`` selects), for this
# thread and this module's own parameters only: the Parameter objects are kept, so ties
# and optimizer references survive, as CPU <-> CUDA keeps them.
_SWAP_LOCAL = threading.local()


def install_module_moves(holds_device_params) -> None:
    """Wrap ``nn.Module._apply`` and ``torch.__future__.get_swap_module_params_on_conversion``
    (Note [Moving modules off tpu]); written for torch 2.13, both recorded (undone by
    ``torchjax.uninstall()``)."""
    import torch.__future__ as future
    import torch.nn as nn

    from torchjax import _patches

    original_apply = nn.Module._apply
    if getattr(original_apply, "_torchjax_original", None) is not None:
        return
    original_get = future.get_swap_module_params_on_conversion

    def get_swap_module_params_on_conversion() -> bool:
        return getattr(_SWAP_LOCAL, "on", False) or original_get()

    def _apply(self, fn, recurse=True):
        if not holds_device_params(self):
            return original_apply(self, fn, recurse)
        if recurse:
            for module in self.children():
                module._apply(fn)
        before = getattr(_SWAP_LOCAL, "on", False)
        _SWAP_LOCAL.on = True
        try:
            return original_apply(self, fn, False)
        finally:
            _SWAP_LOCAL.on = before

    functools.update_wrapper(get_swap_module_params_on_conversion, original_get)
    functools.update_wrapper(_apply, original_apply)
    _apply._torchjax_original = original_apply
    _patches.replace_attr(
        future,
        "get_swap_module_params_on_conversion",
        get_swap_module_params_on_conversion,
        name="torch.__future__.get_swap_module_params_on_conversion",
        why="True in this thread while a module with tpu parameters is moved "
        "(Note [Moving modules off tpu])",
        package="torch",
        written_for="2.13",
    )
    _patches.replace_attr(
        nn.Module,
        "_apply",
        _apply,
        name="torch.nn.Module._apply",
        why="a module with tpu parameters keeps its Parameter objects (tied weights, "
        "optimizer references) when moved off tpu (Note [Moving modules off tpu])",
        package="torch",
        written_for="2.13",
    )


def module_call():
    """torch's ``nn.Module.__call__`` (``Module._wrapped_call_impl`` in torch 2.13: the
    compiled-call check, then ``_call_impl`` with its hooks), unwrapped if wrapped."""
    import torch.nn as nn

    current = nn.Module.__dict__["__call__"]
    return getattr(current, "_torchjax_original", current)


_MADE: dict = {}  # (make, torch's __call__) -> the wrapper made (set again and again)


def set_module_call(make) -> None:
    """Make ``nn.Module.__call__`` ``make(original)`` (``make=None``: torch's own again).
    Recorded in torchjax/_patches.py while in force (Note [Captured module calls] in
    torchjax/compile/_captured.py); written for torch 2.13, where ``__call__`` is the
    class attribute ``_wrapped_call_impl`` that every module without its own
    ``__call__`` inherits."""
    import torch.nn as nn

    from torchjax import _patches

    original = module_call()
    if make is None:
        if nn.Module.__dict__["__call__"] is not original:
            _patches.undo("torch.nn.Module.__call__")
        return
    if nn.Module.__dict__["__call__"] is not original:
        return  # in force already
    new = _MADE.get((make, original))
    if new is None:
        new = make(original)
        functools.update_wrapper(new, original)
        new._torchjax_original = original
        _MADE[make, original] = new
    _patches.replace_attr(
        nn.Module,
        "__call__",
        new,
        name="torch.nn.Module.__call__",
        why="a repeated tpu module call in fused eager mode runs as one captured "
        "program (Note [Captured module calls])",
        package="torch",
        written_for="2.13",
    )


def calls_run_no_hooks(module) -> bool:
    """Whether calling ``module`` runs its ``forward`` and nothing else: torch's own
    ``nn.Module.__call__`` (not replaced, not a module compiled with ``module.compile()``)
    and no hook of the module's or global ones, the condition of ``_call_impl``'s fast
    path in torch 2.13."""
    from torch.nn.modules import module as m

    return (
        type(module).__call__ is module_call() is m.Module._wrapped_call_impl
        and type(module)._call_impl is m.Module._call_impl
        and getattr(module, "_compiled_call_impl", None) is None
        and not (
            module._backward_hooks
            or module._backward_pre_hooks
            or module._forward_hooks
            or module._forward_pre_hooks
            or m._global_backward_pre_hooks
            or m._global_backward_hooks
            or m._global_forward_hooks
            or m._global_forward_pre_hooks
        )
    )
