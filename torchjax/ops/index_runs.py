"""Index writes at one run of positions, as dynamic-update-slices.

Note [Index writes at a run of positions]
A static KV cache is written with ``index_copy_`` (transformers' ``StaticLayer.update``:
``keys.index_copy_(2, cache_position, key_states)``) or with ``x[:, :, idx] = v``
(``index_put_``); a decode step writes one position, a prefill a run of them. Lowered as
a scatter, each write is something XLA must treat as indices in any order, possibly
repeated; the write is a ``lax.dynamic_update_slice``, the cheapest write there is to
compile and to run. Measured on a TPU v5e (jax alone, 32 writes into (1, 8, 256, 64)
bfloat16 caches at a traced position, two runs): one position 0.86-1.12 s as scatters
against 0.41-0.55 s as dynamic-update-slices, 128 positions 0.58-0.61 s against
0.41-0.55 s (``python -m bench.tpu --sections compiles``, ``cache_writes``). That is
small beside a whole ``generate`` of the 1.1B Llama (bench/cold_start.py's call, fresh
processes, two each, the writes' lowering switched): the decode loop compiled in 8.2-8.5 s
with one-position slice writes against 8.5 s with scatters, within run-to-run noise; the
prefill in 12.6-13.2 s with every write a slice against 13.3-13.5 s. XLA:CPU already
turns a scatter of one index into a dynamic-update-slice: on CPU nothing moves.

So ``index_copy`` and ``index_put`` (one integer index after leading full dims, no
``accumulate``) choose their lowering per call, at the torch level before the program is
traced (their ``@handler``s in torchjax/ops/index_along_dim.py and
torchjax/ops/indexing.py), between the scatter and ``write_run`` here, when the index is
*known* to name one run of consecutive positions in ascending order:

- one element: known from its shape alone, whatever its value, traced or not (every
  decode step's write: its position is traced inside the loop);
- more elements whose values are on the host without reading the device: a CPU index
  tensor, or inside a trace (``torchjax.jit``, the Dynamo backend) a value made from
  constants (Note [Values made from constants inside a trace] in
  torchjax/ops/executables.py: ``torch.arange(p, p + n)`` with a Python ``p``), read
  once, when traced. Every value must be in range (negative ones wrapped where the op
  wraps them) and each one more than the one before; anything else (an out-of-range
  value included) takes the scatter, whose check names it.

Exactly the scatter's result: a run holds no position twice, so torch's rule for
duplicate indices never applies, and the positions in order are the slice. The range
check stays (``_check_range``, a device check: Note [Device-side checks]): for a traced
position it is the only guard, as ``dynamic_update_slice`` clamps its start where the
scatter dropped the write, so an out-of-range position raises as eager raises, after a
``torchjax.jit`` call and a compiled ``generate`` too; only in a user's own ``jax.jit``,
where no Python runs after the program, does the clamped write land at the edge.

Not recognised: a traced index computed as ``arange(n) + offset`` with a traced
``offset``, as a prefill's ``cache_position`` is when the cache's ``cumulative_length``
is state of the program. Nothing in the index's value says it is a run; knowing it would
take the producing ops (a mark set by ``add`` on its result, or the trace's equations).
A compiled ``generate``'s prefill into an empty cache traces with the length known
instead (Note [The prefill of an empty cache] in
torchjax/integrations/transformers/_cache_state.py), so its writes are slices; a
prefill into a cache that holds tokens keeps the scatter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchjax._compat.jax import trace_state_clean
from torchjax.ops.executables import FOLD_ELEMENTS
from torchjax.tensor._tensor import JaxTensor

_NOT_INDICES = frozenset({torch.bool, torch.uint8})


def _host_values(index: torch.Tensor) -> np.ndarray | None:
    """``index``'s values when they are known without a device read (see the Note), else
    None: in eager a tpu tensor's values are on the device (reading them would wait for
    it), and inside a trace a traced one has none."""
    if index.numel() > FOLD_ELEMENTS:
        return None
    if not isinstance(index, JaxTensor):
        return index.numpy()
    if trace_state_clean():
        return None
    arr = index._value()
    if isinstance(arr, jax.core.Tracer):
        return None
    return np.asarray(arr)


def known_run(index, size: int, *, negative: bool) -> bool:
    """Whether the integer tensor ``index`` is known to name one run of consecutive
    positions, ascending, along a dim of ``size`` (Note [Index writes at a run of
    positions]). ``negative``: the op wraps negative indices (``index_put``; ``index_copy``
    refuses them)."""
    if not isinstance(index, torch.Tensor) or index.dtype in _NOT_INDICES:
        return False
    if index.is_floating_point() or index.is_complex():
        return False
    if index.numel() == 1:
        return True
    if index.dim() != 1 or index.numel() == 0:
        return False
    values = _host_values(index)
    if values is None:
        return False
    if negative:
        values = np.where(values < 0, values + size, values)
    return bool(values[0] >= 0 and values[-1] < size and np.all(values[1:] - values[:-1] == 1))


def write_run(arr: jax.Array, dim: int, index: jax.Array, update: jax.Array, *, negative):
    """``arr`` with ``update`` written at positions ``index`` (a run: ``known_run``) along
    ``dim``: a ``dynamic_update_slice`` starting at ``index``'s first element (wrapped when
    ``negative``). ``update`` has ``arr``'s shape but ``index.size`` along ``dim``. The
    range check is the caller's."""
    start = index.reshape(-1)[0]
    if negative:
        start = jnp.where(start < 0, start + arr.shape[dim], start)
    return lax.dynamic_update_slice_in_dim(arr, update.astype(arr.dtype), start, axis=dim)
