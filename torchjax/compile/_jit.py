"""torchjax.jit: PyTorch code on tpu tensors traced once into a jax.jit program.

How a call runs (see Note [State of a jitted function] for what "state" is):

1. Split the arguments (a torch pytree) into tensors (inputs of the program) and
   everything else (static: part of the cache key, as ``static_argnums`` in jax.jit).
2. Walk the state roots for the storages the function may read or write.
3. Look up the cache by argument structure, static values, shapes/dtypes, the identity and
   shapes of the state storages, module training flags, grad mode, and torch's global
   modes (autocast and its dtype, the default dtype, float32 matmul precision).
4. On a miss, trace: bind tracers into the state storages (torchjax/tensor/_binding.py),
   wrap tracer arguments as tpu tensors, run the PyTorch code (autograd's backward runs
   on this thread, see ``set_multithreading_enabled``), and collect outputs, state the
   code wrote, and state it created (lazily made optimizer state, new ``.grad``s). The
   trace becomes a ClosedJaxpr, compiled by ``jax.jit`` with the written state donated.
5. Run the executable; write back written state; fill created state.

Randomness: the program's RNG input is the device's base key and counter, read per call;
its random ops draw the keys eager would draw from that state and the counter moves as
eager moves it, so each call gives new values and ``torch.manual_seed`` replays them
(Note [Compiled draws are eager's draws] in torchjax/tensor/random.py). Seeds set inside
the function are part of the program (Note [Seeds set inside a trace], there); CPU
generators it seeds or draws from: Note [CPU generators a trace moves] (_host_rng.py).

Value checks: the device checks the traced ops make (index out of range, integer division
by zero; Note [Device-side checks] in torchjax/device/_checks.py) become outputs of the
program, reported after each call as eager reports them: Note [Device checks of compiled
programs] in the same file.

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
import functools
import warnings
import weakref

import jax
import numpy as np
import torch
from jax.extend.core import jaxpr_as_fun

from torchjax import _budget
from torchjax._compat.jax import trace_of, x64, x64_enter, x64_exit
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
    _repeat,
    _state,
)
from torchjax.compile._aliases import root
from torchjax.compile._arg_grads import argument_grads
from torchjax.compile._call import (
    Call,
    Ref,
    describe_change,
    flatten_args,
    traced_argument,
    unflatten_args,
)
from torchjax.compile._containers import Watch
from torchjax.compile._escaped_grads import grads_watched, restore_grads
from torchjax.compile._host_rng import HOST_DRAWS, HostGenerators, replay_generators
from torchjax.compile._refusals import (
    HOST_WRITES,
    LR_ASSIGNED,
    RETAINED,
    escaped_grad,
    escaped_write,
    restrided,
)
from torchjax.compile._rollback import Before, put_back_on_failure
from torchjax.compile._stop_gradient import stopping
from torchjax.compile._vjp import VJPCall, VJPProgram
from torchjax.device import _checks
from torchjax.interop._jax_function import _VJP
from torchjax.ops import layouts
from torchjax.tensor import random as _rng
from torchjax.tensor._binding import bound, trace_lock
from torchjax.tensor._fills import traced_fill
from torchjax.tensor._storage import escapes_watched, restore_escapes, traced_fills
from torchjax.tensor._tensor import JaxTensor, make, wrap
from torchjax.tensor._user_subclass import user_class


class RetraceWarning(UserWarning):
    """A jitted function traced more often than its ``warn_after`` allows."""


class DynamicShapesWarning(UserWarning):
    """``torch.compile(backend="tpu")`` of a graph with symbolic sizes compiled a second
    XLA program, for new input sizes (Note [Dynamic shapes compile one program per shape]
    in torchjax/compile/_dynamo.py)."""


def jit(fn=None, *, static_argnames=(), donate: bool = True, warn_after: int = 8):
    """Compile PyTorch code on tpu tensors into one jax.jit program per signature.

    Args:
        fn: an ``nn.Module`` (its forward is compiled, parameters and buffers are inputs
            of the program, never constants) or any function of tpu tensors, e.g. a whole
            train step calling ``loss.backward()`` and ``optimizer.step()``.
        static_argnames: keyword arguments passed whole as static values (hashed, part
            of the cache key) instead of being searched for tensors.
        donate: donate the buffers of state the function overwrites (parameters and
            optimizer state in a train step, BatchNorm running stats, KV caches) so XLA
            updates them in place. A buffer something else holds (a ``clone()`` or
            ``state_dict`` copy the user took, an array from ``torchjax.to_jax``) is
            copied first and the copy donated: what the user holds stays valid (Note
            [Donation never takes the user's copy] in torchjax/compile/_donate.py).
        warn_after: emit a ``RetraceWarning`` naming what changed each time the function
            traces more than this many times.

    Returns:
        A ``Jitted`` callable with the signature of ``fn``. Tensor arguments are inputs
        (CPU tensors are moved to tpu first); every other argument is static. Outputs are
        the same pytree (tuples, dicts, HF ``ModelOutput``) with tpu tensors. With grad
        mode on, outputs that depend on tensors requiring grad (arguments, parameters,
        tensors a function closes over) carry a ``grad_fn``: ``backward()`` runs the
        program's VJP, compiled.

    State the function reads or writes must be reachable from its arguments, closure,
    the globals its code names, or a bound method's ``self``; see Note [State of a
    jitted function]. Optimizers found there are switched to ``capturable=True`` (their
    step counter becomes a tpu tensor, as torch does for CUDA graphs), so the step count
    is an input, not a constant. A call that creates state traces again on the next
    call, except an Adam-like optimizer's first step, which compiles once (Note
    [Optimizer state made in a first call]); then identical signatures never retrace.
    """
    if fn is None:
        return functools.partial(
            jit, static_argnames=static_argnames, donate=donate, warn_after=warn_after
        )
    return Jitted(fn, static_argnames=static_argnames, donate=donate, warn_after=warn_after)


class Jitted:
    """A compiled PyTorch callable (see ``torchjax.jit``).

    Attributes:
        trace_count: how many times the PyTorch code was traced (one XLA compilation
            each).
        cache_hits: calls served by an existing executable.
        last_retrace_reason: what changed at the latest retrace (None before any).
        donation_copies: state buffers copied before a call because something besides
            the state held them (see ``jit``'s ``donate``).
    """

    def __init__(self, fn, *, static_argnames=(), donate=True, warn_after=8):
        self.fn = fn
        self.static_argnames = frozenset(static_argnames)
        self.donate = donate
        self.warn_after = warn_after
        self.trace_count = 0
        self.cache_hits = 0
        self._warned_host = False
        self._warned_draws = False
        self.last_retrace_reason = None
        self.donation_copies = 0
        self._entries: dict = {}
        # Note [Tensors kept as plain module attributes] in torchjax/compile/_state.py
        # (id(module), name) -> (weak reference to the module, name)
        self.attributes: dict = {}
        weakref.finalize(self, _forget_entries, self._entries)
        self._last_sig = None
        self._is_module = isinstance(fn, torch.nn.Module) or isinstance(
            getattr(fn, "__self__", None), torch.nn.Module
        )
        if not isinstance(fn, torch.nn.Module):
            functools.update_wrapper(self, fn, updated=())

    def __repr__(self):
        return f"torchjax.jit({self.fn!r}, traces={self.trace_count})"

    def __call__(self, *args, **kwargs):
        call, entry = self._lookup(args, kwargs)
        if entry is not None:
            self.cache_hits += 1
            _budget.hit(entry)
            return self._run(call, entry, args, kwargs)
        # Note [State after a trace whose program does not run] (_rollback.py)
        with put_back_on_failure(call) as before:
            seen = _made_state.before_trace(call.walk.optimizers)
            entry = self._trace(call)
            # Note [Optimizer state made in a first call]
            if entry.first_state is not None and _made_state.unchanged(seen):
                _made_state.put_back(entry.first_state)
                call, entry = self._lookup(args, {**kwargs, **call.static_kwargs})
                before.call = call
                entry = entry or self._trace(call)
            if not entry.runs_eagerly(call):
                return self._run(call, entry, args, kwargs)
            before.put_back()  # eager Python runs from the state before the trace
        return self.fn(*args, **kwargs, **call.static_kwargs)

    def _run(self, call: Call, entry: _Entry, args, kwargs):
        if entry.runs_eagerly(call):
            return self.fn(*args, **kwargs, **call.static_kwargs)
        if entry.vjp is not None and call.grad_mode:
            return entry.run_differentiable(call)
        return entry.run(call)

    def trace(self, *args, **kwargs) -> None:
        """Trace this call's signature without running it: its Python code runs now (with
        whatever it does to Python state, except that the references to the state's
        tensors, ``.grad`` and optimizer state, are put back: Note [State after a trace
        whose program does not run]), its program compiles at its first run, or inside
        ``repeat``'s loop only, where the step is never run on its own."""
        call, entry = self._lookup(args, kwargs)
        if entry is None:
            before = Before(call)
            try:
                self._trace(call)
            finally:
                before.put_back()

    def repeat(self, times: int, *args, until=None, **kwargs) -> None:
        """Run the function up to ``times`` times with these arguments as one program (a
        ``lax.while_loop`` over its trace), stopping early once the 0-d tensor argument
        ``until`` is nonzero. For steps that work in place: their writes to arguments and
        state carry from one iteration to the next and are written back at the end;
        outputs are dropped (Note [Repeating a traced step in one program] in
        torchjax/compile/_repeat.py)."""
        call, entry = self._lookup(args, kwargs)
        if entry is not None:
            _repeat.run(entry, call, times, until)
            return
        with put_back_on_failure(call):  # Note [State after a trace whose program does not run]
            _repeat.run(self._trace(call), call, times, until)

    def _lookup(self, args, kwargs):
        """This call's arguments and state, and its live cache entry (None: none yet)."""
        static_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in self.static_argnames}
        flat, spec = flatten_args(args, kwargs)
        call = Call(self, flat, spec, static_kwargs, (args, kwargs))
        entry = self._entries.get(call.key)
        if (entry is None or not entry.alive()) and self._new_attributes(call.walk.modules):
            call = Call(self, flat, spec, static_kwargs, (args, kwargs))  # with what they hold
            entry = self._entries.get(call.key)
        return call, (entry if entry is not None and entry.alive() else None)

    def _new_attributes(self, modules) -> bool:
        """Remember the plain tensor attributes of ``modules`` not seen before (Note
        [Tensors kept as plain module attributes]); whether there were any."""
        new = False
        for mod, name in _state.plain_attributes(modules):
            known = self.attributes.get((id(mod), name))
            if known is None or known[0]() is not mod:  # a freed module's id reused
                self.attributes[id(mod), name] = (weakref.ref(mod), name)
                new = True
        return new

    def _trace(self, call: Call) -> _Entry:
        with trace_lock:
            # Threads that missed the cache together wait here: the first one traces,
            # the others run what it traced.
            entry = self._entries.get(call.key)
            if entry is not None and entry.alive():
                self.cache_hits += 1
                _budget.hit(entry)
                return entry
            reason = describe_change(self._last_sig, call.sig) if self._last_sig else None
            self.trace_count += 1
            if reason is not None:
                self.last_retrace_reason = reason
                if self.trace_count > self.warn_after:
                    warnings.warn(
                        f"torchjax.jit({_name(self.fn)}) traced {self.trace_count} times; "
                        f"this time because {reason}. Keep shapes, dtypes and non-tensor "
                        "arguments fixed (pad inputs to a few sizes), or mark arguments "
                        "with static_argnames.",
                        RetraceWarning,
                        stacklevel=3,
                    )
            self._last_sig = call.sig
            entry = _Entry.trace(self, call)
            if entry.lr_assigned:  # Note [Learning rates assigned while tracing]
                raise RuntimeError(LR_ASSIGNED.format(_name(self.fn)))
            if entry.retains:
                warnings.warn(RETAINED, UserWarning, stacklevel=3)
            if call.walk.host_versions() != call.sig[-2]:  # Note [CPU tensors in the state]
                entry.single_use = True  # its key names versions that are gone now
                if not self._warned_host:
                    self._warned_host = True
                    warnings.warn(HOST_WRITES.format(_name(self.fn)), UserWarning, stacklevel=3)
            if entry.host_draws:  # Note [CPU generators a trace moves]
                entry.single_use = True
                if not self._warned_draws:
                    self._warned_draws = True
                    warnings.warn(HOST_DRAWS.format(_name(self.fn)), UserWarning, stacklevel=3)
            if not entry.single_use:
                key = call.key
                old = self._entries.get(key)
                if old is not None:
                    _budget.forget(old)
                self._entries[key] = entry
                # One entry of the process-wide budget (Note [Executable cache budget]
                # in torchjax/_budget.py); evicted, the next call traces again. The
                # callback holds the entries, not this object (nor its module).
                entries = self._entries
                _budget.admit(entry, lambda: _evict(entries, key, entry))
            return entry


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _evict(entries, key, entry) -> None:
    if entries.get(key) is entry:
        del entries[key]


