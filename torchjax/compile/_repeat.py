"""``Jitted.repeat``: a traced function run many times as one program.

Note [Repeating a traced step in one program]
A step function that works by writing its tensor arguments and state in place (a decode
step writing a token buffer, a position and a KV cache) is traced once by torchjax.jit as
a pure function (state, RNG input, arguments) -> (outputs, written state, written
arguments). ``repeat`` runs that function inside one ``lax.while_loop``: the carry is the
loop count, the written state and the written arguments; everything the step only reads
(parameters, a mask) is a loop invariant; iteration ``i`` takes the RNG input call ``i``
would take (the counter moved by ``i`` calls' draws, or, for a step that seeds, the state
its seed leaves: Note [Compiled draws are eager's draws] in torchjax/tensor/random.py), so
draws differ from step to step as in eager and ``torch.manual_seed`` replays them. The
loop stops after ``times`` iterations, or earlier once the 0-d tensor argument ``until``
(written by the step) is nonzero, checked before each iteration. Afterwards the written
state and arguments are written back as after the calls made; the RNG counter moves as
after ``times`` calls (reading how many ran would wait for the loop).

What it needs from the step, else it raises: no state created by the trace (lazily made
optimizer state: run the step once first), no autograd through it (grad mode off), and
``until`` one of the tensor arguments, no list or dict argument changed (Note
[Containers a compiled function changes] in _containers.py). Outputs of the step are
dropped. Each (signature, ``until``) is one more program, kept with the step's cache
entry (and evicted with it).
The Python code of the step runs only at trace time: anything it would do between
iterations (a Python counter, a host read) happens once, as in any torchjax.jit call.
The step's device checks ride in the carry, the first failing iteration's kept, and are
reported after the loop as after one call (Note [Device checks of compiled programs]).
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun

from torchjax import _budget
from torchjax._compat.jax import named, x64_enter, x64_exit
from torchjax.compile._aliases import root
from torchjax.device import _checks
from torchjax.tensor import random as _rng

# Note [A first call in the loop's program]
# A decode loop starts from state that another program makes: compiled generation's
# first token (Note [The step after the prefill] in
# torchjax/integrations/transformers/_decode.py) writes the token buffer, the position
# and the flags that the decode step then carries. As two programs, the first costs a
# program call of its own between the prefill and the loop: its dispatch, its results
# written back, host time the device waits on. ``repeat(..., first=(f, args, kwargs))``
# makes that call once before the loop, and inside the loop's program where it can: both
# signatures traced, ``f`` writing only tensor arguments (no state, nothing created, no
# list or dict it takes changed, no autograd), and each tensor it writes that the step
# takes being the very tensor the step takes (not another view of its memory, nor the
# step's state). The program then runs ``f``'s trace, feeds what it wrote into the
# step's arguments (in place of their values before the call, which the program takes
# but does not read) and runs the loop; ``f``'s writes are written back, then the
# loop's, its RNG input is the one its own call would take, drawn before the loop's,
# and its device checks are reported first: as the two calls one after the other.
# Otherwise ``f`` runs on its own first, as a call. Its outputs are dropped either way.
# Each (step signature, ``until``, ``f``'s signature) is one more program.


class First:
    """A call of ``jitted`` (a torchjax.jit function) made once before a repeated step:
    inside the loop's program where it can (Note [A first call in the loop's program])."""

    def __init__(self, jitted, args, kwargs):
        self.jitted, self.args, self.kwargs = jitted, args, dict(kwargs)
        self.call, self.entry = jitted._lookup(args, self.kwargs)  # pops static kwargs
        self.subst = None

    def joins(self, call) -> bool:
        """Whether this call can run in the program of the step ``call`` (see the Note);
        if so, ``subst`` pairs each step argument it writes with its written argument."""
        entry, mine = self.entry, self.call
        if (
            entry is None
            or entry.runs_eagerly(mine)
            or (entry.vjp is not None and mine.grad_mode)
            or entry.written
            or entry.created
            or entry.containers is not None
            or entry.pred
        ):
            return False
        written = [mine.tensors[m] for m in entry.args_written]
        at = {id(root(t)): i for i, t in enumerate(written)}
        if any(id(s) in at for s in call.storages):
            return False
        subst = []
        for k, t in enumerate(call.tensors):
            i = at.get(id(root(t)))
            if i is not None:
                if t is not written[i]:
                    return False
                subst.append((k, i))
        self.subst = tuple(subst)
        return True

    def run_alone(self) -> None:
        """Make the call on its own, as ``jitted(*args, **kwargs)`` would."""
        if self.entry is None:
            self.jitted(*self.args, **self.kwargs, **self.call.static_kwargs)
            return
        self.jitted.cache_hits += 1
        _budget.hit(self.entry)
        self.jitted._run(self.call, self.entry, self.args, self.kwargs)

    def ran_in_program(self, written, checks) -> None:
        """Write back what the call wrote in the loop's program, and report its checks."""
        self.jitted.cache_hits += 1
        _budget.hit(self.entry)
        self.entry.write_back(self.call, written)
        _checks.report_program(checks, self.entry.checks_at_call)


