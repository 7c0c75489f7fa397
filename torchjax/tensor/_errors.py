"""Errors that escape an op: torch's exception types, messages naming the op.

Note [One error layer]
A lowering is written in jax.numpy, so a call torch would refuse (shapes that do not
broadcast, a repeated dim, a negative size) is refused by JAX or numpy instead, with their
types (``ValueError``, ``TypeError``) and texts (``Incompatible shapes for broadcasting``)
that say nothing about the torch call. Every exception leaving ``__torch_dispatch__`` or a
PrivateUse1 kernel passes through ``translate``:

- Errors raised on purpose, by torchjax or torch code (``RuntimeError`` with our message,
  a device-side check, torch's own checks in decompositions), pass unchanged, their
  text naming the op where it does not yet (``verbatim`` ones, torch's exact text for
  the call, excepted).
- An error raised inside JAX or numpy is replaced by what torch raises for the same call:
  the op runs again on meta tensors of the same sizes, strides and dtypes; torch's meta
  kernels make the shape, dim and dtype checks of the real ones, so their exception gives
  the type and text, with the ATen overload added. When meta accepts the call (or has no
  kernel), the failure is torchjax's own: a ``RuntimeError`` naming the overload and its
  arguments, saying so. The JAX exception is always the ``__cause__``. An op of a
  composite's decomposition that fails this way is translated where it fails; the
  composite passes that error on as it is (its own meta kernel would word the failure
  of the whole, not the failing op CPU names).
- Under a trace (``torchjax.jit``, ``jax.jit`` over torchjax.functional) JAX refuses to
  read values (``if t:``, ``.item()``, ``x[mask]``): ``DataDependentError`` names the op and
  the user's line, and says what to write instead (Note [Where a data-dependent op was
  written]). A traced tensor kept past its trace gives ``LeakedTracerError``. Both are
  ``RuntimeError``, as torch's own data-dependent errors (``GuardOnDataDependentSymNode``)
  are.

This runs only on the error path: the hot path is one ``try``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import sys
import traceback

import jax
import torch

from torchjax._compat.torch import OpOverload, infer_size, pytree

__all__ = ["DataDependentError", "LeakedTracerError", "TraceError", "describe_args", "translate"]


class TraceError(RuntimeError):
    """An op cannot run under a trace as written (see the subclasses)."""


class DataDependentError(TraceError):
    """An op needs tensor values (a Python branch, ``.item()``, a value-dependent output
    shape) while they are being traced.

    ``op`` names the ATen op; ``nodes`` holds ``(graph module, node)`` for each FX graph
    being run when it was raised, innermost first (empty outside FX graphs)."""

    op: str = ""
    nodes: tuple = ()


class LeakedTracerError(TraceError):
    """A tensor produced inside a traced function was used after the trace ended."""


_CONCRETE = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)

# Where a frame belongs to a library rather than to the caller's code.
_FOREIGN_DIRS = tuple(
    os.sep + name + os.sep for name in ("jax", "jaxlib", "numpy", "ml_dtypes", "opt_einsum")
)
# Frames skipped when looking for the user's line: the libraries between it and the op.
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (torch, jax, __import__("jaxlib"), __import__("numpy"))
) + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)
_STDLIB_DIR = os.path.dirname(os.path.abspath(traceback.__file__)) + os.sep


# Ops that read a value into Python.
_READS = {"_local_scalar_dense", "is_nonzero", "item", "equal", "allclose", "_assert_async"}
# Ops whose output shape depends on values.
_VALUE_SHAPED = {
    "nonzero",
    "masked_select",
    "index",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "repeat_interleave",
    "bincount",
    "argwhere",
    "masked_scatter",
    "histc",
}

# Ops whose meta kernels cannot judge the call (they need values).
_VALUE_DEPENDENT = _READS | _VALUE_SHAPED


def describe_args(args, kwargs) -> str:
    """``(Tensor[float32, (4,)] on tpu:0, 1, dim=0)``: the call as a user would read it."""

    def one(a):
        if isinstance(a, torch.Tensor):
            dt = str(a.dtype).removeprefix("torch.")
            return f"Tensor[{dt}, {tuple(a.shape)}] on {a.device}"
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(one(x) for x in a) + "]"
        return repr(a)

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def op_name(func) -> str:
    name = getattr(func, "_opname", None)
    if name is None:
        return str(func)
    return f"{getattr(func, 'namespace', 'aten')}::{name}.{func._overloadname}"


def translate(func, args, kwargs, error: BaseException) -> BaseException | None:
    """The exception to raise instead of ``error`` (chain it: ``raise new from error``),
    or None when ``error`` is already what torch would raise (Note [One error layer])."""
    if getattr(error, "_torchjax_translated", False):
        # An op inside this one's decomposition raised it and translated it already: its
        # JAX ``__cause__`` is not this op's failure, and the inner op's text is the one
        # CPU gives (its composite kernel runs the same inner op).
        return None
    torch_error = _translate(func, args, kwargs, error)
    if torch_error is not None:
        torch_error._torchjax_translated = True
    return torch_error


def _translate(func, args, kwargs, error: BaseException) -> BaseException | None:
    if isinstance(error, TraceError) or not isinstance(error, Exception):
        return None
    if isinstance(error, _CONCRETE):
        nodes = graph_nodes()
        torch_error = DataDependentError(_data_dependent_message(func, error, nodes))
        torch_error.op, torch_error.nodes = op_name(func), nodes
        return torch_error
    if isinstance(error, jax.errors.UnexpectedTracerError):
        return LeakedTracerError(_leak_message(func))
    foreign = _from_jax(error)
    if not foreign and not _python_error_in_a_lowering(error):
        _name_the_op(func, error)
        return None
    if _out_of_memory(error):
        return torch.OutOfMemoryError(
            f"{op_name(func)}{describe_args(args, kwargs)}: the device is out of memory "
            f"({_first_line(error)}). Free tensors you no longer need (del, or move them to "
            "CPU), or use smaller batches."
        )
    if getattr(func, "_opname", "") not in _VALUE_DEPENDENT:
        refusal = _torch_refusal(func, args, kwargs)
        if refusal is not None:
            return refusal
    if not foreign:
        _name_the_op(func, error)
        return None
    return RuntimeError(
        f"torchjax could not run {op_name(func)}{describe_args(args, kwargs)}: JAX refused "
        f"it ({type(error).__name__}: {_first_line(error)}). torch's shape and dtype checks "
        "accept these arguments, so either a value is out of the op's range or torchjax's "
        "lowering lacks a check or a case; the same call on CPU (.cpu()) shows torch's "
        "answer."
    )


# Exceptions whose text gets the op's name added: torch's checks (``torch._check`` in a
# decomposition, a lowering quoting torch's text) often say what is wrong, not where.
_PLAIN = (RuntimeError, IndexError, ValueError, TypeError, NotImplementedError)


def _name_the_op(func, error: BaseException) -> None:
    args = error.args
    if type(error) not in _PLAIN or len(args) != 1 or not isinstance(args[0], str):
        return
    if "aten::" in args[0] or not hasattr(func, "_opname"):
        return
    if getattr(error, "_torchjax_verbatim", False):
        return
    error.args = (f"{args[0]} (in {op_name(func)})",)


def _innermost_file(error: BaseException) -> str:
    tb = error.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    return "" if last is None else last.tb_frame.f_code.co_filename


_PYTHON_ERRORS = (
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    AssertionError,
    ZeroDivisionError,
    OverflowError,
)
_TORCHJAX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _python_error_in_a_lowering(error: BaseException) -> bool:
    # A ValueError/TypeError/... raised by Python itself inside torchjax's code (an
    # unpacking, a conversion) rather than one of its messages: torch's answer for the
    # call, if it refuses it, is the right one.
    if type(error) not in _PYTHON_ERRORS or getattr(error, "_torchjax_deliberate", False):
        return False
    return os.path.abspath(_innermost_file(error)).startswith(_TORCHJAX_DIR)


def deliberate(error: BaseException) -> BaseException:
    """Mark a TypeError/ValueError/... that torchjax raises as torch's answer, so that
    ``translate`` keeps it (unmarked, one raised inside torchjax's code is taken for a
    Python slip and replaced by torch's own refusal of the call)."""
    error._torchjax_deliberate = True
    return error


def verbatim(error: BaseException) -> BaseException:
    """Mark an error whose text is torch's own for the call, word for word (CPU's
    ``ZeroDivisionError``): ``translate`` passes it without adding the op's name, so the
    text is the same whether an op, a synchronisation point or a compiled call raises it
    (Note [Device-side checks] in torchjax/device/_checks.py)."""
    error._torchjax_verbatim = True
    return error


def _from_jax(error: BaseException) -> bool:
    """Raised inside JAX or numpy: by its class, or a plain ValueError/TypeError/... whose
    innermost frame is theirs or that carries the note JAX adds when it hides its frames
    (``jax_traceback_filtering``). RuntimeError, IndexError and NotImplementedError are
    torch's and torchjax's own: JAX raises its own classes for runtime failures, and it
    adds that note to every exception passing through a jit, deliberate ones included."""
    seen = 0
    while error is not None and seen < 4:
        if (type(error).__module__ or "").split(".")[0] in ("jax", "jaxlib", "numpy"):
            return True
        if type(error) in _PYTHON_ERRORS:
            if any(d in _innermost_file(error) for d in _FOREIGN_DIRS):
                return True
            notes = getattr(error, "__notes__", ())
            if any("JAX has removed its internal frames" in n for n in notes):
                return True
        error, seen = error.__cause__, seen + 1
    return False


def _out_of_memory(error: BaseException) -> bool:
    return "RESOURCE_EXHAUSTED" in str(error) or "Out of memory" in str(error)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def to_meta(x):
    """``x`` (a tensor, or a list or tuple of them and other values) with every tensor a
    meta tensor of its sizes, strides and dtype."""
    if isinstance(x, torch.Tensor):
        if x.is_meta:
            return x
        return torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(to_meta(y) for y in x)
    return x


def _torch_refusal(func, args, kwargs) -> BaseException | None:
    """What torch raises for this call, found by running it on meta tensors; None when
    meta accepts it or cannot tell (no meta kernel)."""
    if not isinstance(func, OpOverload):
        return None
    try:  # every tensor is a plain meta tensor: nothing reaches __torch_dispatch__
        func(*to_meta(list(args)), **{k: to_meta(v) for k, v in kwargs.items()})
    except NotImplementedError:
        return None
    except Exception as refusal:  # torch's own check: its type, its text, the op named
        message = f"{_eager_text(refusal, args, kwargs, func)} (in {op_name(func)})"
        try:
            return type(refusal)(message)
        except Exception:
            return RuntimeError(message)
    return None


# Ops whose CPU kernel broadcasts its operands in another order than the schema's
# (masked_fill expands the mask against self: ``expand_outplace(mask, self)``; its
# in-place form names self first, as the schema does).
_BROADCAST_ORDER = {"masked_fill": (1, 0)}


def _eager_text(refusal: BaseException, args, kwargs, func=None) -> str:
    """The refusal's text as CPU gives it. The meta kernels of pointwise ops are torch's
    Python references, whose broadcast check words it otherwise ("Attempting to
    broadcast a dimension ..."); eager's TensorIterator folds the operands' shapes in
    order, as ``infer_size`` does, and says which sizes differ."""
    text = str(refusal)
    if not text.startswith("Attempting to broadcast a dimension"):
        return text
    leaves = pytree.arg_tree_leaves(*args, **kwargs)
    shapes = [torch.Size(t.shape) for t in leaves if isinstance(t, torch.Tensor)]
    order = _BROADCAST_ORDER.get(getattr(func, "_opname", ""))
    if order is not None and len(shapes) >= len(order):
        shapes = [shapes[i] for i in order] + shapes[len(order) :]
    try:
        shape = shapes[0]
        for other in shapes[1:]:
            shape = infer_size(shape, other)
    except (RuntimeError, IndexError) as eager:
        return str(eager)
    return text


def user_frame() -> str:
    """``file:line: code`` of the innermost caller outside torch, jax, torchjax and the
    standard library: the line of the user's code that reached the op."""
    for frame in reversed(traceback.extract_stack()):
        name = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or name.startswith(_LIBRARY_DIRS):
            continue
        if name.startswith(_STDLIB_DIR) and "site-packages" not in name:
            continue
        code = f": {frame.line.strip()}" if frame.line else ""
        return f"{frame.filename}:{frame.lineno}{code}"
    return "(no caller outside torch, jax and torchjax)"


_PRINTING = ("__repr__", "__str__", "__format__")
_TENSOR_FILES = tuple(
    os.path.join(*parts) for parts in [("torch", "_tensor_str.py"), ("torch", "_tensor.py")]
) + (os.path.join("torchjax", "tensor", "_tensor.py"),)


def _printing() -> bool:
    """Whether the refused op runs for a tensor's printing (print, repr, str, format)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_TENSOR_FILES) and (
            code.co_name in _PRINTING or code.co_filename.endswith(_TENSOR_FILES[0])
        ):
            return True
        frame = frame.f_back
    return False


# Note [Where a data-dependent op was written]
# A Dynamo graph (and any torch.fx GraphModule) runs as generated code, one line per node,
# so the innermost frame outside torch and torchjax is the compiled function's ``def``
# line, not the line that made the op. Each generated line maps to its node
# (``GraphModule._lineno_map``), and Dynamo records the user's stack at each node
# (``node.meta["stack_trace"]``): the message names that line, and the backend knows which
# node to run eagerly (Note [Data-dependent ops in compiled graphs] in
# torchjax/compile/_host_parts.py). The advice depends on who traces: under
# ``torchjax.jit`` ``torch.compile(backend="tpu")`` is a way out, since it runs such an op
# eagerly; under that backend the message says that it does (``compiled_graph()``).
_IN_COMPILED_GRAPH = contextvars.ContextVar("torchjax_in_compiled_graph", default=False)


@contextlib.contextmanager
def compiled_graph():
    """Ops traced inside are traced for torch.compile(backend="tpu")'s graph, whose
    data-dependent ops run eagerly: their messages say so instead of advising it."""
    token = _IN_COMPILED_GRAPH.set(True)
    try:
        yield
    finally:
        _IN_COMPILED_GRAPH.reset(token)


def graph_nodes() -> tuple:
    """``(graph module, node)`` for each FX GraphModule whose generated code is on the
    stack now, innermost first: the node its current line runs."""
    found = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "forward" and frame.f_code.co_filename.startswith("<"):
            gm = frame.f_locals.get("self")
            node = _node_at(gm, frame.f_lineno)
            if node is not None:
                found.append((gm, node))
        frame = frame.f_back
    return tuple(found)


def _node_at(gm, lineno: int):
    lines = getattr(gm, "_lineno_map", None)
    if not isinstance(gm, torch.fx.GraphModule) or not lines:
        return None
    index = lines.get(lineno - getattr(gm, "_prologue_start", 0))
    nodes = list(gm.graph.nodes)
    return nodes[index] if index is not None and 0 <= index < len(nodes) else None


_STACK_LINE = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n[ \t]*([^\n]*)')


def _node_location(nodes) -> str | None:
    """``file:line: code`` of the user's line that made the innermost node recorded with
    a stack (Dynamo's ``stack_trace``), or None."""
    for _, node in nodes:
        found = _STACK_LINE.findall(node.meta.get("stack_trace") or "")
        if found:
            filename, lineno, code = found[-1]
            return f"{filename}:{lineno}" + (f": {code.strip()}" if code.strip() else "")
    return None


# Ops that write one value per selected element of a mask (``x[mask] = values``).
_MASKED_WRITES = {"index_put", "index_put_", "_index_put_impl", "_index_put_impl_"}


def _data_dependent_message(func, error, nodes=()) -> str:
    name = op_name(func)
    at = _node_location(nodes) or user_frame()
    base = getattr(func, "_opname", "")
    compiled = _IN_COMPILED_GRAPH.get()
    if compiled:
        way_out = (
            'torch.compile(backend="tpu") runs it eagerly, outside the compiled program, '
            "at each call (the rest of the graph stays compiled). To keep it compiled, "
            "write it with fixed shapes"
        )
        outside = ""
    else:
        way_out = (
            "Under a trace (torchjax.jit, jax.jit) values are not known, only shapes, and "
            "every shape must be fixed. Write it with fixed shapes instead"
        )
        outside = (
            '; or move it out of the traced function, or use torch.compile(fn, backend="tpu"),'
            " which runs that op eagerly"
        )
    if _printing():
        on_value = (
            ""
            if compiled
            else '; or use torch.compile(fn, backend="tpu"), which runs the print on the value'
        )
        return (
            f"printing a tensor's values (print, repr, str, an f-string) inside a traced "
            f"function ({name}), called at {at}. Under a trace (torchjax.jit, jax.jit) the "
            "function runs once to be traced and tensors have shapes and dtypes but no "
            "values yet: print(t.shape, t.dtype) works there. To see values: "
            'torchjax.debug_print("t = {}", t), which the compiled program prints each '
            "time it runs (jax.debug.print); or return the tensor and print it outside"
            f"{on_value} (Note [Printing inside a traced function])."
        )
    if base in _MASKED_WRITES:
        return (
            f"{name} writes one value per element a mask selects (x[mask] = values, "
            f"x[mask] += 1), and how many it selects depends on the mask's values, called "
            f"at {at}. {way_out}: a value that broadcasts "
            "(x[mask] = 0), torch.where(mask, x + 1, x), or x.masked_scatter(mask, values)"
            f"{outside}."
        )
    if base in _VALUE_SHAPED or isinstance(error, jax.errors.NonConcreteBooleanIndexError):
        return (
            f"{name} has an output shape that depends on tensor values (x[mask], "
            f"torch.nonzero, masked_select, unique), called at {at}. {way_out}: "
            "torch.where(mask, x, 0) or a masked reduction ((x * mask).sum()), "
            f"torch.nonzero_static(x, size=N){outside}."
        )
    if base in _READS:
        what = (
            "reads a tensor's value into Python (if t:, bool(t), .item(), int(t), "
            ".tolist(); torch's x[i] with a 0-d integer tensor i reads i too: write "
            "x[i.reshape(1)] or x.index_select(0, i.reshape(1)) to index on the device)"
        )
    else:
        what = "needs concrete tensor values"
    if compiled:
        return (
            f"{name} {what}, called at {at}. {way_out}: branch on values with "
            "torch.where(cond, a, b)."
        )
    return (
        f"{name} {what}, called at {at}. Under a trace (torchjax.jit, jax.jit) the "
        "function is traced once for every input, so values are not known, only shapes and "
        "dtypes. Instead: branch on values with torch.where(cond, a, b); keep the Python "
        "branch or the .item() outside the traced function; or use "
        'torch.compile(fn, backend="tpu"), which splits the graph there and runs that '
        "Python on the value."
    )


def _leak_message(func) -> str:
    return (
        f"{op_name(func)} was given a tensor that was produced inside a traced function "
        f"(torchjax.jit, jax.jit) and kept after that trace ended, called at {user_frame()}. "
        "A traced tensor has no value outside its trace: return it from the traced function "
        "instead of storing it (in a global, a module attribute, a list or a cache)."
    )
