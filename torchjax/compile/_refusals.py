"""The errors a ``torchjax.jit`` trace raises for what a compiled function cannot do to
its caller's tensors (Note [Writes that escape a trace] in torchjax/tensor/_storage.py,
Note [Gradients that escape a trace] in torchjax/compile/_escaped_grads.py, Note
[Arguments restrided in place] below)."""

from __future__ import annotations

_ESCAPED = (
    "torchjax.jit({}) wrote in place to a tpu tensor that is not part of its state ({}): "
    "a tensor the function reaches only where its state walk does not look (an object "
    "with __slots__, a C extension, a global that only a callee names) is read as a "
    "constant of the program, so the write would be lost. The tensor is left as it was "
    "before the call. Keep it on a module (module.register_buffer(name, tensor)), or pass "
    "it as an argument or in a container the function takes (Note [State of a jitted "
    "function])."
)

_ESCAPED_GRAD = (
    "torchjax.jit({}) ran a backward that accumulates into the .grad of a tpu tensor "
    "that is not part of its state ({}): a tensor the function reaches only through a "
    "functools.partial, a closure's closure or a container it does not take is a "
    "constant of the program, so its gradient would be lost. Its .grad is left as it was "
    "before the call. Pass the tensor as an argument, or make it a parameter of a module "
    "the function uses (Note [State of a jitted function])."
)

# Note [Arguments restrided in place]: a program's outputs are new tensors, so an in-place
# change of an argument's sizes or strides (``x.t_()``, ``unsqueeze_``, ``resize_``,
# ``as_strided_``) cannot reach the caller's tensor; it was dropped without a word (the
# caller's ``x`` kept its shape, the result was another tensor). It is refused instead.
_RESTRIDED = (
    "torchjax.jit({}) changed the sizes or strides of tensor argument {} in place (shape "
    "{} became {}: t_, transpose_, unsqueeze_, squeeze_, resize_ or as_strided_); a "
    "compiled function cannot change its caller's tensor metadata. Use the out-of-place "
    "op (x = x.t()) and return the result, or run this outside torchjax.jit."
)


def _described(storage) -> str:
    """Shape and dtype of a storage, as a user would recognise the tensor."""
    lazy = storage.lazy
    dtype = lazy[1] if isinstance(lazy, list) else storage.arr.dtype
    return f"shape {tuple(storage.shape)}, {dtype}"


def escaped_write(name: str, storage) -> RuntimeError:
    return RuntimeError(_ESCAPED.format(name, _described(storage)))


def escaped_grad(name: str, tensor) -> RuntimeError:
    return RuntimeError(_ESCAPED_GRAD.format(name, f"shape {tuple(tensor.shape)}, {tensor.dtype}"))


def restrided(name: str, position: int, before, after) -> RuntimeError:
    return RuntimeError(_RESTRIDED.format(name, position, before, after))


# Note [Outputs that retain their gradient]
# ``y.retain_grad()`` inside the function, on a tensor it returns, asks in eager that a
# backward through ``y`` fill ``y.grad`` with everything that flows into ``y``, the
# function's own later uses of it included. Outside the program, ``y`` and what the
# function computed from it (a loss) are sibling outputs of one call: no gradient flows
# from one into the other, so ``y.grad`` could only hold what flows in from outside.
# Rather than fill it with part of the gradient, or leave it silently None, the trace
# warns; torch.compile(backend="tpu") breaks its graph at ``retain_grad`` and fills it.
RETAINED = (
    "torchjax.jit: a tensor the function returns called retain_grad() inside it; its "
    ".grad is not filled by a backward through the compiled program. Call "
    "retain_grad() outside, on a tensor that the loss is computed from after the call, "
    "or use torch.compile(backend='tpu'), which runs retain_grad() between graphs."
)

# Note [Learning rates assigned while tracing] (torchjax/compile/_hyper.py).
LR_ASSIGNED = (
    "torchjax.jit({}): the function sets an optimizer's lr (scheduler.step() inside "
    "it); a compiled step cannot repeat a schedule that advances in Python, and the "
    "traced lr would be lost. Call scheduler.step() after the jitted call: the lr is an "
    "input of the compiled step, so the schedule then costs no retrace."
)

# What a trace that wrote a CPU tensor of the state says (Note [CPU tensors in the
# state] in torchjax/compile/_state.py).
HOST_WRITES = (
    "torchjax.jit({}): the function writes a CPU tensor in place (a counter, a CPU "
    "buffer); a compiled program cannot repeat a CPU write, so every call traces the "
    "function again, which repeats it. Keep that tensor on tpu (.to('tpu')) to compile "
    "the function once (Note [CPU tensors in the state])."
)
