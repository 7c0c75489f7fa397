"""Integer and boolean ops on small tpu tensors whose values the host holds, run there.

Note [Integer ops on host values]
Python code around a model does its bookkeeping on small integer tensors it made from
host data: transformers' ``generate`` compares the EOS and pad ids (``isin``, ``any``),
builds position ids from the attention mask (``cumsum``, ``sub``, ``masked_fill``),
checks the mask (``eq``, ``all``) and reads each answer back. On "tpu" each such op is a
device program call (some 0.3 ms of host time each on the chip), and each read back
waits for the device to finish everything queued before it. The inputs' values are on
the host already (Note [Host values of tensors made from host data] in
torchjax/tensor/_shadows.py), so the op runs there instead: torch's own CPU kernel on
those values, the result copied to the inputs' tpu device as any CPU tensor is
(``.to(device)``), which keeps its values on the host too, so the next op and the read
back need no device either. A call CPU refuses runs on the device instead, which raises
the op's error as it always has (its text, and the device's earlier failures first).

Which calls: an op of ``OPS`` (functional: it writes no argument and returns no view;
deterministic) outside any trace (``torchjax.jit``, ``jax.jit``: a host value there
would be a constant of the program), whose every tensor argument is a tpu tensor of one
device with host values, and whose inputs and results are all integer or bool. Such
results are exact: CPU's kernel is the reference the tpu lowerings are tested against,
and integer arithmetic has one answer (a float result, from ``int_t * 0.5`` or a float
``dtype=``, is dropped and the op runs on the device as before). Any other call runs
on the device as before. ``torchjax.stats()["host_ops"]`` counts these calls.
"""

from __future__ import annotations

import torch

from torchjax._compat.jax import trace_state_clean
from torchjax._compat.torch import pytree
from torchjax.device import _stats
from torchjax.device._module import jax_device
from torchjax.tensor import _shadows, _tensor

aten = torch.ops.aten

_EXACT = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
)  # fmt: skip

_NAMES = (
    # comparisons
    "eq.Tensor", "eq.Scalar", "ne.Tensor", "ne.Scalar", "lt.Tensor", "lt.Scalar",
    "le.Tensor", "le.Scalar", "gt.Tensor", "gt.Scalar", "ge.Tensor", "ge.Scalar",
    "isin.Tensor_Tensor", "isin.Tensor_Scalar", "isin.Scalar_Tensor",
    # logic and bits
    "logical_not.default", "logical_and.default", "logical_or.default",
    "logical_xor.default", "bitwise_not.default", "bitwise_and.Tensor",
    "bitwise_and.Scalar", "bitwise_or.Tensor", "bitwise_or.Scalar", "bitwise_xor.Tensor",
    "bitwise_xor.Scalar",
    # arithmetic
    "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Tensor", "rsub.Scalar",
    "mul.Tensor", "mul.Scalar", "neg.default", "abs.default", "maximum.default",
    "minimum.default", "remainder.Tensor", "remainder.Scalar", "clamp.default",
    # reductions and scans
    "any.default", "any.dim", "any.dims", "all.default", "all.dim", "all.dims",
    "sum.default", "sum.dim_IntList", "amax.default", "amin.default", "max.default",
    "min.default", "argmax.default", "argmin.default", "cumsum.default",
    # selection, copies and conversions (``_to_copy`` to another dtype on the same device)
    "_to_copy.default", "where.self", "masked_fill.Scalar", "masked_fill.Tensor", "clone.default",
    "cat.default", "stack.default", "index_select.default", "gather.default",
    "flip.default",
)  # fmt: skip


def _ops() -> frozenset:
    out = set()
    for name in _NAMES:
        packet, overload = name.split(".")
        out.add(getattr(getattr(aten, packet), overload))
    return frozenset(out)


OPS = _ops()


def run(func, args, kwargs):
    """``func``'s result computed on the host (see the Note), or None: run it on the device."""
    # Most calls reaching here are a model's ops on tensors without host values: turned
    # away on their first such argument, before flattening (several us a call).
    for a in args:
        storage = getattr(a, "_storage", None)
        if storage is not None and not _shadows.held_by(storage):
            return None
    # Tensors only among the positional arguments (the common case) need no pytree.
    flat = not any(isinstance(v, (list, tuple, torch.Tensor)) for v in kwargs.values()) and (
        not any(isinstance(a, (list, tuple)) for a in args)
    )
    if flat:
        leaves, spec = args, None
    else:
        leaves, spec = pytree.tree_flatten((args, kwargs))
    device = None
    host = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if getattr(x, "_storage", None) is None:
                return None  # a CPU tensor, or a fake one (torch.compile tracing)
            values = _shadows.view_of(x)
            if values is None or values.dtype not in _EXACT:
                return None
            if device is None:
                device = x.device
            elif x.device != device:
                return None
            host.append(values)
        else:
            host.append(x)
    if device is None or not trace_state_clean():
        return None
    if flat:
        cpu_args, cpu_kwargs = host, kwargs
    else:
        cpu_args, cpu_kwargs = pytree.tree_unflatten(host, spec)
    if func is aten._to_copy.default:
        cpu_kwargs = _same_device_copy(cpu_kwargs, device)
        if cpu_kwargs is None:
            return None
    try:
        out = func(*cpu_args, **cpu_kwargs)
    except Exception:  # noqa: BLE001 - the device run raises the op's own error
        return None
    if isinstance(out, torch.Tensor):
        if out.dtype not in _EXACT:
            return None
        _stats.count_host_op()
        return _onto(out, device)
    results, out_spec = pytree.tree_flatten(out)
    if any(isinstance(r, torch.Tensor) and r.dtype not in _EXACT for r in results):
        return None
    _stats.count_host_op()
    moved = [_onto(r, device) if isinstance(r, torch.Tensor) else r for r in results]
    return pytree.tree_unflatten(moved, out_spec)


def _onto(result: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The CPU ``result`` as a tpu tensor on ``device``: its values put there when a device
    op first reads them (Note [Host values put on the device when first read] in
    torchjax/tensor/_shadows.py), or copied now where that does not apply."""
    index = device.index or 0
    storage = _shadows.host_storage(result, jax_device(index))
    if storage is None:
        return result.to(device)
    return _tensor.make(storage, tuple(result.shape), result.stride(), 0, result.dtype, index)


def _same_device_copy(kwargs: dict, device) -> dict | None:
    """``_to_copy``'s keywords for its CPU run: None unless it stays on ``device`` (a copy
    to CPU is a read, answered from the host values already; pinned memory is CPU's)."""
    to = kwargs.get("device")
    if to is not None and torch.device(to) != device:
        return None
    if kwargs.get("pin_memory") or kwargs.get("layout") not in (None, torch.strided):
        return None
    return {k: v for k, v in kwargs.items() if k != "device"}


_tensor.HOST_OPS.update(dict.fromkeys(OPS, run))