def _forget_entries(entries) -> None:
    """A torchjax.jit function was freed: its executables leave the budget."""
    for entry in list(entries.values()):
        _budget.forget(entry)
    entries.clear()


class _Entry:
    """One traced signature: the compiled program and how to unpack its outputs."""

    @classmethod
    def trace(cls, jitted: Jitted, call: Call) -> _Entry:
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
                info["saved_outputs"] = [] if saved is None else saved.outputs_saved(outs, root)
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
                closed = jax.make_jaxpr(pure)(
                    call.state_arrays, _RNG_AVAL, call.arrays, call.hypers.values
                )
            finally:
                restore_escapes(escaped)
                lost = restore_grads(grads)
        if escaped:
            raise escaped_write(_name(jitted.fn), escaped[0][0])
        if lost is not None:
            raise escaped_grad(_name(jitted.fn), lost)
        self.closed = closed
        self.out_spec, out_flat, self.out_pos = info["out"]
        self.containers = info["containers"]
        self.out_grad = info["out_grad"]
        self.saved_outputs = info["saved_outputs"]
        self.new_leaves = info["new_leaves"]
        self.retains = info["retains"]
        self.constant = frozenset(j for j, grad in enumerate(self.out_grad) if not grad)
        self.layouts = info["layouts"] if any(info["layouts"]) else None
        self.out_cls = info["out_cls"]
        self.out_static = [None if isinstance(x, JaxTensor) else x for x in out_flat]
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
        fun = fun_all if not n_res else (lambda *a: fun_all(*a)[:-n_res])
        self.donated = donate
        self.compiled = jax.jit(fun, donate_argnums=donate)
        self.n_state = len(storages)
        self.vjp = VJPProgram.build(self, call, fun_all, saved, info["graph"])
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
            outs = self.compiled(*state, self.rng(), *call.arrays, *call.hypers.values)
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
        outs = _VJP.apply(VJPCall(self, call), *state, *dyn)
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


def _layout(t) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset()
