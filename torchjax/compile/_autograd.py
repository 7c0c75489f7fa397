"""The backward of a torchjax.jit program: torch's own autograd graph, traced once.

Note [The compiled VJP is torch's autograd]
On CPU a compiled function's backward is the graph torch's autograd records for its
forward (AOTAutograd traces exactly that). A torchjax.jit program is traced with grad
mode on and its differentiable inputs marked, so torch records that same graph while
tracing, over tensors holding the trace's tracers. Its saved tensors go through
``saved_tensors_hooks``: the value each one has when saved becomes an extra output of
the forward program (a residual), and the handle left in the graph remembers which.
Right after the forward, the backward program is traced: ``torch.autograd.grad`` of the
traced outputs that require grad, w.r.t. the traced inputs, runs the graph's own
backward formulas with every saved tensor unpacked over the backward program's residual
inputs. So a custom ``autograd.Function``'s ``backward``, hooks on intermediates and
derivatives.yaml's conventions at edge points (``norm`` of zeros, ``relu`` at 0,
``median`` ties, embedding's ``scale_grad_by_freq``) are eager's, and parameters that
view one shared buffer each get their own gradient. The forward runs once; the backward
is one compiled program.

As in eager, a saved tensor written in place after it was saved makes the backward
raise torch's "modified by an inplace operation" error (hooks bypass torch's own
version check, so the handle checks the version itself).

Note [Outputs the backward saved]
A saved tensor may be what the function returns (``exp`` saves its result) or view its
storage. In eager, writing that output in place before ``backward()`` (``y =
x.exp(); y.add_(1)``) makes the backward raise, since the gradient would read the
written values. A compiled call returns new tensors over the program's outputs, and
its backward reads residuals of its own, so the write went unnoticed and the backward
silently gave the gradient of the values before the write. The trace records which
outputs a saved tensor shares storage with (``saved_among``), and the call saves
those outputs on its autograd node, whose backward unpacks them: torch's version check
then raises the same error as eager, naming the compiled call's node. So for the state
and arguments the graph saved (a Linear's weight, through its ``t()``): a parameter
written in place between the forward and ``backward()`` (``p.mul_(2)`` under
``no_grad``) raises as in eager, where the backward read the values of the call.

The backward is traced as ``backward()`` accumulating into the leaves (``grad(inputs=)``
would refuse reentrant activation checkpointing), each leaf's ``.grad`` and hooks set
aside meanwhile: its hooks (``p.register_hook``) run once, when ``backward()`` hands the
program's gradients to it.

The backward program also takes the call's state and argument arrays, bound to those
storages while it is traced: a formula reading a parameter or an argument itself (a
reentrant checkpoint recomputing its block, an ``autograd.Function`` keeping an
argument on ``ctx``) reads the call's values, not constants of the trace.

Where the graph reaches another value of the forward trace (an intermediate kept on
``ctx``, non-reentrant activation checkpointing, a Pallas kernel's pullback), or draws
random numbers (dropout recomputed by a checkpoint could not draw the forward's), the
backward cannot be replayed outside its forward. Then the program's VJP is ``jax.vjp``
of the forward (Note [Stopped gradients in compiled programs]), exact except for the
conventions above; so is a program whose outputs share an intermediate's storage that
no traced tensor covers whole.
"""

from __future__ import annotations

import contextlib
import math
import re
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.extend.core import jaxpr_as_fun

from torchjax._compat.jax import named, trace_of, x64
from torchjax.compile._func_transforms import suspendable
from torchjax.ops import fused_nodes, layouts
from torchjax.ops.xla_options import COMPILED_PROGRAM_OPTIONS, COMPILER_OPTIONS
from torchjax.tensor import _backward_errors
from torchjax.tensor import random as _rng
from torchjax.tensor._binding import bound
from torchjax.tensor._errors import LeakedTracerError, TraceError
from torchjax.tensor._memory_format import is_dense_permutation
from torchjax.tensor._storage import Storage, contiguous_strides, traced_fills
from torchjax.tensor._tensor import JaxTensor, make, wrap
from torchjax.tensor.dtypes import to_jax_dtype


class _Handle:
    """What the graph keeps for one saved tensor."""

    __slots__ = ("tensor", "version", "made_by", "value", "layout", "index", "__weakref__")


