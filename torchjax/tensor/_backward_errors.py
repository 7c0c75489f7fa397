"""Errors raised by tpu ops during ``backward()``: re-raised at the end of the pass.

Note [Errors inside the autograd engine]
When an op fails in ``__torch_dispatch__``, torch's Python fallback throws a C++
``python_error`` that leaves the Python error indicator set while the stack unwinds. The
autograd engine, unwinding through ``evaluate_function``, destroys a stream guard for the
tpu device; torch's Python device guard (``torch._C._acc``) calls back into Python from
that ``noexcept`` destructor, the call fails because an error is pending, and the process
aborts ("terminate called without an active exception"). So an op failing during the
backward pass must not raise there. Instead it returns zero-filled outputs of the right
metadata (from the op run on meta tensors) and queues an engine callback that raises the
original exception when the pass ends: ``loss.backward()`` raises it, with its message
and traceback, exactly as it would on CPU. Outside the engine, errors raise directly.
A gradient hook registered on a tpu tensor (``register_hook``,
``register_post_accumulate_grad_hook``) that raises aborts the same way, so its error
also waits for the end of the pass (``guarded``), the gradient passing on unchanged.
So does an unpack hook of ``torch.autograd.graph.saved_tensors_hooks`` (a user's own, or
non-reentrant checkpointing's, whose ``CheckpointError`` reports a recomputation that
differs from the forward) unpacking a tpu tensor: the pass goes on with zeros of the
saved tensor's metadata in its place (``_SavedHooks``).

CPU stops the pass at the first error, so nothing below the failing node runs. Here the
pass goes on, with zeros for the failed value, and would leave gradients computed from
them in the leaves' ``.grad``, which a loop that catches the error and steps its
optimizer would use. So when an error is deferred, the ``.grad`` of every leaf below the
failing node is saved (value and tensor object) and put back when the pass ends, just
before the error is raised; and once a pass holds an error, gradient hooks on tpu
tensors no longer run (on CPU they would not be reached). Leaves on other branches that
the pass reaches after the error keep their gradients, which are right but which CPU,
stopping at the error, may not have accumulated.
"""

from __future__ import annotations

import functools
import threading

import torch

from torchjax import _patches
from torchjax._compat.torch import (
    current_autograd_node,
    graph_task_id,
    in_graph_task,
    push_saved_tensors_default_hooks,
    pytree,
    queue_engine_callback,
)
from torchjax._compat.torch_dynamo import dynamo_never_trace

_state = threading.local()


def in_backward() -> bool:
    return in_graph_task()


