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
   trace becomes a ClosedJaxpr, compiled by ``jax.jit`` with the written state donated
   (``Entry.trace``, torchjax/compile/_entry.py).
5. Run the executable; write back written state; fill created state (``Entry.run``).

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
"""

from __future__ import annotations

import functools
import warnings
import weakref

import torch

from torchjax import _budget
from torchjax.compile import (
    _made_state,
    _repeat,
    _state,
)
from torchjax.compile._call import (
    Call,
    describe_change,
    flatten_args,
)
from torchjax.compile._devices import trace_error
from torchjax.compile._entry import Entry, _name
from torchjax.compile._host_rng import HOST_DRAWS
from torchjax.compile._refusals import (
    HOST_WRITES,
    LR_ASSIGNED,
    RETAINED,
)
from torchjax.compile._rollback import Before, put_back_on_failure
from torchjax.compile._vjp import VJPCall
from torchjax.tensor._binding import trace_lock


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

    # Note [Captured module calls] (_captured.py): programs traced as fused eager runs ops.
    captured = False
    # What runs one differentiable call through torch's autograd (_VJP).
    vjp_call = VJPCall

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
        _state.python_ran()  # Note [A module walked once within a block]
        return self.fn(*args, **kwargs, **call.static_kwargs)

    def _run(self, call: Call, entry: Entry, args, kwargs):
        if entry.runs_eagerly(call):
            _state.python_ran()  # Note [A module walked once within a block]
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
            self._trace_only(call)

    def _trace_only(self, call: Call) -> None:
        """Trace ``call`` without running its program (Note [State after a trace whose
        program does not run])."""
        before = Before(call)
        try:
            self._trace(call)
        finally:
            before.put_back()

    def repeat(self, times: int, *args, until=None, when=None, first=None, **kwargs) -> bool:
        """Run the function up to ``times`` times with these arguments as one program (a
        ``lax.while_loop`` over its trace), stopping early once the 0-d tensor argument
        ``until`` is nonzero. For steps that work in place: their writes to arguments and
        state carry from one iteration to the next and are written back at the end;
        outputs are dropped (Note [Repeating a traced step in one program] in
        torchjax/compile/_repeat.py).

        ``when``: a function of no arguments, asked once this call's signature is traced
        (a signature not traced before is traced first as by ``trace``: its Python runs,
        its program does not); the loop runs only if it returns True, so a caller can
        look at what the trace did (the Python state it left) and decide, with one
        lookup of the call on a signature traced before. Returns whether the loop ran.

        ``first``: ``(f, args, kwargs)``, a call of another torchjax.jit function ``f``
        made once before the loop, whether the loop runs or not (its result dropped):
        inside the loop's program where it can, its writes to the step's arguments then
        the loop's starting values (Note [A first call in the loop's program] in
        torchjax/compile/_repeat.py), else on its own, first."""
        before = _repeat.First(*first) if first is not None else None
        call, entry = self._lookup(args, kwargs)
        if before is not None and (entry is None or not before.joins(call)):
            before.run_alone()
            before = None
            call, entry = self._lookup(args, {**kwargs, **call.static_kwargs})
        if when is not None:
            if entry is None:
                self._trace_only(call)
                if not when():
                    return False
                # As a call made after ``trace``: keyed by what the trace left.
                call, entry = self._lookup(args, {**kwargs, **call.static_kwargs})
            elif not when():
                if before is not None:
                    before.run_alone()
                return False
        if entry is not None:
            _repeat.run(entry, call, times, until, before)
            return True
        with put_back_on_failure(call):  # Note [State after a trace whose program does not run]
            _repeat.run(self._trace(call), call, times, until)
        return True

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

    def _trace(self, call: Call) -> Entry:
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
            try:
                entry = Entry.trace(self, call)
            except (RuntimeError, ValueError) as e:
                # Note [Inputs of a compiled call on other devices]
                err = trace_error(_name(self.fn), call)
                if err is None:
                    raise
                raise err from e
            call.key_after_trace()  # Note [A module's plain attributes are guards]
            self._last_sig = call.sig
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


def _evict(entries, key, entry) -> None:
    if entries.get(key) is entry:
        del entries[key]


def _forget_entries(entries) -> None:
    """A torchjax.jit function was freed: its executables leave the budget."""
    for entry in list(entries.values()):
        _budget.forget(entry)
    entries.clear()
