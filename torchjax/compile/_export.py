"""torchjax.export: a PyTorch module or function as a ``jax.export.Exported``.

The function is traced exactly as torchjax.jit traces it (the same program), with its
state (parameters, buffers) baked in as constants, so the result is self-contained
StableHLO: ``exported.call(*arrays)`` runs it, and ``exported.serialize()`` (needs the
flatbuffers package) gives bytes that ``jax.export.deserialize`` turns back into a
callable, without PyTorch or the Python model.
"""

from __future__ import annotations

import jax
import torch

from torchjax._compat.jax import x64
from torchjax.compile._call import Call, flatten_args
from torchjax.compile._entry import Entry
from torchjax.compile._jit import Jitted
from torchjax.compile._rollback import Before


def export(fn, *args, **kwargs):
    """Trace ``fn(*args, **kwargs)`` on tpu tensors into a ``jax.export.Exported``.

    Args:
        fn: an ``nn.Module`` or a function of tpu tensors (as for ``torchjax.jit``).
        args, kwargs: example arguments; tensor arguments become the exported function's
            inputs, in order (their shapes and dtypes are fixed), everything else is
            static.

    Returns:
        A ``jax.export.Exported`` taking the tensor arguments as jax arrays and returning
        the flat list of output arrays (the order of ``torch.utils._pytree`` leaves of
        ``fn``'s output). State writes (BatchNorm statistics in train mode) are not kept,
        nor parameters or buffers the trace assigned: export modules in ``eval()`` mode.
    """
    jitted = Jitted(fn)
    flat, spec = flatten_args(args, kwargs)
    with torch.no_grad():
        call = Call(jitted, flat, spec, {}, (args, kwargs))
        before = Before(call)
        try:
            entry = Entry.trace(jitted, call)
        finally:  # Note [State after a trace whose program does not run]
            before.put_back()
    if entry.containers is not None:
        # Note [Containers a compiled function changes]
        raise RuntimeError(
            "torchjax.export: the function changes a list or dict it takes; an exported "
            "program returns arrays only. Return the new values instead"
        )
    state, rng, n_out = call.state_arrays, entry.rng(), len(entry.out_pos)

    def run(*arrays):
        return entry.compiled(*state, rng, *arrays)[:n_out]

    with x64(True):
        return jax.export.export(jax.jit(run))(*call.arrays)
