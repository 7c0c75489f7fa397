"""The differentiable call of a torchjax.jit program: its VJP (a compiled forward
returning what the backward needs, and a compiled backward) and the adapter that runs
one call of it through torchjax's ``_VJP`` autograd Function (Note [The compiled VJP is
torch's autograd] in torchjax/compile/_autograd.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np

from torchjax._compat.jax import named, x64
from torchjax.compile import _autograd
from torchjax.compile._aliases import root
from torchjax.ops.xla_options import COMPILED_PROGRAM_OPTIONS, COMPILER_OPTIONS
from torchjax.tensor._errors import TraceError
from torchjax.tensor._storage import Storage, contiguous_strides
from torchjax.tensor._tensor import make, wrap


def _program(fn, name: str, captured: bool = False):
    # Note [Excess precision in compiled programs] in torchjax/ops/xla_options.py; a
    # captured call's are built as fused eager's segments (Note [Captured module calls]).
    options = COMPILER_OPTIONS if captured else COMPILED_PROGRAM_OPTIONS or None
    return jax.jit(named(fn, name), compiler_options=options)


if TYPE_CHECKING:
    from torchjax.compile._call import Call
    from torchjax.compile._entry import Entry


class VJPProgram:
    """The VJP of a jitted program w.r.t. the state and inputs requiring grad: a
    compiled forward returning the outputs and what the backward needs (``pullback``),
    and a compiled backward taking that and the cotangents.

    The backward is torch's autograd graph recorded while tracing (Note [The compiled
    VJP is torch's autograd]; ``pullback`` is the saved tensors' values) or, where that
    graph cannot be replayed, ``jax.vjp`` of the forward (``pullback`` is jax's, holding
    its residuals).

    A captured call's (``entry.pred``: Note [Captured calls that need a graph] in
    torchjax/compile/_captured.py) takes the predicate input in both programs, its
    backward's ops traced as nodes; where torch's graph cannot give its backward so,
    ``build`` raises ``TraceError`` (the signature runs op by op), never ``jax.vjp``."""

    @classmethod
    def build(cls, entry: Entry, call: Call, fun, saved, graph):
        diff_leaves = [i for i, t in enumerate(call.walk.every) if differentiable(t)]
        diff_dyn = [k for k, t in enumerate(call.tensors) if differentiable(t)]
        written = any(differentiable(call.tensors[k]) for k in entry.args_written)
        if not (diff_leaves or diff_dyn) or not (any(entry.out_grad) or written):
            return None
        self = cls()
        n_out, n_res = entry.n_out, entry.n_res
        captured = entry.pred
        try:
            backward = _torch_backward(entry, call, saved, graph, diff_leaves, diff_dyn, captured)
        except _autograd.Unreplayable as e:
            if captured:
                raise TraceError(
                    f"{entry.name}: a captured call's backward cannot be built from torch's "
                    f"autograd graph as fused eager's nodes ({e}); it runs op by op"
                ) from e
            backward = None
        self.from_torch = backward is not None
        self.rebased = []
        if backward is not None:
            # Every parameter's own gradient, several viewing one storage included.
            self.diff_state, self.diff_dyn = diff_leaves, diff_dyn
            n_state = len(diff_leaves)

            self.rebased = [entry.args_written[m] for m in backward.rebased]
            rebased = [entry.arg_write_output(m) for m in backward.rebased]

            def fwd(state, rng, dyn, hypers, *pred):
                res = fun(*state, rng, *dyn, *hypers, *pred)
                end = len(res) - n_res
                return res[:n_out] + [res[i] for i in rebased], res[end:], res[n_out:end]

            def bwd(values, residuals, cotangents):
                grads = backward(values, residuals, cotangents)
                return grads[:n_state], grads[n_state:]

            self.fwd, self.bwd = _program(fwd, entry.name, captured), bwd
            self.absent = backward.absent
            return self

        if not any(entry.out_grad):
            return None
        # jax.vjp takes the gradient of each state storage's array: only for state
        # tensors viewing all of theirs, whose gradient it then is (``state_grad``).
        tensors = call.walk.tensors
        diff_state = [
            i for i, t in enumerate(tensors) if differentiable(t) and _autograd.views_whole(t)
        ]
        if not (diff_state or diff_dyn):
            return None
        self.diff_state, self.diff_dyn = diff_state, diff_dyn

        def fwd(state, rng, dyn, hypers):
            def g(ds, dd):
                st, dy = list(state), list(dyn)
                for i, a in zip(diff_state, ds):
                    st[i] = a
                for k, a in zip(diff_dyn, dd):
                    dy[k] = a
                res = fun(*st, rng, *dy, *hypers)
                return res[:n_out], res[n_out:]

            ds = [state[i] for i in diff_state]
            dd = [dyn[k] for k in diff_dyn]
            outs, pullback, aux = jax.vjp(g, ds, dd, has_aux=True)
            return outs, pullback, aux

        self.fwd = _program(fwd, entry.name)
        self.bwd = _program(lambda pullback, cts: pullback(cts), f"{entry.name}_backward")
        return self

    def state_inputs(self, walk):
        """The state tensors the gradients are for, in the backward's order."""
        tensors = walk.every if self.from_torch else walk.tensors
        return [tensors[i] for i in self.diff_state]


