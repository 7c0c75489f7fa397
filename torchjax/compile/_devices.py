"""The error of a compiled call whose inputs sit on devices that cannot meet.

Note [Inputs of a compiled call on other devices]
A ``torchjax.jit`` program is one ``jax.jit`` executable over one set of devices: the
active mesh's (``torchjax.mesh``), or the devices its inputs are committed to. An input
that is uncommitted (tpu:0, Note [Uncommitted arrays on tpu:0] in
torchjax/tensor/_fills.py) joins any of them; one committed elsewhere (a tensor on
tpu:3 under a mesh of devices 0-1, or sharded on one mesh and used under another) is
refused by jax with a message that prints the whole program (tens of KB of jaxpr). The
call raises ``ValueError`` (jax's type) naming the tensor instead: its parameter or
buffer name, or its optimizer state entry, its devices, the mesh's, and the fix (place
it on the mesh with ``torchjax.sharding.shard_``). Such an input can also fail the
trace before jax sees it (torch.optim's foreach step refuses a parameter whose gradient
the trace computed on the mesh's devices, ``_group_tensors_by_device_and_dtype``): an
error while tracing is replaced by the same ``ValueError`` when an input is placed so
(``trace_error``), the trace's own error chained to it.
"""

from __future__ import annotations

import jax


def _ids(arr) -> list[int]:
    return [d.id for d in arr.sharding._device_assignment]


def _names(call) -> dict:
    """id(storage) -> a readable name of the tensor that owns it."""
    names = {}
    for m in call.walk.modules[:1]:  # the first walked module is a root: full dotted names
        for kind, named in (("parameter", m.named_parameters()), ("buffer", m.named_buffers())):
            for name, t in named:
                names.setdefault(id(getattr(t, "_storage", None)), f"{kind} {name!r}")
    params = {}
    for opt in call.walk.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                params[id(p)] = names.get(id(getattr(p, "_storage", None)), "")
        for p, st in opt.state.items():
            owner = params.get(id(p)) or f"a parameter of shape {tuple(p.shape)}"
            for k, v in st.items():
                key = id(getattr(v, "_storage", None))
                names.setdefault(key, f"optimizer state {k!r} of {owner}")
    return names


def _describe(i: int, call, names: dict) -> str:
    n_state = len(call.storages)
    if i < n_state:
        t = call.walk.tensors[i]
        name = names.get(id(call.storages[i]), "a tensor it reads")
        return f"{name} (shape {tuple(t.shape)})"
    if i > n_state and i - n_state - 1 < len(call.arrays):
        j = i - n_state - 1
        return f"tensor argument {j} (shape {tuple(call.arrays[j].shape)})"
    return f"input {i}"


def incompatible_devices(fn_name: str, call, inputs) -> ValueError | None:
    """The error for ``inputs`` (the program's arguments, in order) when one is committed
    to devices the others or the active mesh do not use; None when none is."""
    committed = [
        (i, a)
        for i, a in enumerate(inputs)
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and a.committed
    ]
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:
        mesh = None
    if mesh is not None and not mesh.empty:
        want = [d.id for d in mesh._flat_devices_tuple]
        where = f"the active mesh {dict(mesh.shape)} (devices {want})"
    elif committed:
        want = _ids(committed[0][1])
        where = f"{_describe(committed[0][0], call, {})} (devices {want})"
    else:
        return None
    bad = [(i, a) for i, a in committed if _ids(a) != want]
    if not bad:
        return None
    names = _names(call)
    i, a = bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return ValueError(
        f"torchjax.jit({fn_name}): {_describe(i, call, names)}{more} is on devices "
        f"{_ids(a)}, but the compiled program runs on {where}; one program runs on one "
        "set of devices. Place it there first: torchjax.sharding.shard_(t, P()) inside "
        "the mesh replicates it (or give it its PartitionSpec), or .to() the other "
        "tensors' device without a mesh."
    )


def trace_error(fn_name: str, call) -> ValueError | None:
    """``incompatible_devices`` for a call whose trace failed: its state and tensor
    arguments in the program's order (the random key and the hyperparameters, made by
    torchjax and never committed elsewhere, left out)."""
    return incompatible_devices(fn_name, call, (*call.state_arrays, None, *call.arrays))
