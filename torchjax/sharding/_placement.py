"""Placing tpu tensors on a mesh: ``shard``, ``shard_``, ``sharding_of``, ``constraint``.

A sharded tpu tensor is an ordinary tpu tensor whose ``jax.Array`` carries a
``NamedSharding``: every device holds its block, and ops on it are jax computations
that XLA partitions (GSPMD), so eager ops, ``torchjax.jit`` programs and autograd keep
working unchanged and give the unsharded numbers. torchjax's per-op executables
(torchjax/ops/cached_compute.py) are ``jax.jit`` functions without ``in_shardings``: they take
the input's sharding and XLA picks the output's. ``.cpu()`` gathers the blocks.

Under ``torchjax.jit`` the tensors hold tracers: ``shard`` and ``constraint`` then add
``jax.lax.with_sharding_constraint`` to the program (the layout XLA must use there)
instead of moving data.

Autograd: ``shard``/``constraint`` are identities on values, so their backward passes
the gradient through unchanged (XLA lays it out as it sees fit).
"""

from __future__ import annotations

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec

from torchjax.device._mesh import resolve_mesh
from torchjax.tensor import dtypes
from torchjax.tensor._tensor import JaxTensor, wrap


def named_sharding(spec, mesh=None, who: str = "torchjax.sharding.shard") -> NamedSharding:
    """``NamedSharding(mesh, spec)``; ``spec`` a ``PartitionSpec``, a tuple/list of axis
    names (None for replicated dims) or a ``NamedSharding`` (returned as is)."""
    if isinstance(spec, NamedSharding):
        return spec
    if not isinstance(spec, PartitionSpec):
        if not isinstance(spec, (tuple, list)):
            raise TypeError(
                f"{who}: spec must be a jax.sharding.PartitionSpec, a tuple of mesh axis "
                f"names or a NamedSharding, got {type(spec).__name__}"
            )
        spec = PartitionSpec(*spec)
    mesh = resolve_mesh(mesh, who)
    unknown = {a for dim in spec if dim is not None for a in _axes(dim)} - set(mesh.axis_names)
    if unknown:
        raise ValueError(
            f"{who}: {spec} names axes {sorted(unknown)} that the mesh {dict(mesh.shape)} "
            f"does not have (axes: {mesh.axis_names})"
        )
    return NamedSharding(mesh, spec)


def _axes(dim):
    return dim if isinstance(dim, tuple) else (dim,)


def check_divisible(shape, sharding: NamedSharding, who: str, name: str = "tensor") -> None:
    """ValueError unless every sharded dimension of ``shape`` divides evenly."""
    for d, dim in enumerate(sharding.spec):
        if dim is None or d >= len(shape):
            continue
        parts = int(np.prod([sharding.mesh.shape[a] for a in _axes(dim)]))
        if shape[d] % parts:
            raise ValueError(
                f"{who}: cannot shard {name} of shape {tuple(shape)} with {sharding.spec}: "
                f"dim {d} ({shape[d]}) is not divisible by {parts} (mesh axes {_axes(dim)}). "
                "jax places only even blocks; pad the dimension or use another spec."
            )
    if len(sharding.spec) > len(shape):
        raise ValueError(
            f"{who}: {sharding.spec} has {len(sharding.spec)} entries but {name} has "
            f"{len(shape)} dims (shape {tuple(shape)})"
        )


def _place(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, sharding)


class _Place(torch.autograd.Function):
    """Identity on values that places the result with a sharding (see module docs)."""

    @staticmethod
    def forward(ctx, t, sharding, constrain):
        x = t._value()
        out = jax.lax.with_sharding_constraint(x, sharding) if constrain else _place(x, sharding)
        return wrap(out, t._device_index)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _to_tpu_sharded(t: torch.Tensor, sharding: NamedSharding) -> JaxTensor:
    # A CPU tensor goes straight to its blocks: the full tensor never sits on one device.
    # (Under jax.distributed every process must pass the same values.)
    host = dtypes.cpu_tensor_to_numpy(t.detach())
    arr = jax.make_array_from_callback(tuple(t.shape), sharding, lambda index: host[index])
    out = wrap(arr)
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out