def _torch_backward(entry, call, saved, graph, diff_leaves, diff_dyn, nodes):
    """The backward program made of torch's graph of the trace (Note [The compiled VJP
    is torch's autograd]); ``nodes``: a captured call's. Raises
    ``_autograd.Unreplayable`` saying why where the graph cannot give it."""
    outs, bases, leaves, wrapped, arg_tracers = graph
    if saved is None:
        raise _autograd.Unreplayable("its graph's saved tensors were not recorded")
    aliases, avals = entry.aliases, entry.closed.out_avals
    outputs = []
    for j, t in enumerate(outs):
        # An output rebuilt as a view of an argument, state or shared base after the
        # call gets its gradient through that view, not through its own position.
        if (aliases is None or aliases[j] is None) and entry.out_grad[j]:
            outputs.append((j, t, None, avals[j]))
    for b, storage in enumerate(bases):
        viewing = [t for t in outs if root(t) is storage]
        if not any(t.requires_grad for t in viewing):
            continue
        whole = _autograd.cover(storage, viewing)
        if whole is None or not whole.requires_grad:
            raise _autograd.Unreplayable(
                "outputs share the storage of an intermediate no traced tensor covers whole"
            )
        outputs.append((len(outs) + b, whole, storage, avals[len(outs) + b]))
    # Note [Arguments written in place get the program's history]: their new values
    # follow the outputs.
    rebased = [
        m
        for m, k in enumerate(entry.args_written)
        if differentiable(call.tensors[k])
        and wrapped[k].requires_grad
        # a leaf written under no_grad (an SGD update) stays a leaf without history
        and not (call.tensors[k].is_leaf and wrapped[k].grad_fn is None)
    ]
    for i, m in enumerate(rebased):
        k = entry.args_written[m]
        outputs.append((entry.n_out + i, wrapped[k], None, avals[entry.arg_write_output(m)]))
    if not outputs:
        raise _autograd.Unreplayable("no output has a gradient through its graph")
    state = [call.walk.every[i] for i in diff_leaves]
    if any(t.grad_fn is not None for t in state):
        # A non-leaf the function closes over: torch's backward would run on into the
        # eager graph before the call. jax.vjp's gradient reaches it through the call.
        raise _autograd.Unreplayable("its state holds a tensor that is not a leaf")
    inputs = state + [leaves[k] for k in diff_dyn]
    residual_avals = avals[len(avals) - entry.n_res :]
    # An argument's storage is bound where its array is the argument's own.
    args = [root(w) if root(w).arr is a else None for w, a in zip(leaves, arg_tracers)]
    backward = _autograd.Backward.trace(
        saved,
        outputs,
        inputs,
        [*call.storages, *args],
        [*call.state_arrays, *call.arrays],
        residual_avals,
        f"{entry.name}_backward",
        nodes,
    )
    backward.rebased = rebased
    return backward