def defer(func, args, kwargs, error: BaseException):
    """Queue ``error`` to raise at the end of the running backward pass and return
    placeholder outputs for ``func``; re-raise ``error`` if no placeholder can be made."""
    from torchjax.tensor._tensor import JaxTensor

    def to_meta(x):
        if isinstance(x, JaxTensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return x

    try:
        meta_out = func(*pytree.tree_map(to_meta, args), **pytree.tree_map(to_meta, kwargs))
    except Exception:
        raise error from None

    def placeholder(m):
        if isinstance(m, torch.Tensor) and m.device.type == "meta":
            return _zeros(tuple(m.shape), m.dtype)
        return m

    raise_later(error)
    schema = func._schema
    if schema.returns and schema.arguments and schema.arguments[0].alias_info is not None:
        if schema.arguments[0].alias_info.is_write:
            return args[0]  # in-place: torch expects self back
    return pytree.tree_map(placeholder, meta_out)


def _zeros(shape: tuple, dtype: torch.dtype, device_index: int = 0):
    """A tpu tensor of zeros: what stands in for a value the pass could not compute
    while its error waits for the pass to end."""
    import jax.numpy as jnp

    from torchjax.tensor._tensor import wrap
    from torchjax.tensor.dtypes import to_jax_dtype

    return wrap(jnp.zeros(shape, to_jax_dtype(dtype)), device_index)


def raise_later(error: BaseException) -> None:
    """Raise ``error`` when the running backward pass ends (the first error of a pass
    wins, as the first raised on CPU would), the ``.grad`` of the leaves below the
    failing node as they were before it."""
    task = graph_task_id()
    if getattr(_state, "task", None) != task:
        _state.task, _state.saved = task, {}
        saved = _state.saved

        def reraise():
            _state.task = _state.saved = None
            _restore_grads(saved)
            raise error

        queue_engine_callback(reraise)
    _save_grads_below(current_autograd_node(), _state.saved)


def error_pending() -> bool:
    """Whether the running backward pass already holds an error to raise at its end."""
    task = getattr(_state, "task", None)
    return task is not None and task == graph_task_id()


def _save_grads_below(node, saved: dict) -> None:
    # A leaf's AccumulateGrad runs only once every path into it has, so a leaf below a
    # failing node has not been reached yet: its .grad is still the one from before the
    # pass. (The nodes' Python objects are cached per node, so a set dedupes a diamond.)
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        leaf = getattr(n, "variable", None)
        if isinstance(leaf, torch.Tensor) and id(leaf) not in saved:
            grad = leaf.grad
            saved[id(leaf)] = (leaf, grad, None if grad is None else grad.detach().clone())
        stack.extend(f for f, _ in n.next_functions)


def _restore_grads(saved: dict) -> None:
    # Accumulation may have added into the old .grad in place, or replaced it: put back
    # both the value and the tensor object, as CPU leaves them.
    with torch.no_grad():
        for leaf, grad, value in saved.values():
            if grad is not None:
                grad.copy_(value)
            leaf.grad = grad


def raise_in_engine_safely(error: BaseException) -> None:
    """Raise ``error`` now outside a backward pass; inside one, when the pass ends."""
    if not in_backward():
        raise error
    raise_later(error)


def guarded(hook):
    """``hook`` (a gradient hook run by the engine), its exceptions raised when the pass
    ends instead of inside the engine, where they would abort the process (Note [Errors
    inside the autograd engine]); the gradient passes on unchanged meanwhile. Once the
    pass holds an error, the hook is not run: CPU would have stopped before it."""

    @functools.wraps(hook)
    def run(*args):
        if error_pending():
            return None
        try:
            out = hook(*args)
        except Exception as error:
            raise_in_engine_safely(error)
            return None
        if out is not None and not isinstance(out, torch.Tensor):
            # torch's own refusal of this result, raised in the engine, aborted too.
            raise_in_engine_safely(
                TypeError(f"expected Variable, but hook returned '{type(out).__name__}'")
            )
            return None
        return out

    return run


class _SavedOnTpu:
    """What a pack hook returned for a tpu tensor, with that tensor's metadata."""

    __slots__ = ("packed", "shape", "dtype", "device_index")

    def __init__(self, packed, t):
        self.packed, self.shape, self.dtype = packed, tuple(t.shape), t.dtype
        self.device_index = t._device_index


class _SavedHooks:
    """A pack and unpack hook as the engine gets them: an unpack of a tpu tensor that
    raises inside a backward pass raises when the pass ends (Note [Errors inside the
    autograd engine]). Other tensors' values pass through untouched."""

    __slots__ = ("pack_hook", "unpack_hook")

    def __init__(self, pack_hook, unpack_hook):
        self.pack_hook, self.unpack_hook = pack_hook, unpack_hook

    def pack(self, t):
        from torchjax.tensor._tensor import JaxTensor

        packed = self.pack_hook(t)
        return _SavedOnTpu(packed, t) if isinstance(t, JaxTensor) else packed

    def unpack(self, p):
        if p.__class__ is not _SavedOnTpu:
            return self.unpack_hook(p)
        try:
            return self.unpack_hook(p.packed)
        except Exception as error:
            raise_in_engine_safely(error)
            return _zeros(p.shape, p.dtype, p.device_index)


def _enter_saved_tensors_hooks(self) -> None:
    hooks = _SavedHooks(self.pack_hook, self.unpack_hook)
    push_saved_tensors_default_hooks(hooks.pack, hooks.unpack)


def install_saved_hooks_guard() -> None:
    # torch.compile must treat the replacement as it did torch's method, a frame it
    # does not trace (torch/autograd is on its skip list); the hooks' frames too, but not
    # the user's hooks they call.
    dynamo_never_trace(_enter_saved_tensors_hooks.__code__)
    for method in (_SavedHooks.pack, _SavedHooks.unpack):
        dynamo_never_trace(method.__code__, callees=False)
    _patches.replace_attr(
        torch.autograd.graph.saved_tensors_hooks,
        "__enter__",
        _enter_saved_tensors_hooks,
        name="torch.autograd.graph.saved_tensors_hooks.__enter__",
        why="an unpack hook raising on a tpu tensor inside backward() aborted the process",
        package="torch",
        written_for="2.13",
    )
