"""One traced signature of a torchjax.jit function: its trace (step 4 of a call,
torchjax/compile/_jit.py), its compiled program, and how a call runs it and unpacks its
outputs (step 5).

Note [User tensor subclasses under torchjax.jit]
A tpu tensor of a user's ``torch.Tensor`` subclass (Note [User tensor subclasses on
tpu]) keeps its class through eager ops, and ``torch.compile`` on CPU returns the classes
eager does. So the trace wraps each argument tracer in its argument's class: the user's
``__torch_function__`` runs while tracing, as in eager, and decides every result's class.
The class of each output is recorded with the program and given to the arrays a call
returns; the argument classes are part of the cache key (a plain and a ``MyTensor``
argument may trace differently).
"""

from __future__ import annotations

import contextlib
import weakref

import jax
import numpy as np
import torch
from jax.extend.core import jaxpr_as_fun

from torchjax._compat.jax import named, trace_of, x64, x64_enter, x64_exit
from torchjax._compat.torch import (
    pytree,
    saved_tensors_hooks_enabled,
    saved_tensors_hooks_state_kept,
)
from torchjax.compile import (
    _aliases,
    _autograd,
    _donate,
    _grad_scaler,
    _hyper,
    _made_state,
    _state,
)
from torchjax.compile._aliases import root
from torchjax.compile._arg_grads import argument_grads
from torchjax.compile._call import (
    Call,
    Ref,
    traced_argument,
    unflatten_args,
)
from torchjax.compile._containers import Watch
from torchjax.compile._devices import incompatible_devices
from torchjax.compile._escaped_grads import grads_watched, restore_grads
from torchjax.compile._host_rng import HostGenerators, replay_generators
from torchjax.compile._refusals import (
    escaped_grad,
    escaped_write,
    restrided,
)
from torchjax.compile._stop_gradient import stopping
from torchjax.compile._stored import remember_stored, stored_refusal
from torchjax.compile._vjp import VJPProgram
from torchjax.device import _checks
from torchjax.interop._jax_function import _VJP
from torchjax.ops import fused_nodes, layouts
from torchjax.ops.xla_options import COMPILED_PROGRAM_OPTIONS, COMPILER_OPTIONS
from torchjax.tensor import random as _rng
from torchjax.tensor._binding import bound
from torchjax.tensor._errors import TraceError
from torchjax.tensor._fills import traced_fill
from torchjax.tensor._storage import escapes_watched, restore_escapes, traced_fills
from torchjax.tensor._tensor import JaxTensor, make, wrap
from torchjax.tensor._user_subclass import user_class


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class Entry:
    """One traced signature: the compiled program and how to unpack its outputs."""

    pred = False  # a captured call's program: one more input (Note [Captured module calls])
    out_args = ()  # Note [Arguments returned as outputs]
    name = "program"  # the traced function's, which jax names the program after

    @classmethod
    def trace(cls, jitted, call: Call) -> Entry:
        _state.python_ran()  # Note [A module walked once within a block] in _state.py
        self = cls()
        storages = call.storages
        info = {}
        # Note [The compiled VJP is torch's autograd]; without grad mode no graph is made,
        # and where saved-tensor hooks are refused the VJP is jax's.
        saved = _autograd.Saved() if call.grad_mode and saved_tensors_hooks_enabled() else None

        lr_assigned: list = []  # Note [Learning rates assigned while tracing]

        def pure(state_arrays, rng, arrays, hypers):
            # Note [Device checks of compiled programs]: the checks are outputs too.
            with _checks.carried(trace_of(rng)) as carried:
                outs, written, created, args_written, residuals = body(
                    state_arrays, rng, arrays, hypers
                )
            checks = carried.outputs()
            info["checks"] = (len(checks), carried.at_op)
            return outs, written, created, args_written, checks, residuals

        def body(state_arrays, rng, arrays, hypers):
            # Note [Compiled draws are eager's draws] in torchjax/tensor/random.py
            stream = _rng.input_stream(rng)
            with bound(storages, state_arrays):
                old = _rng.set_traced_stream(stream)
                try:
                    flat = list(call.static)
                    wrapped, leaves = [], []
                    for i, t, a, bits in zip(call.pos, call.tensors, arrays, call.bits):
                        w = traced_argument(a, t._device_index, bits)
                        leaves.append(w)
                        if t.requires_grad:
                            w.requires_grad_()
                            if not t.is_leaf:  # in-place ops on it are allowed, as on CPU
                                w = _NonLeaf.apply(w)
                            elif t.grad is not None and not jitted._is_module:
                                w.grad = t.grad  # Note [Gradients of arguments]
                        if user_class(type(t)) is not None:
                            # Note [User tensor subclasses under torchjax.jit]: a fresh
                            # wrapper takes the made class, as alias_as gives an alias.
                            w.__class__ = type(t)
                        flat[i] = w
                        wrapped.append(w)
                    stored = [root(w).arr for w in wrapped]  # the arrays traced
                    flat = [x.obj if isinstance(x, Ref) else x for x in flat]
                    args, kwargs = unflatten_args(flat, call.spec)
                    # Note [Containers a compiled function changes] (_containers.py)
                    watch = Watch((args, kwargs), _name(jitted.fn))
                    kwargs = {**kwargs, **call.static_kwargs}
                    layouts_in = [_layout(w) for w in wrapped]
                    with (
                        torch.autograd.set_multithreading_enabled(False),
                        _hyper.bound(call.hypers.slots, hypers, lr_assigned),
                        # Note [Stopped gradients in compiled programs]; without grad
                        # mode nothing requires grad and no VJP is taken.
                        stopping() if call.grad_mode else contextlib.nullcontext(),
                        saved.hooks() if saved is not None else contextlib.nullcontext(),
                        saved_tensors_hooks_state_kept(),
                    ):
                        out = jitted.fn(*args, **kwargs)
                    for k, (w, before) in enumerate(zip(wrapped, layouts_in)):
                        if _layout(w) != before:
                            raise restrided(_name(jitted.fn), k, before[0], tuple(w.shape))
                    arg_grads = argument_grads(call.tensors, leaves)
                finally:
                    _rng.set_traced_stream(old)
                out, info["containers"] = watch.finish(out, storages)
                out_flat, out_spec = pytree.tree_flatten(out)
                out_pos = [i for i, x in enumerate(out_flat) if isinstance(x, JaxTensor)]
                info["out"] = (out_spec, out_flat, out_pos)
                outs = [out_flat[i] for i in out_pos]
                # Note [Leaves made inside a compiled function]
                own = {id(t) for t in (*wrapped, *call.walk.every)}
                info["new_leaves"] = [
                    j
                    for j, t in enumerate(outs)
                    if t.requires_grad and t.is_leaf and id(t) not in own
                ]
                # Note [Outputs that retain their gradient]
                info["retains"] = any(t.retains_grad for t in outs)
                out_grad = [t.requires_grad for t in outs]
                for j in info["new_leaves"]:
                    out_grad[j] = False
                info["out_grad"] = out_grad
                # Note [Aliased outputs of a compiled function] (_aliases.py).
                aliases, bases = _aliases.plan(outs, wrapped, storages, out_grad)
                info["aliases"], info["n_bases"] = aliases, len(bases)
                info["layouts"] = [layouts.strides_for(out_flat[i]) for i in out_pos]
                info["out_cls"] = [
                    type(out_flat[i]) if user_class(type(out_flat[i])) else None for i in out_pos
                ]
                written = [
                    i for i, (s, a) in enumerate(zip(storages, state_arrays)) if s.arr is not a
                ]
                after = _state.walk(call.roots, not jitted._is_module)
                # Note [Tensors a trace stores in module attributes] (_stored.py)
                remember_stored(after.modules, jitted.attributes)
                after.add_attributes(jitted.attributes)
                known = {id(s) for s in storages}
                # A storage made here and never written keeps its fill, unmade (Note
                # [Fills of storages made inside a trace]): not an output.
                created = [
                    s
                    for s in after.storages
                    if id(s) not in known
                    and s.lazy.__class__ is not list
                    and isinstance(s.arr, jax.core.Tracer)
                    and not traced_fill(s)
                ]
                created += [s for s in arg_grads if id(s) not in known]
                # Arguments written in place (x.add_(1), BatchNorm's running stats when
                # Dynamo passes buffers as graph inputs) are written back as in eager.
                args_written = [
                    k for k, (w, a) in enumerate(zip(wrapped, stored)) if root(w).arr is not a
                ]
                info["written"], info["created"] = written, created
                info["args_written"] = args_written
                info["rng"] = stream
                # Note [Outputs the backward saved]: outputs, state and arguments.
                info["saved_outputs"] = _saved_among(saved, outs)
                info["saved_inputs"] = (
                    frozenset(_saved_among(saved, call.walk.every)),
                    frozenset(_saved_among(saved, wrapped)),
                )
                residuals = [] if saved is None else saved.residuals(trace_of(rng))
                info["n_res"] = len(residuals)
                info["graph"] = (outs, bases, leaves, wrapped, arrays)
                return (
                    [out_flat[i]._value() for i in out_pos] + [b.arr for b in bases],
                    [storages[i].arr for i in written],
                    [s.arr for s in created],
                    [wrapped[k]._value() for k in args_written],
                    residuals,
                )

        # The RNG input is abstract while tracing: a call reads the device's RNG only
        # when the program turned out to use it (``rng()``), so tracing never moves the
        # RNG: a seeded call gives the same values whether it traced or not.
        hosts = HostGenerators(call.walk.generators)
        # Note [Writes that escape a trace] in torchjax/tensor/_storage.py.
        # Note [Gradients that escape a trace] in torchjax/compile/_escaped_grads.py.
        with (
            x64(True),
            escapes_watched() as escaped,
            grads_watched() as grads,
            traced_fills() as made,
            _grad_scaler.made_watched() as scaler_made,
        ):
            try:
                inputs = (call.state_arrays, _RNG_AVAL, call.arrays, call.hypers.values)
                if jitted.captured:  # Note [Captured module calls] (_captured.py)
                    closed = jax.make_jaxpr(_as_nodes(pure))(*inputs, _PRED_AVAL)
                else:
                    closed = jax.make_jaxpr(pure)(*inputs)
            finally:
                restore_escapes(escaped)
                lost = restore_grads(grads)
        if escaped:
            raise escaped_write(_name(jitted.fn), escaped[0][0])
        if jitted.captured:  # Note [Captured module calls] (_captured.py)
            outside = fused_nodes.float_ops_outside_nodes(closed.jaxpr)
            if outside:
                raise TraceError(
                    f"{_name(jitted.fn)}: a captured call would compute {sorted(set(outside))} "
                    "outside the ops' own programs, where XLA may round differently from "
                    "eager; it runs op by op"
                )
        if lost is not None:
            raise escaped_grad(_name(jitted.fn), lost)
        refused = stored_refusal(_name(jitted.fn), jitted.attributes, info["created"])
        if refused is not None:
            raise refused
        self.closed = closed
        self.out_spec, out_flat, self.out_pos = info["out"]
        self.containers = info["containers"]
        self.out_grad = info["out_grad"]
        self.saved_outputs = info["saved_outputs"]
        self.saved_state, self.saved_args = info["saved_inputs"]
        self.new_leaves = info["new_leaves"]
        self.retains = info["retains"]
        self.constant = frozenset(j for j, grad in enumerate(self.out_grad) if not grad)
        self.layouts = info["layouts"] if any(info["layouts"]) else None
        self.out_cls = info["out_cls"]
        self.out_static = [None if isinstance(x, JaxTensor) else x for x in out_flat]
        # Note [Arguments returned as outputs]
        args_at = {id(v.obj): j for j, v in enumerate(call.static) if isinstance(v, Ref)}
        self.out_args = [
            (i, args_at[id(x)]) for i, x in enumerate(self.out_static) if id(x) in args_at
        ]
        self.written = info["written"]
        self.created = info["created"]
        self.args_written = info["args_written"]
        self.writes_shared = _aliases.writes_shared(call.sig[-1], self.args_written, self.written)
        stream = info["rng"]
        self.rng_ending = stream.ending()  # Note [Seeds set inside a trace]
        # Note [CPU generators a trace moves]
        self.host_states, self.host_draws = hosts.after(stream.host_seeded)
        self.lr_assigned = lr_assigned
        self.single_use = bool(self.created)
        # Note [GradScaler steps in compiled programs]: such a call runs eagerly.
        self.scaler_made = bool(scaler_made)
        self.first_state = _made_state.first_state(self.created, made, call.walk.optimizers)
        self.refs = [weakref.ref(s) for s in storages]
        self.aliases = info["aliases"]
        self.n_out = len(self.out_pos) + info["n_bases"]  # the bases follow the outputs
        # The check outputs follow the written arguments (before the residuals).
        self.n_checks, self.checks_at_call = info["checks"]
        self.checks_at = len(self.written) + len(self.created) + len(self.args_written)
        in_use = {id(a) for a in call.arrays}
        donate = (
            tuple(i for i in self.written if id(call.state_arrays[i]) not in in_use)
            if jitted.donate
            else ()
        )
        fun_all = jaxpr_as_fun(closed)
        n_res = info["n_res"]
        self.n_res = n_res
        self.name = _name(jitted.fn)
        fun = named(fun_all if not n_res else (lambda *a: fun_all(*a)[:-n_res]), self.name)
        self.donated = donate
        self.n_state = len(storages)
        self.pred = jitted.captured
        # A captured call's programs are built as fused eager's segment programs are
        # (no excess precision): Note [Captured module calls].
        options = COMPILER_OPTIONS if self.pred else COMPILED_PROGRAM_OPTIONS or None
        self.compiled = jax.jit(fun, donate_argnums=donate, compiler_options=options)
        # A captured call without grad mode makes no graph (Note [Captured calls that
        # need a graph] in torchjax/compile/_captured.py).
        needs_vjp = call.grad_mode or not self.pred
        self.vjp = (
            VJPProgram.build(self, call, fun_all, saved, info["graph"]) if needs_vjp else None
        )
        return self

    def alive(self) -> bool:
        return all(r() is not None for r in self.refs)

    def runs_eagerly(self, call: Call) -> bool:
        """Whether ``call`` runs the function as eager Python instead of this program:
        Note [Arguments that share memory] (_aliases.py), Note [Containers a compiled
        function changes] (_containers.py), Note [GradScaler steps in compiled
        programs] (_grad_scaler.py)."""
        return (
            self.writes_shared
            or self.scaler_made
            or (self.containers is not None and self.containers.runs_eagerly(call))
        )

    def rng(self, calls: int = 1):
        """The RNG input of ``calls`` calls in a row, the device states (and CPU
        generators) left as they leave them (Note [Compiled draws are eager's draws] in
        torchjax/tensor/random.py)."""
        if self.host_states:
            replay_generators(self.host_states)
        return _rng.call_input(self.rng_ending, calls)

    def run(self, call: Call):
        state = call.state_arrays
        if self.donated:
            state, copies = _donate.unshared(state, self.donated, call.walk.tensors)
            call.jitted.donation_copies += copies
        token = x64_enter()
        try:
            inputs = (*state, self.rng(), *call.arrays, *call.hypers.values)
            if self.pred:
                inputs = (*inputs, _TRUE)
            outs = self.compiled(*inputs)
        except ValueError:
            # Note [Inputs of a compiled call on other devices]
            err = incompatible_devices(_name(call.jitted.fn), call, inputs)
            if err is None:
                raise
            raise err from None
        finally:
            x64_exit(token)
        self.write_back(call, outs[self.n_out :])
        self.report_checks(outs[self.n_out :])
        return self.unflatten(self.laid_out([wrap(a) for a in outs[: self.n_out]]), call)

    def report_checks(self, rest) -> None:
        """Report the check outputs among ``rest`` (the program's outputs after the
        first ``n_out``), after the call's state is written back (Note [Device checks
        of compiled programs] in torchjax/device/_checks.py)."""
        if self.n_checks:
            at = self.checks_at
            _checks.report_program(rest[at : at + self.n_checks], self.checks_at_call)

    def laid_out(self, tensors):
        """The program's outputs at the strides the traced ones had (Note [Strides of
        compiled outputs])."""
        if self.layouts is None:
            return tensors
        for j, planned in enumerate(self.layouts):
            tensors[j] = layouts.apply_layout(tensors[j], planned)
        return tensors

    def arg_write_output(self, m: int) -> int:
        """The position among the program's outputs of the ``m``-th written argument's
        new value (after the outputs and the written and created state)."""
        return self.n_out + len(self.written) + len(self.created) + m

    def write_back(self, call: Call, rest) -> None:
        call.written_back = True
        storages = call.storages
        for i, a in zip(self.written, rest):
            storages[i].replace(a)
        rest = rest[len(self.written) :]
        for s, a in zip(self.created, rest):
            s.replace(a)
        for k, a in zip(self.args_written, rest[len(self.created) :]):
            call.tensors[k]._write(a)
            host = call.host.get(k)
            if host is not None:  # Note [CPU tensors a compiled call writes]
                with torch.no_grad():
                    host.copy_(call.tensors[k].cpu())

    def unflatten(self, tensors, call: Call):
        n = len(self.out_pos)
        if self.aliases is not None:
            tensors = _aliases.regenerate(
                self.aliases, tensors[:n], tensors[n:], call.tensors, call.walk.tensors
            )
        for j in self.new_leaves:
            tensors[j].requires_grad_()
        flat = list(self.out_static)
        for i, j in self.out_args:  # Note [Arguments returned as outputs]
            flat[i] = call.static[j].obj
        for i, t, cls in zip(self.out_pos, tensors, self.out_cls):
            if cls is not None:  # Note [User tensor subclasses under torchjax.jit]
                t.__class__ = cls
            flat[i] = t
        out = pytree.tree_unflatten(flat, self.out_spec)
        if self.containers is not None:  # Note [Containers a compiled function changes]
            out = self.containers.apply(out, call)
        return out

    def run_differentiable(self, call: Call):
        program = self.vjp
        state = program.state_inputs(call.walk)
        dyn = [call.tensors[k] for k in program.diff_dyn]
        outs = _VJP.apply(call.jitted.vjp_call(self, call), *state, *dyn)
        n = self.n_out
        for k, new in zip(program.rebased, outs[n:]):
            # Note [Arguments written in place get the program's history]
            call.tensors[k].copy_(new)
        return self.unflatten(list(outs[:n]), call)