# Note [Arguments written in place get the program's history]
# On CPU, ``f(y): y.mul_(2)`` on a non-leaf ``y`` rebases ``y``'s autograd history on
# the write, so ``x.grad`` for ``y = x * 1`` is 2. The program writes the new value
# back to the argument's storage, which alone would leave ``y`` with its old history
# (a gradient of 1). With torch's backward (Note [The compiled VJP is torch's autograd])
# each such argument's new value is one more output of the differentiable call, and
# the argument is ``copy_``-ed from it under autograd: its history becomes the call's,
# whose backward takes the write's traced graph back to the argument's old value. The
# ``jax.vjp`` fallback does not do this.


_TRUE = np.bool_(True)  # a captured call's predicate (Note [Captured module calls])


def differentiable(t) -> bool:
    return t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)


def state_grad(t, arr):
    """The gradient of state tensor ``t`` from the gradient ``arr`` of its storage's
    array: laid out as ``t`` (as CPU's autograd gives a channels_last weight a
    channels_last gradient)."""
    if t._size == tuple(arr.shape) and t._stride == contiguous_strides(t._size):
        return wrap(arr, t._device_index)
    return make(Storage(arr), t._size, t._stride, 0, t.dtype, t._device_index)


class VJPCall:
    """Adapter giving _VJP (torchjax/interop/_jax_function.py) one jitted call."""

    def __init__(self, entry: Entry, call: Call):
        self.entry, self.call = entry, call
        program = entry.vjp
        n = len(program.diff_state)
        self.diff = tuple(range(n)) + tuple(n + j for j in range(len(program.diff_dyn)))

    def constant_outputs(self):
        """Positions of outputs that did not require grad when traced (a detached value,
        a function of constants): as on CPU, they come back without a grad_fn."""
        return self.entry.constant

    def saved_outputs(self):
        """Positions of outputs a saved tensor of the traced graph shares storage with
        (Note [Outputs the backward saved] in torchjax/compile/_autograd.py)."""
        return self.entry.saved_outputs

    def saved_inputs(self):
        """Positions of the inputs (state, then arguments) a saved tensor of the traced
        graph shares storage with (Note [Outputs the backward saved]); not arguments
        the call writes itself, whose write after the call takes its history (Note
        [Arguments written in place get the program's history])."""
        entry, program = self.entry, self.entry.vjp
        if not program.from_torch:
            return []
        n = len(program.diff_state)
        written = set(entry.args_written)
        return [j for j, i in enumerate(program.diff_state) if i in entry.saved_state] + [
            n + j
            for j, k in enumerate(program.diff_dyn)
            if k in entry.saved_args and k not in written
        ]

    def wrap_outputs(self, outs):
        return self.entry.laid_out([wrap(o) for o in outs])

    def vjp(self, arrays):
        entry, call = self.entry, self.call
        # torch's backward reads the call's state and arguments (Note [The compiled VJP
        # is torch's autograd]); the pullback is the saved tensors' values alone.
        self.values = [*call.state_arrays, *call.arrays]
        pred = (_TRUE,) if entry.pred else ()
        with x64(True):
            outs, pullback, aux = entry.vjp.fwd(
                call.state_arrays, entry.rng(), call.arrays, call.hypers.values, *pred
            )
        entry.write_back(call, aux)
        entry.report_checks(aux)
        return outs, pullback

    def pull(self, pullback, cotangents):
        program = self.entry.vjp
        with x64(True):
            if program.from_torch:
                ds, dd = program.bwd(self.values, pullback, cotangents)
            else:
                ds, dd = program.bwd(pullback, cotangents)
        return list(ds) + list(dd)

    def wrap_input_grads(self, grads):
        """Tensors of ``pull``'s gradients. torch's backward gives each state tensor's
        in its own element order (the leaf's AccumulateGrad lays it out as the tensor,
        as on CPU); jax.vjp gives its storage's, laid out as the tensor here."""
        program = self.entry.vjp
        if program.from_torch:  # None where the graph gave none, as on CPU
            return [None if no else wrap(g) for g, no in zip(grads, program.absent)]
        tensors = self.call.walk.tensors
        state = [state_grad(tensors[i], g) for i, g in zip(program.diff_state, grads)]
        return state + [wrap(g) for g in grads[len(state) :]]
