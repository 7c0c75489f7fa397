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

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun

from torchjax._compat.jax import named, x64_enter, x64_exit
from torchjax.device import _checks
from torchjax.tensor import random as _rng


def run(entry, call, times: int, until) -> None:
    """Run ``entry`` (a traced step of ``call``'s signature) up to ``times`` times in one
    program, stopping early when the tensor argument ``until`` is nonzero."""
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
    program = loops.get(stop)
    if program is None:
        program = loops[stop] = _program(entry, stop)
    token = x64_enter()
    try:
        written, args_written, checks = program(
            call.state_arrays, entry.rng(times), call.arrays, call.hypers.values, times
        )
    finally:
        x64_exit(token)
    entry.write_back(call, [*written, *args_written])
    _checks.report_program(checks, entry.checks_at_call)


def _program(entry, stop):
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
    return jax.jit(named(loop, f"{entry.name}_repeated"))


def _no_failure():
    # The check outputs of a program that found nothing (Note [Device checks of
    # compiled programs] in torchjax/device/_checks.py).
    return (
        jnp.bool_(False),
        jnp.zeros((2,), jnp.int64),
        jnp.zeros((2,), jnp.float64),
        jnp.int32(0),
    )