class Saved:
    """The saved tensors of one traced forward, and their replay in its backward."""

    def __init__(self):
        self._handles: list = []
        self._replay = None

    def hooks(self):
        # Off the stack while a torch.func transform runs (Note [torch.func transforms
        # in compiled programs] in _func_transforms.py).
        return suspendable(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))

    def _pack(self, t):
        h = _Handle()
        h.tensor, h.version, h.index = t, t._version, None
        fn = t.grad_fn
        h.made_by = None if fn is None else (t.output_nr, re.sub(r"Backward\d*$", "", fn.name()))
        if isinstance(t, JaxTensor):
            h.value, h.layout = t._value(), layouts.strides_for(t)
        else:
            h.value = h.layout = None
        self._handles.append(weakref.ref(h))
        return h

    def _unpack(self, h):
        t = h.tensor
        if t._version != h.version:
            # Raised as the pass ends (Note [Errors inside the autograd engine]).
            _backward_errors.raise_in_engine_safely(
                RuntimeError(_modified_message(t, h.version, h.made_by))
            )
        replay = self._replay
        if replay is None or h.index is None:
            return t
        out = replay.get(h)
        if out is None:
            out = layouts.apply_layout(wrap(replay.arrays[h.index], t._device_index), h.layout)
            replay[h] = out
        return out

    def saved_among(self, tensors, root) -> list[int]:
        """Positions of ``tensors`` (traced tensors the function returns, or its state
        and arguments) whose storage (``root``) a saved tensor of the graph views: in
        eager an in-place write to one of them before the backward bumps a saved
        tensor's version, and the backward raises (Note [Outputs the backward saved])."""
        storages = set()
        for ref in self._handles:
            h = ref()
            if h is not None and isinstance(h.tensor, JaxTensor):
                storages.add(id(root(h.tensor)))
        return [
            j for j, t in enumerate(tensors) if isinstance(t, JaxTensor) and id(root(t)) in storages
        ]

    def residuals(self, trace) -> list:
        """The values of the saved tensors the graph still holds, made by ``trace``
        (a tracer of the forward's own trace): the forward program's residual outputs.
        Handles of tensors saved and released inside the trace (an in-trace
        ``backward()``) are gone by now; constants stay in the handle."""
        out, index = [], {}
        for ref in self._handles:
            h = ref()
            if h is None or trace is None or trace_of(h.value) is not trace:
                continue
            h.index = index.setdefault(id(h.value), len(out))
            if h.index == len(out):
                out.append(h.value)
        self._handles = []
        return out

    @contextlib.contextmanager
    def replaying(self, arrays):
        self._replay = _Replay(arrays)
        try:
            yield
        finally:
            self._replay = None


class _Replay(dict):
    """Unpacked tensors by handle, over the backward program's residual inputs."""

    def __init__(self, arrays):
        super().__init__()
        self.arrays = arrays


def _modified_message(t, saved_version, made_by) -> str:
    """torch's message for a saved tensor written in place before the backward."""
    where = "" if made_by is None else ", which is output {} of {},".format(*made_by)
    return (
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{t.type()} {list(t.shape)}]{where} is at version "
        f"{t._version}; expected version {saved_version} instead. Hint: enable anomaly "
        "detection to find the operation that failed to compute its gradient, with "
        "torch.autograd.set_detect_anomaly(True, check_nan=False)."
    )


def views_whole(t) -> bool:
    """Whether ``t`` views all of its storage, each element once (contiguous or a
    permuted layout such as a channels_last weight)."""
    s = t._storage
    if not isinstance(s, Storage) or t._offset != 0 or math.prod(t._size) != s.numel:
        return False
    return t._stride == contiguous_strides(t._size) or is_dense_permutation(t._size, t._stride)


def cover(storage, tensors):
    """A traced tensor viewing all of ``storage`` once, among ``tensors`` and their
    ``_base``s: the tensor an output shared by several views stands for in the graph.
    None when there is none."""
    for t in tensors:
        for c in (t, t._base):
            if isinstance(c, JaxTensor) and c._storage is storage and views_whole(c):
                return c
    return None


@contextlib.contextmanager
def accumulating(leaves):
    """Within the block, ``leaves`` start with no ``.grad`` and their hooks do not run;
    yields a list that holds the gradients accumulated in the block once it ends. Their
    own ``.grad`` and hooks are restored after."""
    kept = []
    for t in leaves:
        hooks = [
            h
            for h in (
                getattr(t, "_backward_hooks", None),
                getattr(t, "_post_accumulate_grad_hooks", None),
            )
            if h
        ]
        kept.append((t, t.grad, [(h, dict(h)) for h in hooks]))
        for h in hooks:
            h.clear()
        t.grad = None
    grads = []
    try:
        yield grads
        grads.extend(t.grad for t in leaves)
    finally:
        for t, grad, hooks in kept:
            t.grad = grad
            for h, items in hooks:
                h.update(items)


class _NoDraws:
    """The random stream of a backward trace: a draw there (dropout recomputed by
    activation checkpointing) could not give the forward's values."""

    def next(self):
        raise Unreplayable("a random draw in the backward of a compiled program")