# Note [Leaves made inside a compiled function]
# ``x.detach().requires_grad_()`` or ``torch.zeros(n).requires_grad_()`` returned by the
# function is, in eager, a new leaf: no grad_fn, its own ``.grad`` filled by a backward
# through it, nothing flowing past it. A traced output like that (a leaf requiring grad
# that is neither an argument nor state) is a constant of the call's VJP, comes back
# without history and is made a leaf requiring grad; one aliasing an argument or state
# is rebuilt as a view of that tensor's detached self (Note [Aliased outputs of a
# compiled function]), so no gradient reaches the argument through it.


# Note [CPU tensors a compiled call writes]
# A CPU tensor argument is taken as an input on tpu (a copy, per call). One the
# function writes in place must still hold the write after the call, as in eager and as
# torch.compile on CPU writes a mutated input back: an optimizer's ``step`` count, which
# non-capturable Adam keeps on CPU and Dynamo passes as a graph input, stayed at 1, so
# every step after the first used the first step's bias correction. Its new value is
# copied back into the CPU tensor after the call (a host read per written CPU argument;
# ``capturable=True`` or ``fused=True`` optimizers keep their step on tpu and need none).


# Note [Arguments returned as outputs]
# A non-tensor argument the function returns (an HF forward returns the Cache object it
# was passed, in ``past_key_values``) is a static output of the program: the object of
# the call that was traced. A call keyed by layout (Note [Captured calls are keyed by
# layout] in torchjax/compile/_captured.py) runs the program with another Cache, and
# ``generate`` then continued with the traced call's cache. So such an output is this
# call's argument at the same position.


