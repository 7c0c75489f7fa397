"""Which old values a plain eager in-place ``_foreach_*`` call gives to XLA, and the
executable that takes them (Note [In-place foreach calls donate their old values]).

Note [In-place foreach calls donate their old values]
A compiled in-place foreach call (Note [Compiled foreach] in
torchjax/ops/foreach_compiled.py) makes the new values of its whole lead list in one
program, and the old ones went only when the results were written back: the call held
both lists at once. torch.optim's foreach AdamW over a 1.1B model in bfloat16 peaked at
15.45 GiB of the chip's 15.75 so (parameters, gradients and moments are 8.3 GiB; each
in-place call added a list of 2.2 GB on top of its temporaries). So outside a trace, and
where nothing records it, the call donates the lead list's arrays to its program when
every one of them is held by nothing but its own storage (and its tensor's read cache)
and the call's argument list: the reference count of Note [Donation never takes the
user's copy] in torchjax/compile/_donate.py; a clone sharing the array, a view's read
cache, an array taken with ``torchjax.to_jax`` or a list naming one tensor twice all
count, as does an array user JAX code may hold under another name (Note [Arrays shared
with JAX code are not donated] in torchjax/tensor/_shared_arrays.py), and then nothing
is donated (``torchjax.stats()["foreach_donations"]`` counts
the arrays given). All or none: jax gives each output the first
donated input of its shape and dtype left, so donating part of the list could alias an
element's buffer with another element's new value (a copy, not a wrong value, but the
memory again). Only whole single-device arrays are donated. The donating executable is
a second ``jax.jit`` of the same function, kept on the first (it goes with it); a
training loop's calls all donate, so only it compiles. A call whose program does not fit
in device memory, having consumed nothing, runs element by element from then on, with a
``ResourceWarning`` once, as a fused segment does (Note [A segment that fails as one
program runs op by op] in torchjax/ops/fused_run.py).
"""

from __future__ import annotations

import jax

from torchjax._compat.jax import trace_state_clean
from torchjax.device import _stats
from torchjax.ops.fused_run import donatable
from torchjax.ops.xla_options import COMPILER_OPTIONS
from torchjax.tensor._storage import Storage


def positions(lead: list, dyn: list, at: int) -> tuple:
    """The positions in ``dyn`` (the call's only list of its arrays; ``lead``'s arrays at
    ``at`` on) to donate: every lead element's, or none."""
    if not trace_state_clean():
        return ()
    for k, t in enumerate(lead):
        j = at + k
        s = t._storage
        if s.__class__ is not Storage or s.lazy is not None or s.arr is not dyn[j]:
            return ()
        if not donatable(dyn, j, 1 + (t._cache is dyn[j])):
            return ()
    return tuple(range(at, at + len(lead)))


def call(run, dyn: list, donated: tuple):
    """``run(*dyn)`` with the arrays at ``donated`` given to XLA."""
    table = getattr(run, "donating", None)
    if table is None:
        table = run.donating = {}
    prog = table.get(donated)
    if prog is None:
        prog = table[donated] = jax.jit(
            run.__wrapped__, donate_argnums=donated, compiler_options=COMPILER_OPTIONS
        )
    out = prog(*dyn)
    _stats.COUNTERS.donations += len(donated)
    return out