class Unreplayable(TraceError):
    """Torch's graph of a traced forward cannot give its backward program; the message
    says why (``VJPProgram.build`` then takes ``jax.vjp``, or refuses a captured call)."""


class Backward:
    """The traced backward of one forward program (Note [The compiled VJP is torch's
    autograd]).

    ``outputs``: ``(position, tensor, storage, aval)`` per differentiable output of the
    call (its position among the cotangents), the traced tensor its cotangent goes to;
    ``storage`` set where the output is a shared storage's array (the tensor covers
    it). ``inputs``: the traced tensors whose gradients the program returns, in order
    (``absent``: those the graph gives none, whose ``.grad`` stays None as on CPU).
    ``storages``: the state's, then the
    arguments' (None where an argument's is not its array), bound to the program's
    ``values`` inputs (the call's state and argument arrays) while the backward runs,
    so a formula reading them directly (a recomputing checkpoint) sees the call's."""

    @classmethod
    def trace(cls, saved, outputs, inputs, storages, values, residual_avals, name, nodes=False):
        """The backward program (named ``name``); raises ``Unreplayable`` where the
        graph cannot be replayed outside its forward trace. ``nodes``: a captured
        call's backward (Note [Captured calls that need a graph] in
        torchjax/compile/_captured.py): traced with its ops as fused eager's nodes, on
        one more input (the predicate), and compiled as fused eager's segments are;
        ``Unreplayable`` where an op would compute a float outside a node."""
        kept = [k for k, s in enumerate(storages) if s is not None]

        def backward(values, residuals, cotangents, pred=None):
            grads_out = []
            for (_, t, storage, _), ct in zip(outputs, cotangents):
                if storage is None:
                    grads_out.append(wrap(ct, t._device_index))
                else:
                    grads_out.append(
                        make(Storage(ct), t._size, t._stride, 0, t.dtype, t._device_index)
                    )
            old = _rng.set_traced_stream(_NoDraws())
            try:
                with (
                    fused_nodes.tracing(pred) if nodes else contextlib.nullcontext(),
                    saved.replaying(residuals),
                    bound([storages[k] for k in kept], [values[k] for k in kept]),
                    torch.autograd.set_multithreading_enabled(False),
                    accumulating(inputs) as grads,
                ):
                    # backward(), not grad(inputs=...): reentrant activation
                    # checkpointing refuses the latter.
                    torch.autograd.backward([o[1] for o in outputs], grads_out)
            finally:
                _rng.set_traced_stream(old)
            self.absent = [g is None for g in grads]
            return [
                jnp.zeros(x.shape, to_jax_dtype(x.dtype)) if g is None else g._value()
                for g, x in zip(grads, inputs)
            ]

        cts = [o[3] for o in outputs]
        self = cls()
        self.positions = [o[0] for o in outputs]
        self.error = self.program = None
        self.absent = [False] * len(inputs)
        self.nodes = nodes
        pred = (_PRED_AVAL,) if nodes else ()
        try:
            with x64(True), traced_fills():
                closed = jax.make_jaxpr(backward)(values, residual_avals, cts, *pred)
        except Unreplayable:
            raise
        except (jax.errors.UnexpectedTracerError, LeakedTracerError) as e:
            raise Unreplayable(
                f"its backward reached a value of the forward trace ({_first_line(e)})"
            ) from e
        except Exception as e:  # noqa: BLE001 - raised at backward(), as eager does
            if nodes:
                # Op by op, the call's backward raises it as eager does.
                raise Unreplayable(
                    f"tracing its backward raised {type(e).__name__}: {_first_line(e)}"
                ) from e
            self.error = e
            return self
        if any(isinstance(c, jax.core.Tracer) for c in closed.consts):
            raise Unreplayable("a value of the forward trace reached its backward as a constant")
        outside = fused_nodes.float_ops_outside_nodes(closed.jaxpr) if nodes else None
        if outside:
            raise Unreplayable(
                f"its backward would compute {sorted(set(outside))} outside the ops' own "
                "programs, where XLA may round differently from eager"
            )
        options = COMPILER_OPTIONS if nodes else COMPILED_PROGRAM_OPTIONS or None
        self.program = jax.jit(named(jaxpr_as_fun(closed), name), compiler_options=options)
        return self

    def __call__(self, values, residuals, cotangents):
        if self.error is not None:
            raise self.error
        pred = (_TRUE,) if self.nodes else ()
        return self.program(*values, *residuals, *(cotangents[j] for j in self.positions), *pred)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


# The predicate input of a captured call's backward (Note [Captured module calls]).
_PRED_AVAL = jax.ShapeDtypeStruct((), np.bool_)
_TRUE = np.bool_(True)
