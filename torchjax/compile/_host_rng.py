"""The CPU generators a torchjax.jit trace moves.

Note [CPU generators a trace moves]
A jitted function's Python runs once per trace, and with it whatever it does to CPU's
random generators: ``torch.manual_seed`` seeds CPU's default generator as well as the
tpu devices, and a CPU draw (``torch.randn(3)`` moved to tpu, ``torch.randn(3,
generator=g)`` with a generator passed in) is read at trace time and becomes a constant
of the program. Cache hits then neither seeded CPU's generator nor drew from it: the
generator was left where eager would not leave it, and every call returned the first
call's "random" values.

So the trace compares each CPU generator it can see (the default one, and every
``torch.Generator`` the state walk finds: arguments, closures, globals; Note [State of a
jitted function]) before and after. A generator the trace seeded ends in a state that
depends on the seed and the draws after it alone, and the values drawn after the seed
are the same on every call, so the program is right to hold them: each call sets the
generator to the state the trace left, as eager leaves it. The default generator counts
as seeded when ``torch.manual_seed`` ran in the trace (seen by the tpu seed it sets, Note
[Seeds set inside a trace] in torchjax/tensor/random.py; not when a ``fork_rng`` or a
checkpoint put back a state saved before it), even if it ended where it began (seeded
with the seed it already had); another generator when its ``initial_seed()`` changed. A
generator the trace drew from without seeding it (``torch.seed()`` included, which seeds
with a value drawn at random) gives new values on every eager call, which no program can
hold: the entry is used once, so every call traces again and repeats the draws, with a
warning (as for CPU tensors the function writes, Note [CPU tensors in the state] in
torchjax/compile/_state.py). Not told apart: CPU draws made before a seed in the same
call (taken as seeded: the program holds the first call's values), and a generator
other than the default one seeded with the seed it already had (taken as drawn from if
it moved, else as untouched).
"""

from __future__ import annotations

import torch

HOST_DRAWS = (
    "torchjax.jit({}): the function draws random numbers on CPU (torch.randn(...) "
    "without device='tpu', or a CPU torch.Generator) without seeding first; a compiled "
    "program would repeat the first call's values, so every call traces the function "
    "again, which draws anew. Draw on tpu (device='tpu'), or pass the values in as a "
    "tensor argument, to compile the function once (Note [CPU generators a trace moves])."
)


class HostGenerators:
    """The CPU generators a trace can move, as they were before it."""

    def __init__(self, generators):
        gens = [torch.default_generator]
        gens += [g for g in generators if g.device.type == "cpu" and g is not gens[0]]
        self.before = [(g, g.get_state(), g.initial_seed()) for g in gens]

    def after(self, host_seeded: bool) -> tuple[list, bool]:
        """(the (generator, state) pairs each call sets, whether the trace drew from a
        generator it had not seeded) once the trace is over; ``host_seeded``: the trace
        seeded the default generator through ``torch.manual_seed``."""
        replay, drew = [], False
        for k, (g, state, seed) in enumerate(self.before):
            now = g.get_state()
            if k == 0 and host_seeded:
                replay.append((g, now))
            elif torch.equal(now, state):
                continue
            elif k != 0 and g.initial_seed() != seed:
                replay.append((g, now))
            else:
                drew = True
        return replay, drew


def replay_generators(states) -> None:
    """Leave each generator in the state its trace left it (a seeded call's)."""
    for g, state in states:
        g.set_state(state)
