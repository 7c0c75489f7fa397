"""Which state buffers a jitted call may donate to XLA.

Note [Donation never takes the user's copy]
A jitted train step donates the buffers of the state it overwrites (parameters,
optimizer state) so XLA updates them in place; a donated buffer is deleted. jax arrays
are immutable, so eager torchjax shares them freely: ``clone()`` of a whole tensor,
``copy_`` of one whole tensor into another, a ``state_dict`` of clones and
``load_state_dict`` all leave two Storage objects holding one jax.Array. Deleting it at
the next step would destroy what the user holds ("Array has been deleted"), where torch
gives them their own memory. So before each call every buffer to be donated is checked
for holders besides its own Storage and the call's argument list (Python's reference
count: another Storage, a tensor's read cache, an array taken with ``torchjax.to_jax``);
a held buffer is copied first and the copy donated, so the holder keeps its values and
the state still updates in place. So is an array user JAX code may hold under another
name (Note [Arrays shared with JAX code are not donated] in
torchjax/tensor/_shared_arrays.py). A cached read of the state tensor itself does not
count (it is dropped at the write back). The count is conservative: a spurious holder
costs one copy, never a deleted buffer. In a training loop nothing else holds the
buffers, and nothing is copied (``Jitted.donation_copies`` counts copies).
"""

from __future__ import annotations

import jax

from torchjax.ops.fused_run import held_only_by
from torchjax.tensor._shared_arrays import shared


def unshared(state_arrays, donated, tensors):
    """``state_arrays`` with a fresh copy in place of each donated buffer something else
    holds; ``tensors[i]``: the state tensor of storage ``i`` (its read cache is its own).
    Returns (arrays, number of copies)."""
    out, copies = state_arrays, 0
    for i in donated:
        # Held by its Storage (and its tensor's read cache, which is its own) and the
        # argument list alone: donated as it is.
        owned = 1 + (tensors[i]._cache is state_arrays[i])
        if not held_only_by(state_arrays, i, owned) or shared(state_arrays[i]):
            if copies == 0:
                out = list(state_arrays)
            out[i] = _copy(state_arrays[i])
            copies += 1
    return out, copies


def _copy(a: jax.Array) -> jax.Array:
    # An uncommitted array (tpu:0, Note [Uncommitted arrays on tpu:0] in
    # torchjax/tensor/_fills.py) is copied uncommitted: naming its sharding would commit
    # the copy to device 0, and a program over a mesh's devices refuses such an argument.
    return jax.device_put(a, a.sharding if a.committed else None, may_alias=False)