# Note [Strides of compiled outputs]
# A program returns each output's values; wrapped, they would be contiguous. Eager
# gives an op's result CPU's strides (Note [Result layouts follow CPU]), and so does
# inductor for a compiled CPU function, so ``(y.t() * 2)`` comes back with strides
# (1, 3) and ``.t().view(-1)`` of it works. So the strides an output had while tracing
# are recorded with the program (``layouts.strides_for``) and a call's output reports
# them as an eager result does (``layouts.apply_layout``: restrided where they differ
# only at size-1 dimensions, else laid out in memory order, its storage made when first
# read); the value read by the next op is the program's own. Outputs that view an
# argument or state are rebuilt as those views (Note [Aliased outputs of a compiled
# function]).


class _NonLeaf(torch.autograd.Function):
    """The traced stand-in of an argument that is not a leaf: the same storage, with a
    grad_fn, so the function may write it in place as CPU allows (a leaf requiring grad
    refuses in-place ops)."""

    @staticmethod
    def forward(ctx, t):
        return make(t._storage, t._size, t._stride, t._offset, t.dtype, t._device_index)

    @staticmethod
    def backward(ctx, grad):
        return grad


# The RNG input's layout (Note [Compiled draws are eager's draws] in
# torchjax/tensor/random.py); programs that draw nothing take it too (one signature).
_RNG_AVAL = jax.ShapeDtypeStruct((3,), np.uint32)
# The predicate input of a captured call's program (Note [Captured module calls]).
_PRED_AVAL = jax.ShapeDtypeStruct((), np.bool_)
_TRUE = np.bool_(True)


def _as_nodes(pure):
    """``pure`` with one more input, the predicate its ops are traced on as fused
    eager's segment program runs them (torchjax/ops/fused_nodes.py)."""

    def traced(state_arrays, rng, arrays, hypers, pred):
        with fused_nodes.tracing(pred):
            return pure(state_arrays, rng, arrays, hypers)

    return traced


def _saved_among(saved, tensors) -> list[int]:
    return [] if saved is None else saved.saved_among(tensors, root)


def _layout(t) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset()
