"""Private PyTorch API of Dynamo, FakeTensor and the compile stack used by torchjax.

The compile-side half of torchjax/_compat/torch.py (same rule: every name here is
private upstream API, each use covered by tests/compat/test_compat.py).
"""

from __future__ import annotations

import torch


def dynamo_skip_package(name: str):
    """Tell Dynamo never to trace frames from package ``name``; returns the undo.

    torchjax's Python runs below Dynamo (the device guard answering
    ``torch.accelerator.current_stream`` from Dynamo's generated code,
    ``__torch_dispatch__`` on fake tensors): those frames must run as plain Python, not
    be compiled as user code. Private API (torch._dynamo.trace_rules.add, SKIP_DIRS).
    """
    import torch._dynamo.trace_rules as trace_rules

    before = list(trace_rules.SKIP_DIRS)
    trace_rules.add(name)
    added = [d for d in trace_rules.SKIP_DIRS if d not in before]

    def undo():
        for d in added:
            trace_rules.SKIP_DIRS.remove(d)
        trace_rules._recompile_re()

    return undo


def dynamo_never_trace(code, undo: bool = False, callees: bool = True) -> None:
    """Dynamo runs frames of ``code``, and every frame they call (``callees``; else
    those get Dynamo's default), as plain Python (``undo=True``: Dynamo's default for
    ``code`` again).

    For torchjax's entry points called from C++ (``__torch_dispatch__``, the PrivateUse1
    kernels, the device guard): eager code that runs while Dynamo's callback is active
    (between graph breaks, or modules whose frames Dynamo skips) calls them on real tpu
    tensors, and jax's Python below them must never be offered to Dynamo as user code.
    Free at run time (a per-code flag). Private API (set_code_exec_strategy, through
    torch._C so that torch._dynamo is not imported).
    """
    from torch._C._dynamo.eval_frame import (
        _FrameAction,
        _FrameExecStrategy,
        set_code_exec_strategy,
    )

    action = _FrameAction.DEFAULT if undo else _FrameAction.SKIP
    below = action if callees else _FrameAction.DEFAULT
    set_code_exec_strategy(code, _FrameExecStrategy(action, below))


def install_inductor_route(route) -> None:
    """Offer every graph ``torch.compile``'s default backend receives to ``route(gm,
    example_inputs)`` first; inductor compiles it when ``route`` returns None.

    ``torch.compile(m)`` with the default backend does not go through Dynamo's backend
    registry: it builds a ``torch._TorchCompileInductorWrapper`` (private) and Dynamo calls
    it per graph, so its ``__call__`` is the one place to see the graph's devices.
    """
    from torchjax import _patches

    cls = torch._TorchCompileInductorWrapper
    if _patches.is_recorded("torch._TorchCompileInductorWrapper.__call__"):
        return
    original = cls.__call__

    def __call__(self, model_, inputs_, **kwargs):
        compiled = route(model_, inputs_)
        return original(self, model_, inputs_, **kwargs) if compiled is None else compiled

    __call__.__doc__ = original.__doc__
    _patches.replace_attr(
        cls,
        "__call__",
        __call__,
        name="torch._TorchCompileInductorWrapper.__call__",
        why="graphs on tpu tensors go to the tpu backend, not inductor's torch_tpu codegen",
        package="torch",
        written_for="2.13",
    )


def register_dynamo_backend(name: str, compiler_fn) -> bool:
    """Register ``compiler_fn`` as Dynamo's backend ``name`` (public
    ``torch._dynamo.register_backend``) unless a function is registered under that name
    already; whether it registered. The check reads the registry (private)."""
    from torch._dynamo.backends import registry

    if name in registry._COMPILER_FNS:
        return False
    registry.register_backend(compiler_fn=compiler_fn, name=name)
    return True


def unregister_dynamo_backend(name: str, compiler_fn) -> None:
    """Take ``compiler_fn`` off Dynamo's registry under ``name`` (private: Dynamo has no
    public unregister); an entry point of that name is found again at the next lookup."""
    from torch._dynamo.backends import registry

    if registry._COMPILER_FNS.get(name) is compiler_fn:
        del registry._COMPILER_FNS[name]
        if registry._BACKENDS.get(name) is None:
            registry._BACKENDS.pop(name, None)
        registry._discover_entrypoint_backends.cache_clear()
        registry._lazy_import.cache_clear()


def is_fake_tensor(x) -> bool:
    """Whether ``x`` is one of torch's FakeTensors (``torch._subclasses.fake_tensor``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


def fake_graph_breaks() -> tuple[type, ...]:
    """The exceptions of torch's FakeTensorMode that Dynamo's ``get_fake_value`` turns
    into a graph break (the op then runs eagerly, outside the graph) rather than into its
    ``TorchRuntimeError``: an output whose shape or value depends on data, an operator
    without a fake kernel."""
    from torch._subclasses import fake_tensor

    return (
        fake_tensor.DataDependentOutputException,
        fake_tensor.DynamicOutputShapeException,
        fake_tensor.UnsupportedOperatorException,
    )


def fake_tensor_logger():
    """The logger of torch's FakeTensorMode (``torch._subclasses.fake_tensor``), which
    logs a failing meta kernel's exception, traceback included, at error level before
    raising it."""
    import logging

    return logging.getLogger("torch._subclasses.fake_tensor")


def fake_tensor_mode_class():
    """``torch._subclasses.fake_tensor.FakeTensorMode`` (imported on first use: it loads
    torch's fake-tensor machinery)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode


def dynamo_optimizer_variable_class():
    """``torch._dynamo.variables.optimizer.OptimizerVariable``: how Dynamo traces an
    optimizer's ``step`` (imported on first use, with Dynamo)."""
    from torch._dynamo.variables.optimizer import OptimizerVariable

    return OptimizerVariable


def active_fake_mode():
    """The FakeTensorMode this thread is dispatching under, or None (torch keeps it in a
    slot of its own, apart from the other dispatch modes)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def active_proxy_mode():
    """The make_fx tracing mode (``ProxyTorchDispatchMode``) this thread dispatches under,
    or None; torch keeps it in a slot of its own, as the fake mode."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)


def dynamo_traced(fn):
    """``fn`` wrapped so that Dynamo traces into it although its file is in Dynamo's skip
    list (torchjax's files are: Note [Process-wide changes]); for model code torchjax
    provides, such as a registered experts forward. Private API
    (``torch._dynamo.dont_skip_tracing``); imports torch._dynamo when called."""
    import torch._dynamo

    return torch._dynamo.dont_skip_tracing(fn)


def dynamo_frame_id(gm) -> int | None:
    """The id of the Python frame (function) whose graph ``gm`` Dynamo captured: one per
    function, shared by its recompiles (None where Dynamo set none). Ids start again
    from 0 after ``torch._dynamo.reset()``. Private API: the ``dynamo_compile_id`` entry
    (a ``torch._guards.CompileId``) of ``gm.meta``."""
    return getattr(gm.meta.get("dynamo_compile_id"), "frame_id", None)


def dynamo_first_compile(gm) -> bool:
    """Whether ``gm`` comes from its frame's first compile (``frame_compile_id`` 0):
    after ``torch._dynamo.reset()`` a frame id may name a new function, whose first
    compile this is. Private API as ``dynamo_frame_id``."""
    return getattr(gm.meta.get("dynamo_compile_id"), "frame_compile_id", None) == 0