def shard(t: torch.Tensor, spec, mesh=None) -> torch.Tensor:
    """``t`` placed on ``mesh`` with ``spec``: a tpu tensor whose jax.Array has a
    ``NamedSharding(mesh, spec)``.

    Args:
        t: a tpu tensor (any shape and dtype), or a CPU tensor (placed block by block:
            the full tensor never goes to one device).
        spec: a ``PartitionSpec`` (``P("tp", None)`` splits dim 0 over the mesh axis
            "tp"), a tuple of axis names, or a ``NamedSharding``. Dims beyond the spec's
            length are replicated.
        mesh: a ``jax.sharding.Mesh``; default the active one (``torchjax.mesh``).

    Returns:
        A new tpu tensor with ``t``'s values, shape and dtype (a copy: placement never
        aliases ``t``'s storage). Differentiable (identity backward). Under
        ``torchjax.jit`` it adds a sharding constraint to the program instead.

    Raises:
        ValueError: no mesh; an axis the mesh lacks; a sharded dim not divisible by the
            number of its blocks (jax places only even blocks).
        TypeError: a bad ``spec``.
    """
    sharding = named_sharding(spec, mesh)
    check_divisible(t.shape, sharding, "torchjax.sharding.shard")
    if not isinstance(t, JaxTensor):
        return _to_tpu_sharded(t, sharding)
    if t.requires_grad and torch.is_grad_enabled():
        return _Place.apply(t, sharding, False)
    return wrap(_place(t.detach()._value(), sharding), t._device_index)


def shard_(t: torch.Tensor, spec, mesh=None) -> torch.Tensor:
    """In-place ``shard``: ``t`` (a tpu tensor, e.g. an ``nn.Parameter``) keeps its
    identity and ``requires_grad``, and its data becomes the sharded array. Tied
    parameters (one Parameter in two modules) stay tied. Returns ``t``.

    Raises what ``shard`` raises; RuntimeError for a CPU tensor (move it with
    ``.to("tpu")`` first, or use ``shard`` to place it block by block).
    """
    if not isinstance(t, JaxTensor):
        raise RuntimeError(
            f"torchjax.sharding.shard_: expected a tpu tensor, got one on {t.device}; "
            "use torchjax.sharding.shard(t, spec) to place a CPU tensor"
        )
    sharding = named_sharding(spec, mesh, "torchjax.sharding.shard_")
    check_divisible(t.shape, sharding, "torchjax.sharding.shard_")
    with torch.no_grad():
        t.data = wrap(_place(t.detach()._value(), sharding), t._device_index)
    return t


def constraint(t: torch.Tensor, spec, mesh=None) -> torch.Tensor:
    """``jax.lax.with_sharding_constraint`` for tpu tensors: inside ``torchjax.jit``,
    tells XLA the layout of this intermediate (e.g. activations sharded on "dp"); in
    eager it reshards now. Same arguments, result and errors as ``shard``."""
    sharding = named_sharding(spec, mesh, "torchjax.sharding.constraint")
    check_divisible(t.shape, sharding, "torchjax.sharding.constraint")
    if t.requires_grad and torch.is_grad_enabled():
        return _Place.apply(t, sharding, True)
    return wrap(jax.lax.with_sharding_constraint(t.detach()._value(), sharding), t._device_index)


def sharding_of(t: torch.Tensor):
    """The ``jax.sharding.Sharding`` of a tpu tensor's data (``NamedSharding`` once
    placed with ``shard``, ``SingleDeviceSharding`` otherwise); None for a CPU tensor or
    inside a ``torchjax.jit`` trace (tracers have no placement yet)."""
    if not isinstance(t, JaxTensor):
        return None
    x = t._value()
    if isinstance(x, jax.core.Tracer):
        return None
    return x.sharding