def run(entry, call, times: int, until, first: First | None = None) -> None:
    """Run ``entry`` (a traced step of ``call``'s signature) up to ``times`` times in one
    program, stopping early when the tensor argument ``until`` is nonzero; with ``first``
    (which ``joins`` ``call``), its call before the loop in the same program."""
    if entry.vjp is not None and call.grad_mode:
        raise RuntimeError(
            "torchjax.jit(...).repeat runs without autograd: call it under torch.no_grad()"
        )
    if entry.created:
        raise RuntimeError(
            "torchjax.jit(...).repeat: the step creates state when traced (e.g. an "
            "optimizer's lazily made buffers); call it once normally before repeating it"
        )
    if entry.containers is not None:
        raise RuntimeError(
            "torchjax.jit(...).repeat: the step changes a list or dict it takes (Note "
            "[Containers a compiled function changes]), which a loop of its program "
            "cannot repeat; call it once per step instead"
        )
    if until is None:
        stop = None
    else:
        stop = next((k for k, t in enumerate(call.tensors) if t is until), None)
        if stop is None or until.dim() != 0:
            raise ValueError(
                "torchjax.jit(...).repeat: until= must be a 0-d tensor passed as an "
                f"argument of the step, got {type(until).__name__} of shape "
                f"{tuple(getattr(until, 'shape', ()))}"
            )
    loops = entry.__dict__.setdefault("loops", {})
    if first is None:
        program = loops.get(stop)
        if program is None:
            program = loops[stop] = _program(entry, stop)
    else:  # held weakly: the first call's entry may be evicted (Note [Executable cache budget])
        key = (stop, id(first.entry), first.subst)
        held = loops.get(key)
        if held is None or held[0]() is not first.entry:
            held = loops[key] = (weakref.ref(first.entry), _program(entry, stop, prior=first))
        program = held[1]
    token = x64_enter()
    try:
        if first is None:
            written, args_written, checks = program(
                call.state_arrays, entry.rng(times), call.arrays, call.hypers.values, times
            )
        else:
            mine = first.call
            inputs = (mine.state_arrays, first.entry.rng(), mine.arrays, mine.hypers.values)
            firsts, first_checks, written, args_written, checks = program(
                *inputs, call.state_arrays, entry.rng(times), call.arrays, call.hypers.values, times
            )
    finally:
        x64_exit(token)
    if first is not None:
        first.ran_in_program(firsts, first_checks)
    entry.write_back(call, [*written, *args_written])
    _checks.report_program(checks, entry.checks_at_call)


def _program(entry, stop, prior: First | None = None):
    fun = jaxpr_as_fun(entry.closed)
    state_w, args_w, n_out = entry.written, entry.args_written, entry.n_out
    n_written = len(state_w)
    at, n_checks = entry.checks_at, entry.n_checks
    ending = entry.rng_ending
    seeded = None if ending.seeded is None else _rng.state_input(*ending.seeded)

    def rng_at(rng, i):
        """The RNG input of iteration ``i`` (Note [Repeating a traced step in one
        program])."""
        if seeded is not None:  # the input of a call after one that seeded
            return jnp.where(i == 0, rng, seeded)
        return rng.at[2].add((i * ending.advance).astype(jnp.uint32))

    def loop(state, rng, arrays, hypers, times):
        def step(carry):
            i, ws, wa, first = carry
            st, ar = list(state), list(arrays)
            for j, v in zip(state_w, ws):
                st[j] = v
            for j, v in zip(args_w, wa):
                ar[j] = v
            rest = fun(*st, rng_at(rng, i), *ar, *hypers)[n_out:]
            ends = n_written + len(args_w)  # the check outputs, saved tensors follow
            if n_checks:  # the first failing iteration's check is kept
                failed = first[0]
                first = tuple(
                    jnp.where(failed, old, new) for old, new in zip(first, rest[at : at + n_checks])
                )
            return i + 1, tuple(rest[:n_written]), tuple(rest[n_written:ends]), first

        def more(carry):
            i, _, wa, _ = carry
            go = i < times
            if stop is not None:
                flag = wa[args_w.index(stop)] if stop in args_w else arrays[stop]
                go = go & (flag == 0)
            return go

        start = (
            jnp.int32(0),
            tuple(state[j] for j in state_w),
            tuple(arrays[j] for j in args_w),
            _no_failure() if n_checks else (),
        )
        _, ws, wa, first = jax.lax.while_loop(more, step, start)
        return list(ws), list(wa), list(first)

    # Nothing is donated: inside the loop XLA updates the carry in place, so the written
    # state costs one copy per repeat() call, not per iteration.
    if prior is None:
        return jax.jit(named(loop, f"{entry.name}_repeated"))
    # Numbers and the trace only: the program keeps no entry alive.
    before, subst = prior.entry, prior.subst
    before_fun = jaxpr_as_fun(before.closed)
    args_at = before.n_out + len(before.written) + len(before.created)
    args_end = args_at + len(before.args_written)
    checks_at = before.n_out + before.checks_at
    checks_end = checks_at + before.n_checks
    del before

    def first_then_loop(state1, rng1, arrays1, hypers1, state, rng, arrays, hypers, times):
        # Note [A first call in the loop's program]
        rest = before_fun(*state1, rng1, *arrays1, *hypers1)
        written = list(rest[args_at:args_end])
        checks = list(rest[checks_at:checks_end])
        arrays = list(arrays)
        for k, i in subst:
            arrays[k] = written[i]
        return (written, checks, *loop(state, rng, arrays, hypers, times))

    return jax.jit(named(first_then_loop, f"{entry.name}_repeated"))


def _no_failure():
    # The check outputs of a program that found nothing (Note [Device checks of
    # compiled programs] in torchjax/device/_checks.py).
    return (
        jnp.bool_(False),
        jnp.zeros((2,), jnp.int64),
        jnp.zeros((2,), jnp.float64),
        jnp.int32(0),
    )
